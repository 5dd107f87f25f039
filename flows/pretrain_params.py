"""Parameters of the pipeline's flows, as the Prefect UI shows them and the server checks.

- `PretrainParams`: which config, with which overrides (every flow takes it).
- `PreparedData`: what `train-evaluate` needs to find the data `prepare-data` made: the
  paths of the three stage manifests in the shared work directory, each with its digest.
- `StageDeployments`: the deployments (`flow-name/deployment-name`) the `mlm-pretraining`
  flow starts with `run_deployment`; unset, it runs both halves as subflows in its process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from prefect.runtime import flow_run
from pydantic import BaseModel, Field, field_validator

from mlm_pipeline.app.parents import retrain_overrides
from mlm_pipeline.app.prepared import check_prepared, read_prepared
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import load_config, shipped_configs
from mlm_pipeline.manifest import CorpusManifest, Manifest, ShardManifest, TokenizerManifest
from mlm_pipeline.store import remote_url
from mlm_pipeline.tracking import records as pipeline

#: `PretrainParams.retrain`: from scratch, or continue from the registered champion.
RetrainMode = Literal["scratch", "continue"]

#: The shipped configs (`configs/*.yaml`): the choices of `PretrainParams.config`.
ShippedConfig = Literal[tuple(sorted(shipped_configs()))]  # type: ignore[valid-type]

M = TypeVar("M", bound=Manifest)


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
        "ingest.allowed_sources of the deployment's config (`config_file` or `config`), "
        "or the run stops before reading anything.")
    # a plain string in the schema: the trigger renders an absent payload field as "",
    # which the server checks against the schema before any validator runs
    event_config: str | None = Field(
        None, description="Shipped config an event picked by name (the corpus.updated "
        "trigger): replaces `config`; the allow-list stays the deployment config's.")
    event_config_file: str | None = Field(
        None, description="Path of a YAML config an event named: refused unless it lies "
        "(symlinks followed) in one of `config_dirs`; replaces `config`, never the "
        "allow-list; its errors never quote it.")
    config_dirs: list[str] = Field(
        default_factory=list, max_length=100, description="Directories (absolute) an "
        "event's `event_config_file` may lie in; empty: events name no config file.")
    retrain: RetrainMode = Field(
        "scratch", description="`scratch`: a new tokenizer and a model from random weights. "
        "`continue`: start from the registered champion (`models:/<registered model "
        "name>@champion`: its weights and its tokenizer) and train `retrain_steps`; a first "
        "run, with no champion yet, trains from scratch (tag mlm.retrain). Resolved once by "
        "the mlm-pretraining flow.")
    retrain_steps: int | None = Field(
        None, ge=1, le=100_000_000, description="Optimizer steps of a continued run "
        "(`retrain: continue` with a champion); unset: the config's train.max_steps.")

    @field_validator("config_file", "event_config", "event_config_file", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        """An event template renders a missing payload field as an empty string."""
        return None if value == "" else value

    @field_validator("event_config")
    @classmethod
    def _shipped_only(cls, value: str | None) -> str | None:
        """An event picks a shipped config by name, never a path."""
        if value is not None and value not in shipped_configs():
            raise ValueError(f"event_config {value!r} is not a shipped config (shipped: "
                             f"{', '.join(sorted(shipped_configs()))})")
        return value

    @field_validator("event_sources", mode="before")
    @classmethod
    def _no_empty_sources(cls, value: Any) -> Any:
        """An event without a corpus renders `["{{ event.payload.corpus }}"]` as `[""]`."""
        return None if isinstance(value, list) and all(v == "" for v in value) else value

    def _typed_overrides(self) -> list[str]:
        """The typed fields that are set, as overrides."""
        typed = {"train.max_steps": self.max_steps, "train.lr": self.lr,
                 "model.preset": self.preset, "tokenizer.vocab_size": self.vocab_size,
                 "shards.seq_len": self.seq_len}
        return [f"{k}={v}" for k, v in typed.items() if v is not None]

    def event_file(self) -> Path | None:
        """The config file an event named, resolved (symlinks followed), once it is found
        inside one of `config_dirs`; None when the event named none. Nothing is read.

        Raises:
            ValueError: it lies outside every `config_dirs` (or none is declared), or a
                `config_dirs` entry is not absolute; the message names the path only.
        """
        if self.event_config_file is None:
            return None
        for d in self.config_dirs:
            if not Path(d).is_absolute():
                raise ValueError(f"config_dirs entry {d!r} is not an absolute directory")
        real = Path(os.path.realpath(self.event_config_file))
        roots = [Path(os.path.realpath(d)) for d in self.config_dirs]
        if not any(real.is_relative_to(r) for r in roots):
            where = (f"config_dirs = {self.config_dirs}" if self.config_dirs else
                     "the deployment declares no config_dirs, so events may name no config "
                     "file")
            raise ValueError(f"config file {self.event_config_file!r} named by an event "
                             f"refused, nothing read: it does not lie in a directory the "
                             f"deployment allows ({where})")
        return real

    def resolved(self) -> tuple[str, list[str]]:
        """(config name or path, overrides): the typed fields become overrides, applied
        before the free-form ones. The config is the event's choice when it made one
        (`event_config_file`, checked by `event_file`, else `event_config`), else
        `config_file` or `config`.

        Raises:
            ValueError: the event's config file is refused (`event_file`).
        """
        extra = self._typed_overrides() + list(self.overrides)
        if (event_file := self.event_file()) is not None:
            return str(event_file), extra
        return self.event_config or self.config_file or self.config, extra

    def load(self) -> PipelineConfig:
        """The config these parameters name (`resolved`), with `event_sources` applied.
        When an event chose the config, its `ingest.allowed_sources` is replaced by the
        deployment config's (`config_file` or `config`, with the overrides): the allow-list
        never comes from a file an event names, and every data input of the chosen config
        (its own sources included, when the event named none) must pass it
        (`ingest.allowed.under_allow_list`). Sources are checked against it first.

        Raises:
            ValueError: the event's config file is refused (`event_file`).
            The errors of `load_config` (a file an event named is never quoted) and
            `with_event_sources` / `under_allow_list` (a bad override, a source the
            allow-list does not cover).
        """
        path, overrides = self.resolved()
        chosen = self.event_config_file is not None or self.event_config is not None
        cfg = load_config(path, overrides, quote=self.event_config_file is None)
        from mlm_pipeline.ingest.allowed import under_allow_list, with_event_sources

        if chosen:
            own = load_config(self.config_file or self.config, overrides)
            return under_allow_list(cfg, own.ingest.allowed_sources, self.event_sources,
                                    quote=self.event_config_file is None)
        if self.event_sources is not None:
            cfg = with_event_sources(cfg, self.event_sources)
        return cfg

    def resolve_retrain(self) -> tuple[PretrainParams, dict[str, str]]:
        """These parameters with the retraining mode resolved against the MLflow registry of
        the config they load, and the run tags that say how (`RETRAIN_TAG`; none with
        `retrain: scratch`, which returns them unchanged).

        With `retrain: continue`, the overrides of the policy
        (`mlm_pipeline.app.parents.retrain_overrides`: start from the registered champion
        when there is one) are added after the others, and `retrain` is `scratch`
        (resolved: children flows use them as they are).

        Raises:
            ValueError: the errors of `retrain_overrides` and `load`.
            mlflow.exceptions.MlflowException: the registry could not be asked.
        """
        if self.retrain == "scratch":
            return self, {}
        added, tags = retrain_overrides(self.load(), self.retrain_steps)
        return (self.model_copy(update={"retrain": "scratch",
                                        "overrides": [*self.overrides, *added]}), tags)


class ManifestRef(BaseModel):
    """One stage manifest in the shared work directory: its `manifest.json` and digest."""

    path: str = Field(description="Absolute path of the stage's manifest.json.")
    digest: str = Field(description="The manifest's digest (64 hex characters).")
    url: str | None = Field(None, description="The manifest's URL in the store of a URL "
                            "work directory (None: a local work directory).")

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestRef:
        """The reference of a loaded manifest."""
        return cls(path=str(manifest.path), digest=manifest.digest,
                   url=remote_url(manifest.path))

    def read(self, cls: type[M], work_dir: str | None = None) -> M:
        """Load the manifest as `cls` and check it is the one referenced, with its files
        (`app.prepared.read_prepared`: a URL work directory's is read in its mirror here).

        Raises:
            FileNotFoundError: the manifest, or a file it lists, is missing or changed
                (a work directory other than the one `prepare-data` wrote, or cleaned).
            ValueError: the file is not a valid `cls`, or its digest is not `digest`;
                with `work_dir`, a path outside it (`OutsideWorkDirError`, nothing read).
        """
        return read_prepared(cls, self.path, self.digest, self.url, work_dir)


class PreparedData(BaseModel):
    """What `prepare-data` made and `train-evaluate` reads: the three manifests, by path
    and digest, in the work directory both flows share (a path every worker sees).

    Content-addressed: a stage's directory is `<work_dir>/<stage>/<digest[:16]>`, so a
    reference stays valid until that stage is deleted; `load` checks digests and files.
    """

    corpus: ManifestRef
    tokenizer: ManifestRef
    shards: ManifestRef

    @classmethod
    def of(cls, corpus: CorpusManifest, tokenizer: TokenizerManifest,
           shards: ShardManifest) -> PreparedData:
        """The references of three loaded manifests."""
        return cls(corpus=ManifestRef.of(corpus), tokenizer=ManifestRef.of(tokenizer),
                   shards=ManifestRef.of(shards))

    def load(self, cfg: PipelineConfig
             ) -> tuple[CorpusManifest, TokenizerManifest, ShardManifest]:
        """The three manifests, checked (`ManifestRef.read`) and matched to `cfg`'s data
        sections by digest (`app.prepared.check_prepared`; `train.*` etc. are free).

        Raises:
            ValueError: a digest differs (the data was prepared with other tokenizer,
                shards or masking settings), or the errors of `ManifestRef.read`.
        """
        corpus = self.corpus.read(CorpusManifest, cfg.work_dir)
        tokenizer = self.tokenizer.read(TokenizerManifest, cfg.work_dir)
        shards = self.shards.read(ShardManifest, cfg.work_dir)
        check_prepared(cfg, corpus, tokenizer, shards, self.tokenizer.path, self.shards.path)
        return corpus, tokenizer, shards


class StageDeployments(BaseModel):
    """The deployments the `mlm-pretraining` flow runs its two halves as (each on its
    own work pool), named `flow-name/deployment-name`."""

    prepare_data: str = Field(
        "prepare-data/prepare-cpu", description="Deployment of the prepare-data flow (CPU).")
    train_evaluate: str = Field(
        "train-evaluate/train-gpu", description="Deployment of the train-evaluate flow (GPU).")


def flow_run_name() -> str:
    """A flow run's name, shared with its MLflow run: a child flow run's is its parent's (the
    whole tree carries one name); else `tracking.run_name`, else `records.run_name` (e.g.
    `tiny-modern-1000-3fa2c1`); `mlm-pretraining-<suffix>` when the parameters do not load
    (the flow run then fails on them)."""
    try:
        if parent := flow_run.parent_flow_run_id:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                return client.read_flow_run(parent).name
    except Exception:  # noqa: BLE001 - no parent to read: name it from the config
        pass
    try:
        cfg = PretrainParams.model_validate(flow_run.parameters.get("params") or {}).load()
    except Exception:  # noqa: BLE001 - the flow itself reports bad parameters
        return pipeline.run_name(None)
    return cfg.tracking.run_name or pipeline.run_name(cfg)

