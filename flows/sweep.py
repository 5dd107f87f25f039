"""The `mlm-sweep` flow: one config trained with every combination of a grid of keys, on
data prepared once, as one MLflow parent run with a nested run per child
(`mlm_pipeline.app.sweep`).

`prepare-data` runs once; then each child runs `train-evaluate` in this process in a run
nested under the parent. A failed child is recorded and the others still run; the parent
then ends FAILED (with the failed combinations) and the flow fails after the last child.
Run it with `mlm-pipeline run CONFIG --sweep train.lr=1e-4,3e-4`, or through the `sweep`
deployment (`--param 'sweep={"train.lr": ["1e-4", "3e-4"]}'`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from mlm_pipeline.app import sweep as plan
from mlm_pipeline.errors import TrainingInterrupted
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline

# Absolute, under the one installed name (see flows/__init__.py).
from mlm_pipeline_flows.prepare_data import prepare_data_flow
from mlm_pipeline_flows.pretrain_params import PretrainParams, flow_run_name
from mlm_pipeline_flows.tracking_tasks import CLOSING_HOOKS, start_tracking
from mlm_pipeline_flows.train_evaluate import train_evaluate_flow

#: The flow's entry point (`prefect.yaml`), recorded as `mlflow.source.name`.
ENTRYPOINT = "flows/sweep.py:mlm_sweep"


@flow(name="mlm-sweep", flow_run_name=flow_run_name, **CLOSING_HOOKS)
def mlm_sweep(params: PretrainParams, sweep: dict[str, list[str | int | float | bool]]
              ) -> dict[str, Any]:
    """Train `params`' config once per combination of `sweep` (config key -> its values),
    on data prepared once; returns the parent run's record (`plan.finish_parent`) with
    each child's run summary under `summaries`.

    Raises:
        ConfigError: a key of a data section is swept, or a child's config is invalid.
        RuntimeError: a child failed (after every child ran; its error is in its run).
    """
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    log = logging.getLogger(__name__)
    started_at = time.time()
    grid = {k: [str(v) for v in values] for k, values in sweep.items()}
    base = params.load()
    combos = plan.children(grid)
    kids = [params.model_copy(update={"overrides": [*params.overrides, *c]}) for c in combos]
    plan.check_children(base, [k.load() for k in kids], grid)
    tracker = MlflowTracker.from_config(base.tracking)
    tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
    name = base.tracking.run_name or (str(flow_run.name) if flow_run.id else None)
    parent = plan.open_parent(tracker, base, grid,
                              pipeline.run_tags(tags, ENTRYPOINT, "LOCAL"), run_name=name)
    done, failed, summaries = [], [], []
    try:
        data = prepare_data_flow(params)
        for combo, child in zip(combos, kids):
            found = plan.child_of(tracker, parent, combo)
            if found is not None and found[1] == "FINISHED":
                log.info("sweep: %s trained already (run %s)", combo, found[0])
                done.append(found[0])
                continue
            child = child.model_copy(update={"overrides": [
                *child.overrides, *plan.child_overrides(found),
                f"tracking.run_name={plan.child_name(tracker.get_run(parent), combo)}"]})
            run_id = start_tracking(child.load(), ENTRYPOINT)
            tracker.set_tags(run_id, plan.child_tags(parent, combo))
            try:
                summaries.append(train_evaluate_flow(child, data, mlflow_run_id=run_id,
                                                     started_at=started_at,
                                                     entrypoint=ENTRYPOINT))
                done.append(run_id)
            except TrainingInterrupted:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded; the other children run
                log.error("sweep: %s failed: %s", combo, exc)
                failed.append(combo)
    except BaseException as exc:  # a data stage failed, or an interruption: close it
        status, why = resume.failure_tags(exc)
        tracker.set_tags(parent, why)
        tracker.end_run(parent, status)
        raise
    result = plan.finish_parent(tracker, parent, done, failed)
    if failed:
        raise RuntimeError(f"sweep {parent}: {len(failed)} of {len(combos)} children failed: "
                           f"{failed}")
    return {**result, "summaries": summaries, "mlflow_run_id": parent,
            "mlflow_tracking_uri": tracker.tracking_uri}
