"""The `mlm-pretraining` flow: ingest -> tokenizer -> shards -> train -> evaluate.

Each stage is a Prefect task around one library function; tasks exchange manifests. The
MLflow run is opened first, so that a failure in any stage leaves a FAILED run with the
config, and closed last. Run it locally with `mlm-pipeline run CONFIG` (no server needed:
Prefect starts a temporary local API) or through a deployment (`prefect.yaml`).

This module imports no other module of `flows/` but `result_store` (how its results are
stored: JSON, never pickle): Prefect loads it as a script
(`flows/pretraining.py:mlm_pretraining`) from the checkout, and the wheel installs it as
`mlm_pipeline_flows.pretraining`; a `flows.` import would only work in the first case.

Caching: the data stages are cached across flow runs under the digest of their output,
computed by the library from the content of their inputs and their config (never from
paths or modification times), so a rerun of the same config shows them as Cached, and a
change reruns exactly the stages downstream of it. The cache is per work directory
(`work_dir`, resolved): another checkout or work directory builds its own outputs. A cached
manifest whose files were deleted is recomputed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run
from prefect.utilities.urls import url_for
from pydantic import BaseModel, Field, field_validator

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import load_config, shipped_configs
from mlm_pipeline.manifest import (
    CorpusManifest,
    EvalManifest,
    ShardManifest,
    TokenizerManifest,
    TrainManifest,
)
from mlm_pipeline.progress import LogProgress, MultiProgress, Progress
from mlm_pipeline.sinks import AfterStepSink, MultiSink, StdoutSink
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline

try:  # a package: flows.pretraining (checkout) or mlm_pipeline_flows.pretraining (wheel)
    from .progress_display import current as current_progress
    from .result_store import MANIFEST_RESULTS
except ImportError:  # loaded as a script by Prefect, with this folder on sys.path meanwhile
    from progress_display import current as current_progress
    from result_store import MANIFEST_RESULTS

_NOT_CACHED = {"cache_policy": NO_CACHE, "persist_result": False}


class PrefectProgressSink:
    """`MetricsSink` that updates one progress artifact (percent of `max_steps`) per record.

    Args:
        max_steps: optimizer steps of the run (100 %).
        key: artifact key (lowercase letters, digits and dashes).
    """

    def __init__(self, max_steps: int, key: str = "training-progress") -> None:
        self.max_steps = max_steps
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=key, description=f"training progress (% of {max_steps} steps)"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Set the progress to `step / max_steps` (in %)."""
        update_progress_artifact(self.artifact_id, progress=100.0 * step / self.max_steps)

    def flush(self) -> None:
        """Nothing buffered."""

    def close(self) -> None:
        """Nothing to release."""


class PrefectProgressArtifacts:
    """`mlm_pipeline.progress.Progress` that keeps one progress artifact per stage with a
    known total (key `<stage>-progress`, e.g. `ingest-progress`, `shards-train-progress`:
    percent done), updated at most once per `interval_s` seconds, and at 100 % at the end.

    Args:
        interval_s: least seconds between two updates of one artifact.
    """

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._stages: dict[str, list] = {}  # stage -> [artifact id, total, last update]

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Create the stage's artifact at 0 % (none when `total` is unknown or 0)."""
        if not total:
            return
        key = "-".join("".join(c if c.isalnum() else " " for c in stage.lower()).split())
        artifact = create_progress_artifact(
            progress=0.0, key=f"{key}-progress",
            description=f"{stage}: % of {total:,.0f} {unit}" + (
                f" ({description})" if description else ""))
        self._stages[stage] = [artifact, total, time.monotonic()]

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Set the percent done, when `interval_s` has passed since the last update."""
        if (s := self._stages.get(stage)) and time.monotonic() - s[2] >= self.interval_s:
            s[2] = time.monotonic()
            update_progress_artifact(s[0], progress=min(100.0, 100.0 * completed / s[1]))

    def finish(self, stage: str, **fields: float | str) -> None:
        """Set 100 %."""
        if (s := self._stages.pop(stage, None)) is not None:
            update_progress_artifact(s[0], progress=100.0)


def _progress() -> Progress:
    """The data tasks' reporter: Prefect progress artifacts, plus the display `mlm-pipeline
    run` set (`progress_display.current()`) or, when none is (a deployment, a test), log
    lines at a bounded rate."""
    return MultiProgress(PrefectProgressArtifacts(), current_progress() or LogProgress())


def _transient(task, task_run, state) -> bool:
    """Retry only errors that a second try can cure (network, I/O), not bad input."""
    try:
        state.result()
    except (FileNotFoundError, PermissionError, IsADirectoryError, ValueError):
        return False
    except (OSError, ConnectionError, TimeoutError, RuntimeError):
        return True
    except Exception:  # noqa: BLE001 - anything else is a bug or bad input: fail fast
        return False
    return False


_IO = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": _transient}


#: The shipped configs (`configs/*.yaml`): the choices of `PretrainParams.config`.
ShippedConfig = Literal[tuple(sorted(shipped_configs()))]  # type: ignore[valid-type]


class PretrainParams(BaseModel):
    """Parameters of a pretraining run. The Prefect UI shows them as a form with these
    descriptions, and the server rejects an out-of-range value before a worker starts."""

    config: ShippedConfig = Field(
        "tiny", description="Shipped config to start from (configs/NAME.yaml).")
    config_file: str | None = Field(
        None, description="Path of a YAML config on the worker; replaces `config` when set.")
    max_steps: int | None = Field(
        None, ge=1, le=100_000_000, description="Optimizer steps (train.max_steps).")
    lr: float | None = Field(
        None, gt=0.0, le=1.0, description="Peak learning rate (train.lr).")
    preset: Literal["bert", "modern"] | None = Field(
        None, description="Model architecture (model.preset).")
    vocab_size: int | None = Field(
        None, ge=128, le=1_000_000, description="Tokenizer vocabulary (tokenizer.vocab_size).")
    seq_len: int | None = Field(
        None, ge=16, le=8192, description="Tokens per training row (shards.seq_len).")
    overrides: list[str] = Field(
        default_factory=list,
        description="Dotted overrides applied last, e.g. `train.warmup_ratio=0.1`.")
    event_sources: list[str] | None = Field(
        None, max_length=1000, description="Corpus sources named by an event (the "
        "corpus.updated trigger): they replace ingest.sources, and each must match the "
        "config's ingest.allowed_sources, or the run stops before reading anything.")

    @field_validator("config_file", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        """An event template renders a missing `config_file` as an empty string."""
        return None if value == "" else value

    @field_validator("event_sources", mode="before")
    @classmethod
    def _no_empty_sources(cls, value: Any) -> Any:
        """An event without a corpus renders `["{{ event.payload.corpus }}"]` as `[""]`."""
        if isinstance(value, list) and all(v == "" for v in value):
            return None
        return value

    def resolved(self) -> tuple[str, list[str]]:
        """(config name or path, overrides): the typed fields become overrides, applied
        before the free-form ones."""
        typed = {"train.max_steps": self.max_steps, "train.lr": self.lr,
                 "model.preset": self.preset, "tokenizer.vocab_size": self.vocab_size,
                 "shards.seq_len": self.seq_len}
        extra = [f"{k}={v}" for k, v in typed.items() if v is not None]
        return self.config_file or self.config, extra + list(self.overrides)


def _in_work_dir(cfg: PipelineConfig, key: str) -> str:
    """`key` qualified by the absolute work directory: Prefect's result cache is shared by
    every flow run of a user (`PREFECT_HOME`), and a hit from another checkout would return
    a manifest whose files live in that checkout's work directory, not in this one."""
    work_dir = str(Path(cfg.work_dir).expanduser().resolve())
    return f"{key}-{hashlib.sha256(work_dir.encode()).hexdigest()[:16]}"


def _ingest_key(context, parameters) -> str:
    from mlm_pipeline.ingest import ingest_digest

    cfg = parameters["cfg"]
    return _in_work_dir(cfg, "ingest-" + ingest_digest(cfg.ingest, cfg.work_dir))


def _tokenizer_key(context, parameters) -> str:
    from mlm_pipeline.tokenizer import tokenizer_digest

    cfg = parameters["cfg"]
    return _in_work_dir(cfg, "tokenizer-" + tokenizer_digest(cfg.tokenizer, parameters["corpus"]))


def _shards_key(context, parameters) -> str:
    from mlm_pipeline.shards import shards_digest

    p = parameters
    cfg = p["cfg"]
    return _in_work_dir(cfg, "shards-" + shards_digest(
        cfg.shards, p["corpus"], p["tokenizer"], cfg.masking
    ))


def _train_dir(cfg: PipelineConfig, run_id: str) -> Path:
    """Where the training stage of MLflow run `run_id` writes (checkpoints, metrics)."""
    return Path(cfg.work_dir).expanduser() / "train" / run_id


def _newest_checkpoint(cfg: PipelineConfig):
    from mlm_pipeline.train.checkpoint import latest_intact_checkpoint

    return lambda run_id: latest_intact_checkpoint(_train_dir(cfg, run_id) / "checkpoints")


def _keep_name(tracker: MlflowTracker, run_id: str) -> str:
    """A continued MLflow run keeps its name, and the flow run continuing it takes that
    name (one name for both); returns `run_id`."""
    if flow_run.id:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_flow_run_name(flow_run.id, tracker.get_run(run_id).info.run_name)
    return run_id


@task(name="start-tracking", **_NOT_CACHED, **_IO)
def start_tracking(cfg: PipelineConfig, fresh: bool = False) -> str:
    """Open the MLflow run, or continue this job's unfinished one (`tracking.resume`,
    `tracking.resume_run_id`; see `mlm_pipeline.tracking.resume`); returns its id."""
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
    params = pipeline.run_params(cfg)
    tags = {**pipeline.run_tags(extra, ENTRYPOINT, "JOB" if deployment.id else "LOCAL"),
            **resume.process_tags(), resume.JOB_KEY_TAG: resume.job_key(cfg)}
    newest = _newest_checkpoint(cfg)
    if cfg.tracking.resume_run_id:
        run_id = cfg.tracking.resume_run_id
        _, incompatible = resume.config_changes(tracker.get_run(run_id).data.params, params)
        if incompatible:
            raise ValueError(f"cannot continue MLflow run {run_id}: these settings differ: "
                             + ", ".join(f"{k} {a!r} -> {b!r}"
                                         for k, (a, b) in incompatible.items()))
        checkpoint = newest(run_id)
        step = 0 if checkpoint is None else int(checkpoint.name.split("-")[-1])
        resume.continue_run(tracker, run_id, params, tags, step)
        return _keep_name(tracker, run_id)
    if cfg.tracking.resume == "auto" and not fresh:
        found = resume.find_resumable(tracker, cfg, params, newest)
        if found is not None:
            step = int(found.checkpoint.name.split("-")[-1])
            resume.continue_run(tracker, found.run_id, params, tags, step, found.compatible)
            return _keep_name(tracker, found.run_id)
    # One name for both runs: the flow run's (`_flow_run_name`), unless the config sets one.
    name = cfg.tracking.run_name or (str(flow_run.name) if flow_run.id else None)
    return tracker.start_run(params, tags, run_name=name or pipeline.run_name(cfg))


@task(name="ingest", cache_key_fn=_ingest_key, **MANIFEST_RESULTS, **_IO)
def ingest_task(cfg: PipelineConfig) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus."""
    from mlm_pipeline.ingest import ingest

    return ingest(cfg.ingest, cfg.work_dir, _progress())


@task(name="tokenizer", cache_key_fn=_tokenizer_key, **MANIFEST_RESULTS)
def tokenizer_task(cfg: PipelineConfig, corpus: CorpusManifest) -> TokenizerManifest:
    """Train the SentencePiece tokenizer on the training split."""
    from mlm_pipeline.tokenizer import train_tokenizer

    return train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir, _progress())


@task(name="shards", cache_key_fn=_shards_key, **MANIFEST_RESULTS)
def shards_task(
    cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest
) -> ShardManifest:
    """Encode and pack both splits into Arrow shards (plus the masked copies of the
    training split with precomputed masking, keyed by `masking.seed`)."""
    from mlm_pipeline.shards import write_shards

    return write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir, cfg.masking, _progress())


@task(name="record-data", **_NOT_CACHED, **_IO)
def record_data_task(
    cfg: PipelineConfig, run_id: str, corpus: CorpusManifest, tokenizer: TokenizerManifest,
    shards: ShardManifest,
) -> str:
    """Log data lineage, accounting and the tokenizer to MLflow (once per run: a continued
    run already has them) and the accounting table to Prefect. A continued run whose data
    changed since (a corpus update) is closed KILLED and a new run takes over; returns the
    id of the run that goes on."""
    create_table_artifact(
        key="ingestion-accounting", table=pipeline.accounting_rows(corpus),
        description="documents read, kept, dropped and repaired, by reason",
    )
    tracker = MlflowTracker.from_config(cfg.tracking)
    recorded = tracker.get_run(run_id).data.tags.get("digest.shards")
    if recorded == shards.digest:
        return run_id
    if recorded is not None:
        tracker.set_tags(run_id, {"mlflow.note.content": (
            f"Not continued: the training data changed (shards {recorded[:12]} -> "
            f"{shards.digest[:12]}); a new run trains on the new data.")})
        tracker.end_run(run_id, "KILLED")
        run_id = start_tracking.fn(cfg, fresh=True)
    pipeline.record_data(tracker, run_id, corpus, tokenizer, shards)
    return run_id


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


def _curable(task, task_run, state) -> bool:
    """Retry training only for what a second try can cure (I/O, a lost connection, a
    runtime error such as out-of-memory): never a non-finite loss, an interruption, a
    damaged checkpoint, a config error or bad input."""
    try:
        state.result()
    except (ValueError, TypeError, KeyError, FileNotFoundError, PermissionError):
        return False
    except Exception as exc:  # noqa: BLE001 - classified by name: flows import no torch code
        if type(exc).__name__ in ("NonFiniteLossError", "TrainingInterrupted"):
            return False
        return isinstance(exc, (OSError, ConnectionError, TimeoutError, RuntimeError))
    return False


@task(name="train", retries=1, retry_condition_fn=_curable, **_NOT_CACHED)
def train_task(
    cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest, run_id: str
) -> TrainManifest:
    """Pretrain; metrics stream to the console, MLflow and a progress artifact. A continued
    run (or a retry) resumes from the newest intact checkpoint of the run, and MLflow gets
    only the steps it does not hold yet (one value per step and key). With
    `train.distributed` asking for several processes, torchrun runs the training
    (`train.launch.run_torchrun`): its output streams into this task's log, its failure
    names the failing rank, and the metrics reach MLflow from `metrics.jsonl` at the end."""
    from mlm_pipeline.tracking.periodic import periodic_evaluator
    from mlm_pipeline.train import train

    tracker = MlflowTracker.from_config(cfg.tracking)
    held = resume.last_logged_step(tracker, run_id)
    mlflow_sink = tracker.sink(run_id)
    if cfg.train.distributed.world_size > 1:
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        from mlm_pipeline.train.launch import replay_metrics, run_torchrun

        try:
            log = get_run_logger()
        except MissingContextError:  # called as `train_task.fn()` outside a run
            log = logging.getLogger(__name__)
        if cfg.eval.every_steps is not None:
            log.warning("eval.every_steps: periodic evaluation does not run inside a "
                        "torchrun launch; the evaluate stage runs after training")
        sink = MultiSink(AfterStepSink(mlflow_sink, held) if held else mlflow_sink,
                         PrefectProgressSink(cfg.train.max_steps))
        with tracker.system_metrics(run_id):
            try:
                trained = run_torchrun(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                                       _train_dir(cfg, run_id), on_line=log.info)
                replay_metrics(trained.file(trained.metrics_log), sink)
                return trained
            finally:
                sink.close()
    evaluator = periodic_evaluator(cfg, shards, tokenizer, tracker, run_id, held or 0)
    sink = MultiSink(StdoutSink(), AfterStepSink(mlflow_sink, held) if held else mlflow_sink,
                     PrefectProgressSink(cfg.train.max_steps))
    with tracker.system_metrics(run_id):
        try:
            with stop_gracefully():
                return train(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                             _train_dir(cfg, run_id), sink, evaluator)
        finally:
            sink.close()


@task(name="evaluate", **_NOT_CACHED)
def evaluate_task(
    cfg: PipelineConfig, trained: TrainManifest, shards: ShardManifest,
    tokenizer: TokenizerManifest,
) -> EvalManifest:
    """Held-out masked-token metrics, fill-mask probes and the downstream linear probe."""
    from mlm_pipeline.evaluate import evaluate

    return evaluate(cfg.eval, trained, shards, tokenizer, cfg.work_dir, cfg.linear_probe,
                    _progress())


@task(name="record-results", **_NOT_CACHED, **_IO)
def record_results_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest
) -> None:
    """Log eval metrics, probes and the final checkpoint to the MLflow run."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_results(tracker, run_id, cfg, trained, evaluated)


@task(name="publish-model", **_NOT_CACHED, **_IO)
def publish_model_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest,
    tokenizer: TokenizerManifest,
) -> dict[str, Any] | None:
    """Log the exported model as the run's MLflow model and register it: `challenger`
    always, `champion` when better on the same data (None when `tracking.log_model` is off)."""
    if not cfg.tracking.log_model:
        return None
    from mlm_pipeline.tracking import registry

    name = cfg.tracking.registered_model_name or cfg.tracking.experiment_name
    return registry.publish(MlflowTracker.from_config(cfg.tracking), run_id, name, trained,
                            evaluated, tokenizer.output_dir,
                            next((p.text for p in cfg.eval.probes), "[MASK]."))


@task(name="end-tracking", **_NOT_CACHED, **_IO)
def end_tracking(cfg: PipelineConfig, run_id: str, status: str,
                 tags: dict[str, str] | None = None) -> None:
    """Close the MLflow run with `FINISHED`, `FAILED` or `KILLED`, after setting `tags`
    (why it failed: `resume.failure_tags`)."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    if tags:
        tracker.set_tags(run_id, tags)
    tracker.end_run(run_id, status)


def _close_mlflow_run(status: str, what: str):
    """A flow-run state hook that closes the flow run's MLflow run with `status` when its
    process could not (cancellation, crash); found by the `prefect.flow_run_id` tag."""

    def hook(flow, flow_run, state) -> None:
        try:
            params = PretrainParams.model_validate(flow_run.parameters.get("params") or {})
            cfg = load_config(*params.resolved())
            closed = resume.close_runs_of_flow_run(
                MlflowTracker.from_config(cfg.tracking), str(flow_run.id), status,
                f"Prefect flow run {flow_run.name} was {what}; run the same deployment "
                "again to continue from the newest checkpoint.")
            if closed:
                logging.getLogger(__name__).info("MLflow run(s) %s closed %s", closed, status)
        except Exception as exc:  # noqa: BLE001 - a hook must not mask the flow's state
            logging.getLogger(__name__).warning("could not close the MLflow run: %s", exc)

    return hook


def _fresh(stage_task, *args):
    """Run a cached stage; recompute it if the cached manifest's files were deleted."""
    manifest = stage_task(*args)
    if not pipeline.outputs_exist(manifest):
        manifest = stage_task.with_options(refresh_cache=True)(*args)
    return manifest


#: The flow's entry point (`prefect.yaml`), recorded as the MLflow run's `mlflow.source.name`.
ENTRYPOINT = "flows/pretraining.py:mlm_pretraining"


def _flow_run_name() -> str:
    """The flow run's name, shared with its MLflow run: `tracking.run_name` when the config
    sets it, else `records.run_name` (config name, model preset, steps and a short random
    suffix), e.g. `tiny-modern-1000-3fa2c1`; `mlm-pretraining-<suffix>` when the
    parameters do not load (the flow run then fails on them, with the error)."""
    try:
        params = PretrainParams.model_validate(flow_run.parameters.get("params") or {})
        cfg = load_config(*params.resolved())
    except Exception:  # noqa: BLE001 - the flow itself reports bad parameters
        return pipeline.run_name(None)
    return cfg.tracking.run_name or pipeline.run_name(cfg)


@flow(name="mlm-pretraining", flow_run_name=_flow_run_name,
      on_cancellation=[_close_mlflow_run("KILLED", "cancelled")],
      on_crashed=[_close_mlflow_run("FAILED", "crashed")])
def mlm_pretraining(params: PretrainParams = PretrainParams()) -> dict[str, Any]:  # noqa: B008
    """Pretrain a masked language model end to end and return the run summary."""
    # The library logs at INFO through Prefect's handlers (PREFECT_LOGGING_EXTRA_LOGGERS);
    # without this its level is the root logger's WARNING outside the CLI.
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    started_at = time.time()  # stages made before this are cache hits (summary)
    cfg = load_config(*params.resolved())
    if params.event_sources is not None:  # checked against ingest.allowed_sources first
        from mlm_pipeline.ingest.allowed import with_event_sources

        cfg = with_event_sources(cfg, params.event_sources)
    run_id = start_tracking(cfg)
    try:
        corpus = _fresh(ingest_task, cfg)
        tokenizer = _fresh(tokenizer_task, cfg, corpus)
        shards = _fresh(shards_task, cfg, corpus, tokenizer)
        run_id = record_data_task(cfg, run_id, corpus, tokenizer, shards)
        from mlm_pipeline.evaluate import check_evaluable  # torch: not at import time

        check_evaluable(shards)
        trained = train_task(cfg, shards, tokenizer, run_id)
        evaluated = evaluate_task(cfg, trained, shards, tokenizer)
        record_results_task(cfg, run_id, trained, evaluated)
        registered = publish_model_task(cfg, run_id, trained, evaluated, tokenizer)
    except BaseException as exc:
        end_tracking(cfg, run_id, *resume.failure_tags(exc))
        raise
    end_tracking(cfg, run_id, "FINISHED")
    tracker = MlflowTracker.from_config(cfg.tracking)
    if cfg.tracking.keep_last_runs is not None:
        from mlm_pipeline.tracking.gc import keep_last_runs

        keep_last_runs(tracker, cfg)
    summary = pipeline.summary(tracker, run_id, corpus, tokenizer, shards, trained, evaluated,
                               started_at, registered)
    markdown = pipeline.summary_markdown(summary)
    tracker.set_tags(run_id, {"mlflow.note.content": markdown})  # the run's description
    create_markdown_artifact(key="run-summary", markdown=markdown,
                             description="final metrics and the MLflow run")
    return summary
