"""The `mlm-pipeline` console script: `run` gets the `mlm-pretraining` flow, every other
command goes to `mlm_pipeline.cli.main` as it is.

The library never imports the flows, so the flow is handed to it here
(`mlm_pipeline.cli.main(argv, run_flow=run_pretraining)`). Installed, this module is
`mlm_pipeline_flows.cli` (the console script's target); in a checkout it is also
`python -m flows.cli`. Prefect is imported only when `run` starts the flow, so the other
commands start as fast as the library does.

`run` executes the flow in this process. Without `PREFECT_API_URL` Prefect starts a
temporary local API, so no server is needed; with it, the run is recorded on that server.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlm_pipeline import cli


def run_pretraining(config: str, overrides: list[str]) -> dict[str, Any]:
    """Run the `mlm-pretraining` flow in this process.

    Args:
        config: config name (`tiny`) or YAML path.
        overrides: dotted `key=value` overrides applied after the file.

    Returns:
        The run summary (MLflow run id, metrics, manifest paths, wall times). A failing
        task's exception propagates (Prefect has logged its traceback).
    """
    # Settings read when prefect is imported: route our library logs through Prefect's
    # handlers and silence the temporary server's analytics (harmless "database is
    # locked" tracebacks otherwise; see shared notes).
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "mlm_pipeline")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    from .pretraining import PretrainParams, mlm_pretraining

    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    return mlm_pretraining(PretrainParams(config=config, overrides=list(overrides)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mlm-pipeline` console script; returns the exit status
    (`mlm_pipeline.cli.main`)."""
    return cli.main(argv, run_flow=run_pretraining)


if __name__ == "__main__":
    sys.exit(main())
