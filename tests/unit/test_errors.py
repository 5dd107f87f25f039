"""Which failures a retry can cure, decided by type (`mlm_pipeline.errors.is_transient`,
`tracking.failures.retry_cures`, the flows' `retry_condition`), and the status a failure
gives its MLflow run (`resume.failure_tags`), also by type."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlm_pipeline import errors
from mlm_pipeline.config_files import ConfigError, load_config
from mlm_pipeline.tracking.failures import retry_cures
from mlm_pipeline.tracking.resume import failure_tags

NOT_CURED = [
    errors.ConfigError("tiny.yaml: train.lr: must be > 0"),
    errors.MissingDependencyError("export needs transformers"),
    errors.CompileError("train.compile=on: torch.compile failed"),
    errors.CorruptInputError("shard-00000.arrow: sha256 differs"),
    errors.ResumeRefusedError("cannot continue"),
    errors.NonFiniteLossError("loss non-finite at step 3", 3, None),
    errors.TrainingInterrupted(4, Path("step-00000004")),
    ModuleNotFoundError("No module named 'transformers'"),
    FileNotFoundError("corpus.txt"),
    PermissionError("work_dir"),
    ValueError("bad input"),
    KeyError("eval/loss"),
    RuntimeError("any other runtime error"),  # no longer counted as transient
]
CURED = [
    ConnectionResetError("connection reset by peer"),
    TimeoutError("read timed out"),
    OSError(5, "Input/output error"),
    BrokenPipeError("broken pipe"),
]


@pytest.mark.parametrize("exc", NOT_CURED, ids=lambda e: type(e).__name__)
def test_what_a_retry_cannot_cure_is_not_retried(exc):
    assert not errors.is_transient(exc)
    assert not retry_cures(exc)


@pytest.mark.parametrize("exc", CURED, ids=lambda e: type(e).__name__)
def test_io_and_connection_errors_are_retried(exc):
    assert errors.is_transient(exc)
    assert retry_cures(exc)


def test_a_marked_transient_failure_is_retried_whatever_else_it_is():
    class RankDied(RuntimeError, errors.TransientError):
        pass

    assert retry_cures(RankDied("rank 1 exited with signal 9"))


def test_the_classes_keep_the_builtin_bases_callers_catch():
    # `except ValueError` / `except RuntimeError` written before the types existed
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.CorruptInputError, ValueError)
    assert issubclass(errors.ResumeRefusedError, ValueError)
    assert issubclass(errors.MissingDependencyError, RuntimeError)
    assert issubclass(errors.CompileError, RuntimeError)
    assert issubclass(errors.NonFiniteLossError, RuntimeError)


def test_a_bad_override_raises_the_one_config_error_type():
    with pytest.raises(errors.ConfigError):
        load_config("tiny", ["train.lr"])
    assert ConfigError is errors.ConfigError


def test_mlflow_server_errors_are_retried_and_client_errors_are_not():
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

    assert retry_cures(RestException({"error_code": "INTERNAL_ERROR", "message": "boom"}))
    assert retry_cures(MlflowException("database is locked",
                                       error_code=TEMPORARILY_UNAVAILABLE))
    try:  # the REST client's shape for a lost connection: raised while handling it
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise MlflowException(f"API request failed with exception {exc}")  # noqa: B904
    except MlflowException as lost:
        assert retry_cures(lost)
    assert not retry_cures(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST",
                                          "message": "Run 'x' not found"}))
    assert not retry_cures(MlflowException("Changing param values is not allowed",
                                           error_code=INVALID_PARAMETER_VALUE))


def test_the_flows_retry_condition_reads_the_failed_state():
    from prefect.states import Completed, Failed

    from mlm_pipeline_flows.task_support import retry_condition

    assert retry_condition(None, None, Failed(data=ConnectionResetError("reset")))
    assert not retry_condition(None, None, Failed(
        data=errors.MissingDependencyError("export needs transformers")))
    assert not retry_condition(None, None, Failed(data=RuntimeError("a bug")))
    assert not retry_condition(None, None, Completed(data=1))


def test_failure_tags_classify_by_type_not_by_name():
    class NamedLikeIt(Exception):
        pass

    NamedLikeIt.__name__ = "TrainingInterrupted"  # a name alone does not make it one
    assert failure_tags(NamedLikeIt("x"))[1]["mlm.stop_reason"] == "error"
    assert failure_tags(NamedLikeIt("x"))[0] == "FAILED"

    class Stopped(errors.TrainingInterrupted):
        pass

    status, tags = failure_tags(Stopped(7, Path("step-00000007")))
    assert (status, tags["mlm.stop_reason"], tags["mlm.error_step"]) == (
        "KILLED", "interrupted", "7")
    status, tags = failure_tags(errors.NonFiniteLossError("nan at step 3", 3, None))
    assert (status, tags["mlm.stop_reason"]) == ("FAILED", "nonfinite")
