"""The MLflow run's lifecycle as Prefect tasks: open (or continue) it, record the data it
trains on, close it; and the flow-run state hooks that close it when the flow run's
process could not (cancellation, crash).

Where the run opens: in the flow the user started. `mlm-pretraining` opens it first (a
failure in a data stage leaves a FAILED run with the config) and hands its id to
`train-evaluate`; `train-evaluate` started alone opens its own. `train-evaluate` records the
data (lineage belongs to the training run), trains, evaluates, registers and closes it.
"""

from __future__ import annotations

import logging

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.runtime import deployment, flow_run
from prefect.utilities.urls import url_for

from mlm_pipeline.app.open_run import open_or_continue, record_data
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import CorpusManifest, ShardManifest, TokenizerManifest
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline

from mlm_pipeline_flows.pretrain_params import PretrainParams
from mlm_pipeline_flows.task_support import IO_RETRIES, NOT_CACHED


def keep_name(tracker: MlflowTracker, run_id: str) -> str:
    """The current flow run takes the MLflow run's name (a continued run keeps its own, a
    child flow run its parent's), on the server and in this process's flow-run context
    (`prefect.runtime.flow_run.name`), and tag `prefect.flow_run_name`; returns `run_id`."""
    if flow_run.id:
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext

        name = tracker.get_run(run_id).info.run_name
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(flow_run.id, name)
        if (context := FlowRunContext.get()) is not None and context.flow_run is not None:
            context.flow_run.name = name
        tracker.set_tags(run_id, {"prefect.flow_run_name": name})
    return run_id


@task(name="start-tracking", **NOT_CACHED, **IO_RETRIES)
def start_tracking(cfg: PipelineConfig, entrypoint: str, fresh: bool = False) -> str:
    """Open the MLflow run, or continue this job's unfinished one (`app.open_run.
    open_or_continue`; `ResumeRefusedError` before any data stage); returns its id.
    `entrypoint` (e.g. `flows/pretraining.py:mlm_pretraining`) is recorded as
    `mlflow.source.name`; the current flow run's id, name, page and deployment as tags."""
    extra = {}
    if flow_run.id:
        extra = {"prefect.flow_run_id": str(flow_run.id),
                 "prefect.flow_run_name": str(flow_run.name)}
        # The UI's route, as the engine's "View at" log line (`prefect.runtime`'s
        # `flow_run.ui_url` is `/flow-runs/flow-run/<id>`, which the UI does not serve).
        if url := url_for("flow-run", obj_id=str(flow_run.id)):
            extra["prefect.flow_run_url"] = url
        if deployment.id:
            extra["prefect.deployment_id"] = str(deployment.id)
            extra["prefect.deployment_name"] = str(deployment.name)
    tracker = MlflowTracker.from_config(cfg.tracking)
    tags = pipeline.run_tags(extra, entrypoint, "JOB" if deployment.id else "LOCAL")
    # One name for both runs: the flow run's (`flow_run_name`), unless the config sets one.
    opened = open_or_continue(cfg, tracker, tags, fresh=fresh,
                              run_name=str(flow_run.name) if flow_run.id else None)
    return keep_name(tracker, opened.run_id) if opened.continued else opened.run_id


@task(name="record-data", **NOT_CACHED, **IO_RETRIES)
def record_data_task(
    cfg: PipelineConfig, run_id: str, corpus: CorpusManifest, tokenizer: TokenizerManifest,
    shards: ShardManifest, entrypoint: str,
) -> str:
    """Log data lineage, accounting and the tokenizer to MLflow (once per run: a continued
    run already has them) and the accounting table to Prefect. A continued run whose data
    changed since (a corpus update) is closed KILLED and a new run takes over (opened with
    `entrypoint`); returns the id of the run that goes on."""
    create_table_artifact(key="ingestion-accounting", table=pipeline.accounting_rows(corpus),
                          description="documents read, kept, dropped and repaired, by reason")
    return record_data(MlflowTracker.from_config(cfg.tracking), run_id, corpus, tokenizer,
                       shards, lambda: start_tracking.fn(cfg, entrypoint, fresh=True))


@task(name="end-tracking", **NOT_CACHED, **IO_RETRIES)
def end_tracking(cfg: PipelineConfig, run_id: str, status: str,
                 tags: dict[str, str] | None = None, if_running: bool = False) -> None:
    """Close the MLflow run with `FINISHED`, `FAILED` or `KILLED`, after setting `tags`
    (why it failed: `resume.failure_tags`). With `if_running`, a run already closed (by
    the child flow run that failed, with its own reason) is left as it is."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    if if_running and tracker.get_run(run_id).info.status != "RUNNING":
        return
    if tags:
        tracker.set_tags(run_id, tags)
    tracker.end_run(run_id, status)


def close_mlflow_run(status: str, what: str):
    """A flow-run state hook that closes the flow run's MLflow run(s) with `status` when its
    process could not (cancellation, crash): those tagged with the flow run's id, and the
    one its `mlflow_run_id` parameter names (a `train-evaluate` child), when RUNNING."""

    def hook(flow, flow_run, state) -> None:
        try:
            params = PretrainParams.model_validate(flow_run.parameters.get("params") or {})
            tracker = MlflowTracker.from_config(params.load().tracking)
            note = (f"Prefect flow run {flow_run.name} was {what}; run the same deployment "
                    "again to continue from the newest checkpoint.")
            closed = resume.close_runs_of_flow_run(tracker, str(flow_run.id), status, note)
            given = flow_run.parameters.get("mlflow_run_id")
            if given and tracker.get_run(given).info.status == "RUNNING":
                tracker.set_tags(given, {"mlflow.note.content": note,
                                         "mlm.error": f"flow run {status.lower()}"})
                tracker.end_run(given, status)
                closed.append(given)
            if closed:
                logging.getLogger(__name__).info("MLflow run(s) %s closed %s", closed, status)
        except Exception as exc:  # noqa: BLE001 - a hook must not mask the flow's state
            logging.getLogger(__name__).warning("could not close the MLflow run: %s", exc)

    return hook


#: The state hooks of a flow that opens or continues an MLflow run.
CLOSING_HOOKS = {"on_cancellation": [close_mlflow_run("KILLED", "cancelled")],
                 "on_crashed": [close_mlflow_run("FAILED", "crashed")]}
