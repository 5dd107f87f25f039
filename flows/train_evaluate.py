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

Imported by `pretraining.py`, next to it (relatively, or as a top-level module when Prefect
loads a flow file as a script; see `flows/__init__.py`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from mlm_pipeline.app.summary import summary as run_summary
from mlm_pipeline.app.summary import summary_markdown
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (
    EvalManifest,
    ShardManifest,
    TokenizerManifest,
    TrainManifest,
)
from mlm_pipeline.sinks import MultiSink, StdoutSink
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows import tracking_tasks as tracking
from mlm_pipeline_flows.assets import report_model_asset
from mlm_pipeline_flows.pretrain_params import PreparedData, PretrainParams, flow_run_name
from mlm_pipeline_flows.task_support import (
    IO_RETRIES,
    NOT_CACHED,
    PrefectProgressSink,
    data_progress,
    retry_condition,
)

#: The flow's entry point (`prefect.yaml`), recorded as `mlflow.source.name` of the runs it
#: opens itself.
ENTRYPOINT = "flows/train_evaluate.py:train_evaluate_flow"


@contextlib.contextmanager
def stop_gracefully() -> Iterator[None]:
    """While training runs in the main thread, SIGINT and SIGTERM ask the loop to checkpoint
    the step it reached and stop (`TrainingInterrupted`) instead of aborting it mid-step;
    a second signal goes to the handler that was there before (Prefect's, or Python's
    KeyboardInterrupt). Elsewhere (a worker thread) nothing is installed."""
    from mlm_pipeline.train import loop

    previous: dict[int, Any] = {}

    def handler(signum, frame) -> None:
        if signum in previous and not loop.stop_requested():
            logging.getLogger(__name__).warning(
                "%s: checkpointing the step reached, then stopping (send it again to stop "
                "at once)", signal.Signals(signum).name)
            loop.request_stop()
            return
        old = previous.get(signum)
        if callable(old):
            old(signum, frame)
        else:
            raise KeyboardInterrupt

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        loop.clear_stop()


# One retry, for what a second try cures (`retry_condition`): I/O, a lost connection, an
# MLflow server error, a torchrun rank that died; it resumes from the newest checkpoint.
@task(name="train", retries=1, retry_condition_fn=retry_condition, **NOT_CACHED)
def train_task(
    cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest, run_id: str
) -> TrainManifest:
    """Pretrain; metrics stream to the console, MLflow and a progress artifact. A continued
    run (or a retry) resumes from the newest intact checkpoint of the run, and MLflow gets
    only the steps it does not hold yet (one value per step and key); a run whose training
    already reached `train.max_steps` (it failed after training) returns its manifest
    (`resume.finished_training`) without training. With
    `train.distributed` asking for several processes, torchrun runs the training
    (`train.launch.run_torchrun` with the tracking entry `tracking.torchrun_entry`): rank 0
    logs the metrics and the periodic evaluations to MLflow as it trains, the ranks' output
    streams into this task's log (the progress artifact follows rank 0's metric lines), and
    a failure names the failing rank."""
    from mlm_pipeline.tracking.parents import init_checkpoint, parent_tags
    from mlm_pipeline.tracking.torchrun_entry import live_tracking
    from mlm_pipeline.train import train

    done = resume.finished_training(tracking.train_dir(cfg, run_id), cfg.train.max_steps,
                                    shards.digest)
    if done is not None:  # a run that failed after training: nothing to train again
        logging.getLogger(__name__).info(
            "MLflow run %s trained all %d steps already (%s): not trained again", run_id,
            done.steps, done.checkpoint_dir)
        return done
    tracker = MlflowTracker.from_config(cfg.tracking)
    if cfg.train.distributed.world_size > 1:
        trained = _train_torchrun(cfg, shards, tokenizer, run_id, tracker)
        tracker.set_tags(run_id, parent_tags(trained.init))
        return trained
    mlflow_sink, evaluator = live_tracking(cfg, shards, tokenizer, tracker, run_id)
    sink = MultiSink(StdoutSink(), mlflow_sink, PrefectProgressSink(cfg.train.max_steps))
    with tracker.system_metrics(run_id):
        try:
            with stop_gracefully():
                trained = train(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                                tracking.train_dir(cfg, run_id), sink, evaluator,
                                init_checkpoint=init_checkpoint(cfg))
        finally:
            sink.close()
    # The parent (`train.init_from`, a param already): its digest and step as tags.
    tracker.set_tags(run_id, parent_tags(trained.init))
    return trained


def _train_torchrun(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                    run_id: str, tracker: MlflowTracker) -> TrainManifest:
    """`train_task` under torchrun: rank 0 of the launch feeds MLflow (sinks, periodic
    evaluator, system metrics); here every output line goes to the task log, and rank 0's
    metric lines move the progress artifact."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    from mlm_pipeline.tracking import torchrun_entry
    from mlm_pipeline.train.launch import run_torchrun, sink_line_step

    try:
        log = get_run_logger()
    except MissingContextError:  # called as `train_task.fn()` outside a run
        log = logging.getLogger(__name__)
    from mlm_pipeline.tracking.parents import launch_init

    extra = {**torchrun_entry.launch_extra(cfg, run_id, tracker),  # refuses FSDP2 + every_steps
             **launch_init(cfg, tracking.train_dir(cfg, run_id))}
    progress = PrefectProgressSink(cfg.train.max_steps)

    def on_line(line: str) -> None:
        log.info(line)
        step = sink_line_step(line)
        if step is not None:
            progress.log({}, step)

    return run_torchrun(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                        tracking.train_dir(cfg, run_id), on_line=on_line,
                        entry=torchrun_entry.ENTRY, extra=extra)


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
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_results(tracker, run_id, cfg, trained, evaluated)


@task(name="publish-model", **NOT_CACHED, **IO_RETRIES)
def publish_model_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest,
    tokenizer: TokenizerManifest, shards: ShardManifest | None = None,
) -> dict[str, Any] | None:
    """Log the exported model as the run's MLflow model and register it: `challenger`
    always, `champion` when better on the same data, the champion re-scored on this run's
    validation rows (`shards`) when it was evaluated on others (None when
    `tracking.log_model` is off); then the version's lineage tags and the eval metrics on
    the logged model (`tracking.version_lineage.record_lineage`)."""
    if not cfg.tracking.log_model:
        return None
    from mlm_pipeline.tracking import registry
    from mlm_pipeline.tracking.version_lineage import record_lineage

    name = cfg.tracking.registered_model_name or cfg.tracking.experiment_name
    tracker = MlflowTracker.from_config(cfg.tracking)
    registered = registry.publish(tracker, run_id, name, trained, evaluated,
                                  tokenizer.output_dir,
                                  next((p.text for p in cfg.eval.probes), "[MASK]."), shards)
    # The version's parent, data and steps added as its tags; the eval metrics on the
    # logged model, with the validation dataset.
    if shards is not None:
        record_lineage(tracker, registered, trained, evaluated, shards, tokenizer.digest)
    return registered


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
