"""Which failures a retry can cure, MLflow's included: `mlm_pipeline.errors.is_transient`
for the library's and Python's exceptions, plus the MLflow client's server errors (this
package is the one that imports mlflow, lazily).

An `MlflowException` is transient when the server answered 5xx or 429 (`RestException`, or
the client's error for a non-JSON answer), when the store said "temporarily unavailable" or
"request limit exceeded" (a locked SQLite database is the former), or when it wraps a
transient I/O error (the REST client's connection failures and timeouts). Any other MLflow
error (a bad request, a missing run or model, a param that cannot change) is not.
"""

from __future__ import annotations

from mlm_pipeline.errors import is_transient

#: MLflow error codes of a server that may answer a second request.
_TRANSIENT_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})


def _transient_mlflow(exc: BaseException) -> bool:
    from mlflow.exceptions import MlflowException, RestException

    if not isinstance(exc, MlflowException):
        return False
    if exc.error_code in _TRANSIENT_CODES:
        return True
    if isinstance(exc, RestException) and exc.get_http_status_code() >= 500:
        return True
    wrapped = exc.__cause__ or exc.__context__
    return wrapped is not None and is_transient(wrapped)


def retry_cures(exc: BaseException) -> bool:
    """True when a second try may cure `exc`: `mlm_pipeline.errors.is_transient`, or an
    MLflow server error (see the module docstring)."""
    return is_transient(exc) or _transient_mlflow(exc)
