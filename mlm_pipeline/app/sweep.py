"""A sweep: several training runs of one config that differ in a few keys, on data prepared
once, grouped in MLflow as one parent run with a nested run per child.

The parent run (`open_parent`) holds the base config's params and the grid; each child is
a run of its own nested under it (MLflow's tag `mlflow.parentRunId`, which the UI's runs
table groups by). Rerun after an interruption, the same sweep (same base config and grid)
continues its unfinished parent, skips the children it holds FINISHED and continues each
unfinished child in its own run (`tracking.resume_run_id`): never in a sibling's, whose job
key (the data sections) is the same. `runs --parent RUN` lists a parent's children;
`compare PARENT` compares them. mlflow is imported inside the functions.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import ConfigError
from mlm_pipeline.tracking import records, resume
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)

#: Tag of a sweep's parent run (`parent`).
SWEEP_TAG = "mlm.sweep"
#: Tag identifying a sweep (its base config's job key and grid), to continue its parent.
KEY_TAG = "mlm.sweep_key"
#: Tag of a child run: its combination, as the JSON list of its overrides.
CHILD_TAG = "mlm.sweep_child"
#: MLflow's tag of a nested run: the id of its parent run.
PARENT_TAG = "mlflow.parentRunId"
#: Sections a sweep may not vary: the data all children train on is prepared once.
DATA_SECTIONS = ("ingest", "tokenizer", "shards", "masking")

#: A grid: config key -> the values it takes (as override strings), in order.
Grid = dict[str, list[str]]


def parse_grid(items: Sequence[str]) -> Grid:
    """A grid from `KEY=V1,V2,...` items (a value list may also be a JSON list:
    `KEY=[1e-4, 3e-4]`), keys in the order given.

    Raises:
        ConfigError: an item has no `=`, no value, a key given twice, or a value twice.
    """
    grid: Grid = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2 (e.g. train.lr=1e-4,3e-4)")
        if key in grid:
            raise ConfigError(f"--sweep {key}: given twice; list its values once")
        if text.strip().startswith("["):
            try:
                values = [str(v) for v in json.loads(text)]
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--sweep {item!r}: not a JSON list ({exc})") from exc
        else:
            values = [v.strip() for v in text.split(",")]
        if not values or any(v == "" for v in values):
            raise ConfigError(f"--sweep {item!r}: an empty value")
        if len(set(values)) != len(values):
            raise ConfigError(f"--sweep {item!r}: a value listed twice")
        grid[key] = values
    return grid


def children(grid: Grid) -> list[list[str]]:
    """Each child's overrides (`key=value`, in the grid's key order), every combination
    of the grid, the first key varying slowest."""
    return [[f"{k}={v}" for k, v in zip(grid, combo)]
            for combo in itertools.product(*grid.values())]


def check_children(base: PipelineConfig, configs: Sequence[PipelineConfig], grid: Grid) -> None:
    """Refuse a sweep whose children differ in their data (one preparation serves all).

    Raises:
        ConfigError: a swept key changes a data section (the keys named).
    """
    bad = [k for k in grid if k.split(".")[0] in DATA_SECTIONS]
    changed = [s for s in DATA_SECTIONS for cfg in configs
               if getattr(cfg, s) != getattr(base, s)]
    if bad or changed:
        raise ConfigError(
            f"--sweep {', '.join(bad) or ', '.join(sorted(set(changed)))}: a sweep trains "
            f"every child on data prepared once, so it may not vary {', '.join(DATA_SECTIONS)}"
            "; run those as separate runs")


def sweep_key(base: PipelineConfig, grid: Grid) -> str:
    """Hex sha256 naming a sweep: its base config (flattened params) and its grid."""
    identity = {"params": {k: str(v) for k, v in records.run_params(base).items()},
                "job": resume.job_key(base), "grid": grid}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def open_parent(tracker: MlflowTracker, base: PipelineConfig, grid: Grid,
                tags: dict[str, str], run_name: str | None = None) -> str:
    """The sweep's parent run: its unfinished one continued (set RUNNING again), else a new
    run with the base config's params, the grid (`sweep.<key>`: JSON list) and `tags`;
    returns its id."""
    key = sweep_key(base, grid)
    found = tracker.client.search_runs(
        [tracker.experiment_id()], filter_string=f"tags.`{KEY_TAG}` = '{key}'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if found and found[0].info.status != "FINISHED":
        run_id = found[0].info.run_id
        tracker.client.update_run(run_id, status="RUNNING")
        tracker.set_tags(run_id, tags)
        logger.info("sweep: continuing parent run %s", run_id)
        return run_id
    params = {**records.run_params(base),
              **{f"sweep.{k}": json.dumps(v) for k, v in grid.items()},
              "sweep.children": len(children(grid))}
    return tracker.start_run(params, {**tags, SWEEP_TAG: "parent", KEY_TAG: key},
                             run_name=run_name)


def child_of(tracker: MlflowTracker, parent_id: str, overrides: list[str]
             ) -> tuple[str, str] | None:
    """(run id, status) of the newest run of combination `overrides` nested under the
    parent, or None."""
    tag = json.dumps(overrides)
    runs = tracker.client.search_runs(
        [tracker.experiment_id()], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'",
        order_by=["attributes.start_time DESC"], max_results=1000)
    for run in runs:
        if run.data.tags.get(CHILD_TAG) == tag:
            return run.info.run_id, run.info.status
    return None


def child_overrides(found: tuple[str, str] | None) -> list[str]:
    """What a child's run adds to its overrides: continue its own unfinished run
    (`tracking.resume_run_id`), else a new run (`tracking.resume=never`), never a
    sibling's."""
    return ([f"tracking.resume_run_id={found[0]}"] if found is not None
            else ["tracking.resume=never"])


def child_name(parent: Any, overrides: list[str]) -> str:
    """A child run's name: its parent's (an MLflow `Run`) and its values, each after the
    last part of its key, e.g. `tiny-bert-1000-3fa2c1-lr0.001-presetmodern`."""
    values = [f"{o.partition('=')[0].rsplit('.', 1)[-1]}{o.partition('=')[2]}"
              for o in overrides]
    return "-".join([parent.info.run_name or parent.info.run_id[:8], *values])


def child_tags(parent_id: str, overrides: list[str]) -> dict[str, str]:
    """The tags nesting a child's run under its parent, with its combination."""
    return {PARENT_TAG: parent_id, CHILD_TAG: json.dumps(overrides)}


def finish_parent(tracker: MlflowTracker, parent_id: str, child_ids: Sequence[str],
                  failed: Sequence[str]) -> dict[str, Any]:
    """Record the best child by `eval/loss` on the parent (tag `sweep.best_run`, metric
    `sweep/best_eval_loss`) and close it: FINISHED, or FAILED when a child failed (tag
    `sweep.failed`: their combinations). Returns `parent`, `children`, `best_run`,
    `best_eval_loss` (None without an `eval/loss`) and `failed`."""
    losses = {run_id: loss for run_id in child_ids
              if (loss := tracker.get_run(run_id).data.metrics.get("eval/loss")) is not None}
    best = min(losses, key=losses.get, default=None)
    if best is not None:
        tracker.set_tags(parent_id, {"sweep.best_run": best})
        tracker.log_metrics(parent_id, {"sweep/best_eval_loss": losses[best]}, step=0)
    if failed:
        tracker.set_tags(parent_id, {"sweep.failed": json.dumps(list(failed))})
    tracker.end_run(parent_id, "FAILED" if failed else "FINISHED")
    return {"parent": parent_id, "children": list(child_ids), "best_run": best,
            "best_eval_loss": losses.get(best), "failed": list(failed)}
