"""The `mlm-pretraining` flow: `prepare-data` (ingest -> tokenizer -> shards) then
`train-evaluate` (train -> evaluate -> register), each a flow of its own.

Run it locally with `mlm-pipeline run CONFIG` (no server needed: Prefect starts a temporary
local API): both halves run as subflows in this process, one flow run tree. Through a
deployment with the `stages` parameter (`StageDeployments`, set by prefect.yaml's `gpu`
deployment), each half runs as a deployment of its own with `run_deployment`, on its own
work pool (data preparation on CPU workers, training on GPU workers); this flow waits for
each child flow run and fails with its state.

The contract between the halves: the work directory (`work_dir`) is shared by every worker,
and `train-evaluate` gets the config (`PretrainParams`, JSON) and `PreparedData`: the three
stage manifests by path and digest in that directory. Here, after a `prepare-data`
deployment run, they are found by the stages' digests (`prepare_data.locate_prepared`),
so nothing but the shared directory carries data between machines.

The MLflow run is opened here first (a failure in a data stage leaves a FAILED run with the
config) and handed to `train-evaluate` by id, which records the data, trains, evaluates,
registers and closes it; if the child could not close it (it never started), this flow does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow

from mlm_pipeline.tracking import MlflowTracker, resume

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows.prepare_data import (  # noqa: F401 - the tasks, re-exported
    ingest_task,
    locate_prepared,
    prepare_data_flow,
    shards_task,
    tokenizer_task,
)
from mlm_pipeline_flows.pretrain_params import (
    PreparedData,  # noqa: F401 - re-exported for tests and users
    PretrainParams,
    StageDeployments,
    flow_run_name,
)
from mlm_pipeline_flows.tracking_tasks import CLOSING_HOOKS, end_tracking, start_tracking
from mlm_pipeline_flows.train_evaluate import train_evaluate_flow

#: The flow's entry point (`prefect.yaml`), recorded as the MLflow run's `mlflow.source.name`.
ENTRYPOINT = "flows/pretraining.py:mlm_pretraining"


def run_stage_deployment(name: str, parameters: dict[str, Any]) -> Any:
    """Run deployment `name` (`flow/deployment`) with JSON `parameters` as a child of the
    current flow run and wait for it to end (no timeout: training takes hours).

    Returns:
        The child's `FlowRun`, Completed.

    Raises:
        RuntimeError: the child ended in another state (Failed, Crashed, Cancelled); the
            message names the deployment, the child flow run and its state's message.
    """
    from prefect.deployments import run_deployment

    child = run_deployment(name, parameters=parameters, timeout=None)
    if (state := child.state) is None or not state.is_completed():
        raise RuntimeError(f"deployment {name}: flow run {child.name} ({child.id}) ended "
                           f"{state.name if state else 'no state'}: "
                           f"{state.message if state else ''}")
    return child


@flow(name="mlm-pretraining", flow_run_name=flow_run_name, **CLOSING_HOOKS)
def mlm_pretraining(
    params: PretrainParams = PretrainParams(),  # noqa: B008
    stages: StageDeployments | None = None,
) -> dict[str, Any]:
    """Pretrain a masked language model end to end and return the run summary (with
    `stages`, the child flow runs' ids instead of the summary, which stays on the
    `train-evaluate` flow run: its artifact `run-summary` and the MLflow run's note).

    Args:
        params: the config and its overrides; `retrain: continue` starts from the
            registered champion when there is one (`PretrainParams.resolve_retrain`).
        stages: the deployments to run the two halves as (each on its own work pool);
            None runs them as subflows here.

    Raises:
        The error of the failed stage (subflows), or `RuntimeError` naming the child
        deployment run that did not complete.
    """
    # The library logs at INFO through Prefect's handlers (PREFECT_LOGGING_EXTRA_LOGGERS);
    # without this its level is the root logger's WARNING outside the CLI.
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    started_at = time.time()  # stages made before this were reused (summary)
    # `retrain: continue` becomes warm-start overrides (or not, with no champion) once,
    # here: both halves then load the same resolved parameters.
    params, retrain_tags = params.resolve_retrain()
    cfg = params.load()
    run_id = start_tracking(cfg, ENTRYPOINT)
    if retrain_tags:
        MlflowTracker.from_config(cfg.tracking).set_tags(run_id, retrain_tags)
    passed = {"mlflow_run_id": run_id, "started_at": started_at, "entrypoint": ENTRYPOINT}
    try:
        if stages is None:
            data = prepare_data_flow(params)
            return train_evaluate_flow(params, data, **passed)
        json_params = params.model_dump(mode="json")
        prepared = run_stage_deployment(stages.prepare_data, {"params": json_params})
        data = locate_prepared(cfg).model_dump(mode="json")
        trained = run_stage_deployment(stages.train_evaluate,
                                       {"params": json_params, "data": data, **passed})
        return {"mlflow_run_id": run_id, "prepare_data_flow_run_id": str(prepared.id),
                "train_evaluate_flow_run_id": str(trained.id), "data": data}
    except BaseException as exc:
        end_tracking(cfg, run_id, *resume.failure_tags(exc), if_running=True)
        raise
