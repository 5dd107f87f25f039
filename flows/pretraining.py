"""The `mlm-pretraining` flow: ingest -> tokenizer -> shards -> train -> evaluate.

Each stage is a Prefect task around one library function; tasks exchange manifests. The
MLflow run is opened first, so that a failure in any stage leaves a FAILED run with the
config, and closed last. Run it locally with `mlm-pipeline run CONFIG` (no server needed:
Prefect starts a temporary local API) or through a deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel, Field

from mlm_pipeline import pipeline
from mlm_pipeline.config import PipelineConfig, load_config
from mlm_pipeline.manifest import (
    CorpusManifest,
    EvalManifest,
    ShardManifest,
    TokenizerManifest,
    TrainManifest,
)
from mlm_pipeline.tracking import MlflowTracker, MultiSink, StdoutSink

# Stage functions skip their work when their content-addressed manifest exists, so Prefect's
# own result cache is not needed here.
_TASK = {"cache_policy": NO_CACHE, "persist_result": False}


class PretrainParams(BaseModel):
    """Parameters of a pretraining run (the Prefect UI shows them as a form)."""

    config: str = "tiny"
    """Config name (`tiny` -> configs/tiny.yaml) or path to a YAML file."""
    overrides: list[str] = Field(default_factory=list)
    """Dotted overrides applied after the file, e.g. `train.max_steps=50`."""


@task(name="start-tracking", **_TASK)
def start_tracking(cfg: PipelineConfig) -> str:
    """Open the MLflow run with the flattened config and code tags; returns its id."""
    extra = {}
    if flow_run.id:
        extra = {"prefect.flow_run_id": str(flow_run.id),
                 "prefect.flow_run_name": str(flow_run.name)}
        if deployment.id:
            extra["prefect.deployment_id"] = str(deployment.id)
            extra["prefect.deployment_name"] = str(deployment.name)
    tracker = MlflowTracker.from_config(cfg.tracking)
    return tracker.start_run(pipeline.run_params(cfg), pipeline.run_tags(extra))


@task(name="ingest", retries=2, retry_delay_seconds=5, **_TASK)
def ingest_task(cfg: PipelineConfig) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus."""
    from mlm_pipeline.ingest import ingest

    return ingest(cfg.ingest, cfg.work_dir)


@task(name="tokenizer", **_TASK)
def tokenizer_task(cfg: PipelineConfig, corpus: CorpusManifest) -> TokenizerManifest:
    """Train the SentencePiece tokenizer on the training split."""
    from mlm_pipeline.tokenizer import train_tokenizer

    return train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir)


@task(name="shards", **_TASK)
def shards_task(
    cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest
) -> ShardManifest:
    """Encode and pack both splits into Arrow shards."""
    from mlm_pipeline.shards import write_shards

    return write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir)


@task(name="record-data", **_TASK)
def record_data_task(
    cfg: PipelineConfig, run_id: str, corpus: CorpusManifest, tokenizer: TokenizerManifest,
    shards: ShardManifest,
) -> None:
    """Log data lineage, accounting and the tokenizer to the MLflow run."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_data(tracker, run_id, corpus, tokenizer, shards)


@task(name="train", **_TASK)
def train_task(
    cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest, run_id: str
) -> TrainManifest:
    """Pretrain; metrics stream to the console and the MLflow run."""
    from mlm_pipeline.train import train

    tracker = MlflowTracker.from_config(cfg.tracking)
    sink = MultiSink(StdoutSink(), tracker.sink(run_id))
    try:
        return train(cfg, shards, tokenizer, Path(cfg.work_dir) / "train" / run_id, sink)
    finally:
        sink.close()


@task(name="evaluate", **_TASK)
def evaluate_task(
    cfg: PipelineConfig, trained: TrainManifest, shards: ShardManifest,
    tokenizer: TokenizerManifest,
) -> EvalManifest:
    """Held-out masked-token metrics and fill-mask probes."""
    from mlm_pipeline.evaluate import evaluate

    return evaluate(cfg, trained, shards, tokenizer, cfg.work_dir)


@task(name="record-results", **_TASK)
def record_results_task(
    cfg: PipelineConfig, run_id: str, trained: TrainManifest, evaluated: EvalManifest
) -> None:
    """Log eval metrics, probes and the final checkpoint to the MLflow run."""
    tracker = MlflowTracker.from_config(cfg.tracking)
    pipeline.record_results(tracker, run_id, cfg, trained, evaluated)


@task(name="end-tracking", **_TASK)
def end_tracking(cfg: PipelineConfig, run_id: str, status: str) -> None:
    """Close the MLflow run with `FINISHED` or `FAILED`."""
    MlflowTracker.from_config(cfg.tracking).end_run(run_id, status)


@flow(name="mlm-pretraining")
def mlm_pretraining(params: PretrainParams | None = None) -> dict[str, Any]:
    """Pretrain a masked language model end to end and return the run summary."""
    params = params or PretrainParams()
    cfg = load_config(params.config, params.overrides)
    run_id = start_tracking(cfg)
    try:
        corpus = ingest_task(cfg)
        tokenizer = tokenizer_task(cfg, corpus)
        shards = shards_task(cfg, corpus, tokenizer)
        record_data_task(cfg, run_id, corpus, tokenizer, shards)
        trained = train_task(cfg, shards, tokenizer, run_id)
        evaluated = evaluate_task(cfg, trained, shards, tokenizer)
        record_results_task(cfg, run_id, trained, evaluated)
    except BaseException:
        end_tracking(cfg, run_id, "FAILED")
        raise
    end_tracking(cfg, run_id, "FINISHED")
    tracker = MlflowTracker.from_config(cfg.tracking)
    return pipeline.summary(tracker, run_id, corpus, tokenizer, shards, trained, evaluated)
