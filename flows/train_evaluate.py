"""The `train-evaluate` flow: train -> evaluate -> record -> register (the GPU work pool).

It takes a config (`PretrainParams`) and the data `prepare-data` made (`PreparedData`: the
manifests by path and digest in the shared work directory), so one preparation serves any
number of training runs (a sweep over `train.*`, `model.*`, `eval.*`): no data stage runs
here. The data sections of the config must be those the data was prepared with (checked by
digest, `PreparedData.load`).

The MLflow run: the `mlflow_run_id` parameter names the one `mlm-pretraining` opened;
without it (started alone) this flow opens its own, or continues this job's unfinished one
(`tracking.resume`). Here the data is recorded on it (lineage belongs to the training run),
and it is closed at the end: FINISHED, or FAILED/KILLED with the reason
(`resume.failure_tags`); a cancelled or crashed flow run's hook closes it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from mlm_pipeline.app.summary import summary as run_summary
from mlm_pipeline.app.summary import summary_markdown
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import EvalManifest, ShardManifest, TokenizerManifest, TrainManifest
from mlm_pipeline.tracking import MlflowTracker, resume

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows import tracking_tasks as tracking
from mlm_pipeline_flows.assets import report_model_asset
from mlm_pipeline_flows.pretrain_params import PreparedData, PretrainParams, flow_run_name
from mlm_pipeline_flows.task_support import (IO_RETRIES, NOT_CACHED, PrefectProgressSink,
                                             data_progress, retry_condition)

#: The flow's entry point (`prefect.yaml`), recorded as `mlflow.source.name` of the runs it
#: opens itself.
ENTRYPOINT = "flows/train_evaluate.py:train_evaluate_flow"


# One retry, for what a second try cures (`retry_condition`): I/O, a lost connection, an
# MLflow server error, a torchrun rank that died; it resumes from the newest checkpoint.
@task(name="train", retries=1, retry_condition_fn=retry_condition, **NOT_CACHED)
def train_task(
    cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest, run_id: str
) -> TrainManifest:
    """Pretrain (`app.training_run.train_tracked`): metrics stream to the console, MLflow
    and a progress artifact; a continued run (or a retry) resumes from the newest intact
    checkpoint; a torchrun launch's output lines go to this task's log."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    from mlm_pipeline.app.training_run import train_tracked

    try:
        log = get_run_logger()
    except MissingContextError:  # called as `train_task.fn()` outside a run
        log = logging.getLogger(__name__)
    return train_tracked(cfg, shards, tokenizer, run_id,
                         progress=lambda: PrefectProgressSink(cfg.train.max_steps),
                         log_line=log.info)


@task(name="evaluate", **NOT_CACHED)
def evaluate_task(
    cfg: PipelineConfig, trained: TrainManifest, shards: ShardManifest,
    tokenizer: TokenizerManifest,
) -> EvalManifest:
    """Held-out masked-token metrics, fill-mask probes, the downstream linear probe and the
    fine-tuning evaluation."""
    from mlm_pipeline.evaluate import evaluate
    from mlm_pipeline.ingest import read_holdout

    return evaluate(cfg.eval, trained, shards, tokenizer, cfg.work_dir, cfg.linear_probe,
                    data_progress(), holdout=read_holdout(cfg), finetune=cfg.finetune)


@task(name="record-results", **NOT_CACHED, **IO_RETRIES)
def record_results_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest
) -> None:
    """Log eval metrics, probes and the final checkpoint to the MLflow run."""
    from mlm_pipeline.app.publish import record_results

    record_results(MlflowTracker.from_config(cfg.tracking), run_id, cfg, trained, evaluated)


@task(name="publish-model", **NOT_CACHED, **IO_RETRIES)
def publish_model_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest,
    tokenizer: TokenizerManifest, shards: ShardManifest | None = None,
) -> dict[str, Any] | None:
    """Log, register and decide the run's model, then its version's lineage tags
    (`app.publish.publish_model`; None when `tracking.log_model` is off)."""
    from mlm_pipeline.app.publish import publish_model

    return publish_model(cfg, run_id, trained, evaluated, tokenizer, shards)


@flow(name="train-evaluate", flow_run_name=flow_run_name, **tracking.CLOSING_HOOKS)
def train_evaluate_flow(
    params: PretrainParams, data: PreparedData, mlflow_run_id: str | None = None,
    started_at: float | None = None, entrypoint: str = ENTRYPOINT,
) -> dict[str, Any]:
    """Train and evaluate on prepared data, register the model, close the MLflow run;
    returns the run summary.

    Args:
        params: the config (its data sections must be those `data` was prepared with).
        data: the manifests `prepare-data` returned.
        mlflow_run_id: the MLflow run to go on with (opened by `mlm-pretraining`); None
            opens one (or continues this job's unfinished one).
        started_at: Unix time (s) the pipeline run started: stages made before it are
            listed as reused in the summary (default: this flow run's start).
        entrypoint: `mlflow.source.name` of a run opened here (on a data change).

    Raises:
        ValueError, FileNotFoundError: `data` is missing, changed, or does not match the
            config (`PreparedData.load`); then the errors of the stages.
    """
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    started_at = time.time() if started_at is None else started_at
    cfg = params.load()
    tracker = MlflowTracker.from_config(cfg.tracking)
    run_id = (tracking.keep_name(tracker, mlflow_run_id) if mlflow_run_id
              else tracking.start_tracking(cfg, entrypoint))
    try:
        corpus, tokenizer, shards = data.load(cfg)
        run_id = tracking.record_data_task(cfg, run_id, corpus, tokenizer, shards, entrypoint)
        from mlm_pipeline.evaluate import check_evaluable  # torch: not at import time

        check_evaluable(shards)
        trained = train_task(cfg, shards, tokenizer, run_id)
        evaluated = evaluate_task(cfg, trained, shards, tokenizer)
        record_results_task(cfg, run_id, trained, evaluated)
        registered = publish_model_task(cfg, run_id, trained, evaluated, tokenizer, shards)
        report_model_asset(trained, tokenizer, shards, registered)
    except BaseException as exc:
        tracking.end_tracking(cfg, run_id, *resume.failure_tags(exc))
        raise
    tracking.end_tracking(cfg, run_id, "FINISHED")
    if cfg.tracking.keep_last_runs is not None:
        from mlm_pipeline.app.gc import keep_last_runs

        keep_last_runs(tracker, cfg)
    summary = run_summary(tracker, run_id, corpus, tokenizer, shards, trained, evaluated,
                          started_at, registered)
    markdown = summary_markdown(summary)
    tracker.set_tags(run_id, {"mlflow.note.content": markdown})  # the run's description
    create_markdown_artifact(key="run-summary", markdown=markdown,
                             description="final metrics and the MLflow run")
    return summary
