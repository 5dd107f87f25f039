"""The `mlm-pretraining` flow: ingest -> tokenizer -> shards -> train -> evaluate.

Each stage is a Prefect task around one library function; tasks exchange manifests. The
MLflow run is opened first, so that a failure in any stage leaves a FAILED run with the
config, and closed last. Run it locally with `mlm-pipeline run CONFIG` (no server needed:
Prefect starts a temporary local API) or through a deployment (`prefect.yaml`).

This module imports no other module of `flows/`: Prefect loads it as a script
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

import hashlib
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel, Field

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import load_config
from mlm_pipeline.manifest import (
    CorpusManifest,
    EvalManifest,
    ShardManifest,
    TokenizerManifest,
    TrainManifest,
)
from mlm_pipeline.sinks import MultiSink, StdoutSink
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking import records as pipeline

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


class PretrainParams(BaseModel):
    """Parameters of a pretraining run (the Prefect UI shows them as a form)."""

    config: str = "tiny"
    """Config name (`tiny` -> configs/tiny.yaml) or path to a YAML file."""
    overrides: list[str] = Field(default_factory=list)
    """Dotted overrides applied after the file, e.g. `train.max_steps=50`."""


def _in_work_dir(cfg: PipelineConfig, key: str) -> str:
    """`key` qualified by the absolute work directory: Prefect's result cache is shared by
    every flow run of a user (`PREFECT_HOME`), and a hit from another checkout would return
    a manifest whose files live in that checkout's work directory, not in this one."""
    work_dir = str(Path(cfg.work_dir).expanduser().resolve())
    return f"{key}-{hashlib.sha256(work_dir.encode()).hexdigest()[:16]}"


def _ingest_key(context, parameters) -> str:
    from mlm_pipeline.ingest import ingest_digest

    cfg = parameters["cfg"]
    return _in_work_dir(cfg, "ingest-" + ingest_digest(cfg.ingest))


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


@task(name="start-tracking", **_NOT_CACHED, **_IO)
def start_tracking(cfg: PipelineConfig) -> str:
    """Open the MLflow run with the flattened config and Prefect tags; returns its id."""
    extra = {}
    if flow_run.id:
        extra = {"prefect.flow_run_id": str(flow_run.id),
                 "prefect.flow_run_name": str(flow_run.name)}
        if deployment.id:
            extra["prefect.deployment_id"] = str(deployment.id)
            extra["prefect.deployment_name"] = str(deployment.name)
    tracker = MlflowTracker.from_config(cfg.tracking)
    params = pipeline.run_params(cfg)
    if cfg.tracking.resume_run_id:
        # the resume key itself is the only param allowed to differ from the first attempt
        params.pop("tracking.resume_run_id")
        return tracker.resume_run(cfg.tracking.resume_run_id, params, pipeline.run_tags(extra))
    return tracker.start_run(params, pipeline.run_tags(extra))


@task(name="ingest", cache_key_fn=_ingest_key, persist_result=True, **_IO)
def ingest_task(cfg: PipelineConfig) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus."""
    from mlm_pipeline.ingest import ingest

    return ingest(cfg.ingest, cfg.work_dir)


@task(name="tokenizer", cache_key_fn=_tokenizer_key, persist_result=True)
def tokenizer_task(cfg: PipelineConfig, corpus: CorpusManifest) -> TokenizerManifest:
    """Train the SentencePiece tokenizer on the training split."""
    from mlm_pipeline.tokenizer import train_tokenizer

    return train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir)


@task(name="shards", cache_key_fn=_shards_key, persist_result=True)
def shards_task(
    cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest
) -> ShardManifest:
    """Encode and pack both splits into Arrow shards (plus the masked copies of the
    training split with precomputed masking, keyed by `masking.seed`)."""
    from mlm_pipeline.shards import write_shards

    return write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir, cfg.masking)


@task(name="record-data", **_NOT_CACHED, **_IO)
def record_data_task(
    cfg: PipelineConfig, run_id: str, corpus: CorpusManifest, tokenizer: TokenizerManifest,
    shards: ShardManifest,
) -> None:
    """Log data lineage, accounting and the tokenizer to MLflow; the accounting table to
    Prefect."""
    create_table_artifact(
        key="ingestion-accounting", table=pipeline.accounting_rows(corpus),
        description="documents read, kept, dropped and repaired, by reason",
    )
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_data(tracker, run_id, corpus, tokenizer, shards)


@task(name="train", retries=1, **_NOT_CACHED)
def train_task(
    cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest, run_id: str
) -> TrainManifest:
    """Pretrain; metrics stream to the console, MLflow and a progress artifact. A retry
    resumes from the newest checkpoint of the run."""
    from mlm_pipeline.train import train

    tracker = MlflowTracker.from_config(cfg.tracking)
    sink = MultiSink(StdoutSink(), tracker.sink(run_id), PrefectProgressSink(cfg.train.max_steps))
    try:
        return train(cfg.train, cfg.model, cfg.masking, shards, tokenizer,
                     Path(cfg.work_dir) / "train" / run_id, sink)
    finally:
        sink.close()


@task(name="evaluate", **_NOT_CACHED)
def evaluate_task(
    cfg: PipelineConfig, trained: TrainManifest, shards: ShardManifest,
    tokenizer: TokenizerManifest,
) -> EvalManifest:
    """Held-out masked-token metrics and fill-mask probes."""
    from mlm_pipeline.evaluate import evaluate

    return evaluate(cfg.eval, trained, shards, tokenizer, cfg.work_dir)


@task(name="record-results", **_NOT_CACHED, **_IO)
def record_results_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest
) -> None:
    """Log eval metrics, probes and the final checkpoint to the MLflow run."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_results(tracker, run_id, cfg, trained, evaluated)


@task(name="end-tracking", **_NOT_CACHED, **_IO)
def end_tracking(cfg: PipelineConfig, run_id: str, status: str) -> None:
    """Close the MLflow run with `FINISHED` or `FAILED`."""
    MlflowTracker.from_config(cfg.tracking).end_run(run_id, status)


def _fresh(stage_task, *args):
    """Run a cached stage; recompute it if the cached manifest's files were deleted."""
    manifest = stage_task(*args)
    if not pipeline.outputs_exist(manifest):
        manifest = stage_task.with_options(refresh_cache=True)(*args)
    return manifest


@flow(name="mlm-pretraining")
def mlm_pretraining(params: PretrainParams | None = None) -> dict[str, Any]:
    """Pretrain a masked language model end to end and return the run summary."""
    started_at = time.time()  # stages made before this are cache hits (summary)
    params = params or PretrainParams()
    cfg = load_config(params.config, params.overrides)
    run_id = start_tracking(cfg)
    try:
        corpus = _fresh(ingest_task, cfg)
        tokenizer = _fresh(tokenizer_task, cfg, corpus)
        shards = _fresh(shards_task, cfg, corpus, tokenizer)
        record_data_task(cfg, run_id, corpus, tokenizer, shards)
        from mlm_pipeline.evaluate import check_evaluable  # torch: not at import time

        check_evaluable(shards)
        trained = train_task(cfg, shards, tokenizer, run_id)
        evaluated = evaluate_task(cfg, trained, shards, tokenizer)
        record_results_task(cfg, run_id, trained, evaluated)
    except BaseException:
        end_tracking(cfg, run_id, "FAILED")
        raise
    end_tracking(cfg, run_id, "FINISHED")
    tracker = MlflowTracker.from_config(cfg.tracking)
    summary = pipeline.summary(tracker, run_id, corpus, tokenizer, shards, trained, evaluated,
                               started_at)
    create_markdown_artifact(key="run-summary", markdown=pipeline.summary_markdown(summary),
                             description="final metrics and the MLflow run")
    return summary
