"""What MLflow gets from evaluations: the periodic evaluator of a tracked run and the
fill-mask table.

`periodic_evaluator` builds the training loop's `PeriodicEvaluator` for a run: its metrics
go through the run's sinks (the loop logs them), its fill-mask rows are appended to the
run's table `eval/fill_mask_table.json` (`MlflowClient.log_table`: one row per step,
sentence, mask and rank, which the MLflow UI shows as a table to filter by step), and the
downstream linear probe joins every point when `linear_probe.at_each_eval` is set. A
continued run re-trains the steps between its checkpoint and the kill: rows of steps the
run already holds are not appended twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from mlm_pipeline.config import FillMaskProbe, PipelineConfig
from mlm_pipeline.manifest import EvalManifest, ShardManifest, TokenizerManifest
from mlm_pipeline.tracking.tracker import MlflowTracker

if TYPE_CHECKING:
    from mlm_pipeline.evaluate.periodic import PeriodicEvaluator

logger = logging.getLogger(__name__)

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


def log_final_fill_mask_rows(tracker: MlflowTracker, run_id: str, evaluated: EvalManifest,
                             probes: list[FillMaskProbe], step: int) -> int:
    """Append the final evaluation's fill-mask predictions (`evaluated.probes`, made from
    `probes` in order) at `step`; returns the rows appended."""
    from mlm_pipeline.evaluate.probes import table_rows

    return log_fill_mask_rows(tracker, run_id, table_rows(evaluated.probes, probes, step))


def periodic_evaluator(cfg: PipelineConfig, shards: ShardManifest,
                       tokenizer: TokenizerManifest, tracker: MlflowTracker, run_id: str,
                       held_step: int = 0) -> PeriodicEvaluator | None:
    """The `PeriodicEvaluator` of a tracked run, or None when `eval.every_steps` is unset.

    Args:
        cfg: the run's config (`eval`, `masking`, `train.document_attention`,
            `linear_probe`).
        shards, tokenizer: the run's inputs.
        tracker, run_id: the MLflow run that gets the fill-mask rows.
        held_step: the last step the run already holds (a continued run): rows of steps up
            to it are not logged again.
    """
    if cfg.eval.every_steps is None:
        return None
    from mlm_pipeline.evaluate.downstream import linear_probe
    from mlm_pipeline.evaluate.periodic import PeriodicEvaluator

    def on_probes(rows: list[dict[str, Any]], step: int) -> None:
        if step > held_step:
            log_fill_mask_rows(tracker, run_id, rows)

    extra = None
    if cfg.linear_probe.enabled and cfg.linear_probe.at_each_eval:
        def extra(model, step: int) -> dict[str, float]:
            return linear_probe(cfg.linear_probe, model, evaluator.tokenizer,
                                seq_len=shards.seq_len,
                                device=next(model.parameters()).device) or {}

    evaluator = PeriodicEvaluator(cfg.eval, cfg.masking, shards, tokenizer,
                                  document_attention=cfg.train.document_attention,
                                  on_probes=on_probes, extra=extra)
    return evaluator
