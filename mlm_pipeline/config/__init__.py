"""Typed, frozen configuration for every stage of the pipeline.

One pydantic model per stage; `PipelineConfig` groups them. Every model is frozen and
rejects unknown keys, so a typo in a YAML file or an override is an error, not a silently
ignored setting. Cross-field checks collect every problem and raise one `ValueError`.
Finding, loading and printing config files (YAML, dotted overrides, the shipped configs)
is `mlm_pipeline.config_files`.

This package imports neither torch nor prefect (STYLE rule 3): flows and CPU workers load
configs cheaply.

Rooms: `base` (the base model and the fixed special-token ids), `stages` (ingest,
tokenizer, shards, masking, model, train), `hf_parent` (a Hugging Face masked LM as
`train.init_from`: its `config.json` as the `model` section), `evaluation` (probes, held-out evaluation,
linear probe, fine-tuning), `lr_auto` (`train.lr: auto`), `masking_schedule` (masking-rate
schedules), `reference` (the configuration reference page).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mlm_pipeline.config.base import (
    CLS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL, PAD_ID, SENTENCEPIECE_SPECIAL_IDS, SEP_ID,
    SPECIAL_TOKENS, UNK_ID, SpecialIds, StrictModel)
from mlm_pipeline.config.evaluation import (
    DOMAIN_PROBES, GUIDE_PROBES, ClassificationTask, EncoderInput, EvalConfig, FillMaskProbe,
    FinetuneConfig, LinearProbeConfig)
from mlm_pipeline.config.lr_auto import resolve_lr
from mlm_pipeline.config.masking_schedule import LinearRate, StepwiseRate, schedule_problems
from mlm_pipeline.config.stages import (
    DEFAULT_WARMUP_STEPS, MODEL_PRESETS, DataPrepConfig, DistributedConfig, IngestConfig,
    MaskingConfig, ModelConfig, ShardConfig, TokenizerConfig, TrainConfig)

__all__ = [
    "CLS_ID", "DEFAULT_WARMUP_STEPS", "DOMAIN_PROBES", "GUIDE_PROBES", "IGNORE_INDEX",
    "MASK_ID", "MODEL_PRESETS", "NUM_SPECIAL", "PAD_ID", "SENTENCEPIECE_SPECIAL_IDS", "SEP_ID",
    "SPECIAL_TOKENS", "UNK_ID", "ClassificationTask", "DataPrepConfig", "EncoderInput",
    "DistributedConfig", "EvalConfig", "FillMaskProbe", "FinetuneConfig", "IngestConfig",
    "LinearProbeConfig", "LinearRate", "MaskingConfig", "ModelConfig", "PipelineConfig",
    "ShardConfig", "SpecialIds", "StepwiseRate", "StrictModel", "TokenizerConfig",
    "TrackingConfig", "TrainConfig", "resolve_lr", "schedule_problems",
]


class TrackingConfig(StrictModel):
    """MLflow tracking."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None uses `$MLFLOW_TRACKING_URI`, else `sqlite:///<cwd>/mlflow.db`."""
    experiment_name: str = "mlm-pipeline"
    """MLflow experiment."""
    run_name: str | None = None
    """Name of the MLflow run and of the Prefect flow run (one name for both); None:
    `<config name>-<model preset>-<max_steps>-<6 random hex>`, e.g. `tiny-modern-1000-3fa2c1`
    (`tracking.records.run_name`)."""
    log_model: bool = True
    """At the end of a successful run, log the exported `transformers` model as the run's
    MLflow model and register it (champion/challenger, see `tracking.registry`)."""
    registered_model_name: str | None = None
    """Registered model name of `log_model`; None uses `experiment_name`."""
    log_training_state: bool = False
    """Also upload the final training checkpoint (weights, optimizer, RNG: ~1.3 GB for
    BERT-base) as run artifacts; it always stays in the local work directory."""
    resume_run_id: str | None = None
    """Continue this MLflow run (e.g. after a cancelled or crashed flow run): training
    resumes from the newest checkpoint of that run; the config must be compatible."""
    resume: Literal["auto", "never"] = "auto"
    """`auto`: a rerun of the same config continues the newest unfinished run of the
    experiment that has a checkpoint (same MLflow run, same step numbering); `never`
    (`mlm-pipeline run --fresh`) always starts a new run. A FINISHED run is never resumed."""
    keep_last_runs: int | None = Field(default=None, ge=1)
    """After a run finishes, keep the local training state (`checkpoints/`) of only this many
    newest FINISHED runs of the experiment, never the registered champion's nor an
    unfinished run's (`mlm-pipeline gc --keep N` on demand); None keeps every run's."""


class PipelineConfig(StrictModel):
    """The whole pipeline: one config per stage plus where outputs go."""

    name: str = "mlm"
    """A label for the config (logged as a param)."""
    work_dir: str = ".mlm-pipeline"
    """Root of every stage's outputs (content-addressed subdirectories): a local directory,
    or an fsspec URL (`s3://bucket/prefix`) mirrored in `$MLM_PIPELINE_CACHE/work` (see "the
    work directory on an S3-compatible store")."""
    ingest: IngestConfig = IngestConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    shards: ShardConfig = ShardConfig()
    masking: MaskingConfig = MaskingConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    linear_probe: LinearProbeConfig = LinearProbeConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    """Fine-tuning evaluation on the `linear_probe` section's tasks and their splits."""
    tracking: TrackingConfig = TrackingConfig()
    data: DataPrepConfig = DataPrepConfig()
    """Where data preparation runs (one process, or a Dask cluster)."""

    @model_validator(mode="after")
    def _check_cross(self) -> PipelineConfig:
        problems = []
        if self.tokenizer.vocab_size > 2**32:
            problems.append("tokenizer.vocab_size must fit in uint32")
        if (head_dim := self.model.hidden_size // self.model.num_heads) % 2:
            problems.append(f"model: head dimension {head_dim} must be even")
        if self.tokenizer.from_init and self.tokenizer.adopt_from is not None:
            problems.append("tokenizer.from_init and tokenizer.adopt_from are exclusive: "
                            "reuse the parent run's tokenizer, or adopt a Hugging Face one")
        if self.tokenizer.from_init and self.train.init_from is None:
            problems.append("tokenizer.from_init needs train.init_from (the model whose "
                            "tokenizer is reused)")
        problems += schedule_problems(self.masking.mlm_probability, self.train.max_steps)
        if problems:
            raise ValueError("; ".join(problems))
        if self.train.lr == "auto":  # resolved once here: params and digests see numbers
            return self.model_copy(update={"train": resolve_lr(self.train, self.model)})
        return self
