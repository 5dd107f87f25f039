"""The run's fill-mask table `eval/fill_mask_table.json` (`MlflowClient.log_table`: one
row per step, sentence, mask and rank, which the MLflow UI shows as a table to filter by
step), appended at every evaluation (`app.training_run.periodic_evaluator`) and at the
final one (`app.publish.record_results`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

from mlm_pipeline.tracking.tracker import MlflowTracker


#: Run artifact of the fill-mask table (appended at every evaluation).
FILL_MASK_TABLE = "eval/fill_mask_table.json"
#: Its columns, in order (`evaluate.probes.table_rows`).
TABLE_COLUMNS = ("step", "sentence", "mask", "rank", "token", "probability", "expected", "hit")


def log_fill_mask_rows(tracker: MlflowTracker, run_id: str,
                       rows: Iterable[dict[str, Any]]) -> int:
    """Append fill-mask rows (`evaluate.probes.table_rows`) to the run's table.

    Returns:
        The number of rows appended (0: nothing logged).
    """
    rows = list(rows)
    if rows:
        # log_table downloads the table to append to it: no progress bar for that in the
        # middle of the training log.
        with _no_artifact_progress_bar():
            tracker.client.log_table(run_id,
                                     data={c: [r[c] for r in rows] for c in TABLE_COLUMNS},
                                     artifact_file=FILL_MASK_TABLE)
    return len(rows)


@contextlib.contextmanager
def _no_artifact_progress_bar() -> Iterator[None]:
    """Turn MLflow's artifact download/upload progress bar off for the block (it reads
    `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR` at each call)."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
