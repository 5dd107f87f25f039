"""The tracked training run: `train.train` with the run's MLflow sinks, its periodic
evaluator, its parent and its stop signal, in one process or under torchrun.

`train_tracked` is what the flows' train task does besides being a task: a run that already
trained `train.max_steps` returns its manifest (`finished_training`); metrics stream to
stdout, MLflow (`live_tracking`) and the caller's progress sink, with the periodic
evaluator and system metrics; the parent is fetched at a fresh start (`app.parents`) and
tagged; SIGINT and SIGTERM checkpoint and stop (`stop_on_signals`); with several processes,
torchrun runs the training (entry `app.torchrun_entry`, rank 0 logging to MLflow).
torch and mlflow are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlm_pipeline.app.parents import init_checkpoint
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest, TrainManifest
from mlm_pipeline.sinks import AfterStepSink, MetricsSink, MultiSink, StdoutSink
from mlm_pipeline.store import work_root
from mlm_pipeline.tracking import resume
from mlm_pipeline.tracking.fetch import parent_tags
from mlm_pipeline.tracking.fill_mask_table import log_fill_mask_rows
from mlm_pipeline.tracking.tracker import MlflowTracker

if TYPE_CHECKING:  # pragma: no cover
    from mlm_pipeline.evaluate.periodic import PeriodicEvaluator
    from mlm_pipeline.train.loop import StopSignal

logger = logging.getLogger(__name__)

#: The module `torchrun` runs on every rank of a tracked launch.
TORCHRUN_ENTRY = "mlm_pipeline.app.torchrun_entry"


def train_dir(cfg: PipelineConfig, run_id: str) -> Path:
    """Where the training stage of MLflow run `run_id` writes (checkpoints, metrics): in
    the work directory, or in the local mirror of a URL one (`mlm_pipeline.store`)."""
    return work_root(cfg.work_dir) / "train" / run_id


def finished_training(out_dir: str | Path, max_steps: int,
                      shards_digest: str) -> TrainManifest | None:
    """The `TrainManifest` of a training that reached `max_steps` in `out_dir` (a run
    that failed after training: `resume.plan` said `finish`), so that the rerun goes to
    the end stages without loading a model; None when training has steps left.

    Complete: `out_dir/manifest.json` records `max_steps` steps, stop reason `max_steps`,
    the shards `shards_digest`, and its checkpoint is the newest intact one.
    """
    from mlm_pipeline.manifest import find_manifest
    from mlm_pipeline.train.checkpoint import latest_intact_checkpoint

    try:
        trained = find_manifest(out_dir, TrainManifest)
    except (FileNotFoundError, ValueError):
        return None
    if (trained.steps != max_steps or trained.stop_reason != "max_steps"
            or trained.inputs.get("shards") != shards_digest):
        return None
    newest = latest_intact_checkpoint(Path(out_dir) / "checkpoints")
    if newest is None or newest.name != Path(trained.checkpoint_dir).name:
        return None
    return trained


def periodic_evaluator(cfg: PipelineConfig, shards: ShardManifest,
                       tokenizer: TokenizerManifest, tracker: MlflowTracker, run_id: str,
                       held_step: int = 0) -> PeriodicEvaluator | None:
    """The `PeriodicEvaluator` of a tracked run, or None when `eval.every_steps` is unset:
    its metrics go through the run's sinks (the loop logs them), its fill-mask rows are
    appended to the run's table (`tracking.fill_mask_table`), and the downstream linear
    probe joins every point when `linear_probe.at_each_eval` is set.

    Args:
        cfg: the run's config (`eval`, `masking`, `train.document_attention`,
            `linear_probe`).
        shards, tokenizer: the run's inputs.
        tracker, run_id: the MLflow run that gets the fill-mask rows.
        held_step: the last step the run already holds (a continued run re-trains the
            steps between its checkpoint and the kill): rows of steps up to it are not
            appended again.
    """
    if cfg.eval.every_steps is None:
        return None
    from mlm_pipeline.evaluate.downstream import linear_probe
    from mlm_pipeline.evaluate.periodic import PeriodicEvaluator

    def on_probes(rows: list[dict[str, Any]], step: int) -> None:
        """Append the fill-mask rows of a step the run does not hold yet."""
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


def live_tracking(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                  tracker: MlflowTracker, run_id: str
                  ) -> tuple[MetricsSink, PeriodicEvaluator | None]:
    """What the process that trains (one process, or rank 0 of a launch) logs to MLflow
    through: the run's `MlflowSink`, wrapped in `AfterStepSink` past the last step the run
    already holds of each key (`resume.logged_steps`: a resumed run sends no step of a key
    twice, and misses none, evaluation points included), and the periodic evaluator
    (`periodic_evaluator`, None without `eval.every_steps`), whose fill-mask rows of held
    steps are not appended again either.

    Raises:
        mlflow.exceptions.MlflowException: the run cannot be read (unknown id, store down).
    """
    held = resume.logged_steps(tracker, run_id)
    mlflow_sink = tracker.sink(run_id)
    # the fill-mask rows go with the evaluation points: those of a step whose point the
    # run lacks (a kill during that evaluation) are appended when it runs again
    held_eval = max((s for k, s in held.items() if k.startswith("eval/")), default=0)
    return (AfterStepSink(mlflow_sink, held) if held else mlflow_sink,
            periodic_evaluator(cfg, shards, tokenizer, tracker, run_id, held_eval))


@contextlib.contextmanager
def stop_on_signals(stop: StopSignal) -> Iterator[StopSignal]:
    """While training runs in the main thread, SIGINT and SIGTERM set `stop` (the loop
    checkpoints the step it reached and raises `TrainingInterrupted`) instead of aborting
    it mid-step; a second signal goes to the handler that was there before (Prefect's, or
    Python's KeyboardInterrupt). Elsewhere (a worker thread) nothing is installed."""
    previous: dict[int, Any] = {}

    def handler(signum, frame) -> None:
        if signum in previous and not stop.requested:
            logger.warning("%s: checkpointing the step reached, then stopping (send it "
                           "again to stop at once)", signal.Signals(signum).name)
            stop.request()
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
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def launch_extra(cfg: PipelineConfig, run_id: str, tracker: MlflowTracker) -> dict[str, Any]:
    """The `extra` of a tracked launch (`run_torchrun(..., extra=...)`): the run id, the
    pipeline config as JSON, the tracker's resolved URI (a default URI made from the
    launcher's working directory reaches every rank unchanged) and, at a fresh start, the
    MLflow parent fetched once here, before any rank starts (`app.parents`).

    Raises:
        ValueError: `eval.every_steps` is set under FSDP2 (`stage.refuse_fsdp2_evaluation`),
            refused here before any process starts; the errors of fetching the parent.
    """
    if cfg.eval.every_steps is not None:
        from mlm_pipeline.train.stage import refuse_fsdp2_evaluation

        refuse_fsdp2_evaluation(cfg.train.distributed.world_size > 1,
                                cfg.train.distributed.strategy)
    parent = init_checkpoint(cfg, train_dir(cfg, run_id))
    return {"run_id": run_id, "pipeline": cfg.model_dump(mode="json"),
            "tracking_uri": tracker.tracking_uri,
            **({"init_checkpoint": str(parent)} if parent is not None else {})}


def train_tracked(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                  run_id: str, progress: Callable[[], MetricsSink] | None = None,
                  log_line: Callable[[str], None] | None = None,
                  stop: StopSignal | None = None) -> TrainManifest:
    """Train MLflow run `run_id` (see the module docstring) and tag its parent.

    Args:
        cfg: the run's config.
        shards, tokenizer: its data.
        run_id: the MLflow run it logs to (open).
        progress: makes a sink that also receives the metrics (e.g. a progress bar),
            made only when the run trains.
        log_line: receives every output line of a torchrun launch (default: this
            module's logger).
        stop: the run's stop request; None makes one that SIGINT and SIGTERM set.

    Raises:
        TrainingInterrupted: the stop was requested (the step reached is checkpointed).
        The errors of `train.train`, `train.launch.run_torchrun` and `app.parents`.
    """
    out = train_dir(cfg, run_id)
    done = finished_training(out, cfg.train.max_steps, shards.digest)
    if done is not None:  # a run that failed after training: nothing to train again
        logger.info("MLflow run %s trained all %d steps already (%s): not trained again",
                    run_id, done.steps, done.checkpoint_dir)
        return done
    tracker = MlflowTracker.from_config(cfg.tracking)
    bar = progress() if progress is not None else None
    if cfg.train.distributed.world_size > 1:
        trained = _train_torchrun(cfg, shards, tokenizer, run_id, tracker, bar,
                                  log_line or logger.info)
    else:
        from mlm_pipeline.train import StopSignal, train

        mlflow_sink, evaluator = live_tracking(cfg, shards, tokenizer, tracker, run_id)
        sink = MultiSink(*(s for s in (StdoutSink(), mlflow_sink, bar) if s is not None))
        with tracker.system_metrics(run_id):
            try:
                with stop_on_signals(stop or StopSignal()) as signalled:
                    trained = train(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                                    out, sink, evaluator,
                                    init_checkpoint=init_checkpoint(cfg, out),
                                    stop=signalled)
            finally:
                sink.close()
    # The parent (`train.init_from`, a param already): its digest and step as tags.
    tracker.set_tags(run_id, parent_tags(trained.init))
    return trained


def _train_torchrun(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                    run_id: str, tracker: MlflowTracker, progress: MetricsSink | None,
                    log_line: Callable[[str], None]) -> TrainManifest:
    """`train_tracked` under torchrun: rank 0 of the launch feeds MLflow (sinks, periodic
    evaluator, system metrics); here every output line goes to `log_line`, and rank 0's
    metric lines move `progress`."""
    from mlm_pipeline.train.launch import run_torchrun, sink_line_step

    extra = launch_extra(cfg, run_id, tracker)  # refuses FSDP2 + every_steps

    def on_line(line: str) -> None:
        """Log a launch's output line; a rank-0 metric line moves `progress`."""
        log_line(line)
        step = sink_line_step(line)
        if step is not None and progress is not None:
            progress.log({}, step)

    return run_torchrun(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                        train_dir(cfg, run_id), on_line=on_line, entry=TORCHRUN_ENTRY,
                        extra=extra)
