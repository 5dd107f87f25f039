"""What a pipeline run records: lineage tags, data accounting and results.

The flow in `flows/` calls these between stages; they turn stage manifests into MLflow
tags, metrics and artifacts (through the `mlm_pipeline.tracking.tracker` package, the only MLflow
user). The summary a user reads at the end of a run is `mlm_pipeline.app.summary`.
No torch, no prefect.
"""

from __future__ import annotations

import getpass
import importlib.metadata
import logging
import re
import secrets
import sys
from pathlib import Path
from typing import Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config.hf_parent import HF_CONFIG, hf_parent_class
from mlm_pipeline.config_files import flatten
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.manifest import (
    CorpusManifest, EvalManifest, Manifest, ShardManifest, TokenizerManifest, TrainManifest,
    check_in_work_dir, load_if_complete)
from mlm_pipeline.tracking.lineage import shard_inputs
from mlm_pipeline.tracking.plots import log_loss_plot
from mlm_pipeline.tracking.tracker import MlflowTracker, git_commit

logger = logging.getLogger(__name__)


#: Config keys that say how a run is kept (which run to continue, whether to, what to
#: trust), not what it computes: never params, so a continued run's params are those of the
#: run it continues. The tracker logs the `tracking.` ones as tags (`MlflowTracker`).
BOOKKEEPING_KEYS = ("tracking.resume_run_id", "tracking.resume",
                    "train.trust_unverified_checkpoint")


def run_params(cfg: PipelineConfig) -> dict[str, Any]:
    """The flattened config (`train.lr`, `model.hidden_size`, ...) logged as MLflow params,
    less `BOOKKEEPING_KEYS`, plus `train.warmup_in_effect`: the warm-up steps used
    (`TrainConfig.warmup`), since `train.warmup_steps` is None when `warmup_ratio` (or the
    default) sets the warm-up, and `mlm.model_from` when a Hugging Face parent's
    `config.json` gave the `model` section (`config.hf_parent`): that file, and its class."""
    params = {k: v for k, v in flatten(cfg).items() if k not in BOOKKEEPING_KEYS}
    params["train.warmup_in_effect"] = cfg.train.warmup
    hf_class = hf_parent_class(cfg.train.init_from) if cfg.train.init_from else None
    if hf_class is not None:
        params["mlm.model_from"] = f"{Path(cfg.train.init_from) / HF_CONFIG} ({hf_class})"
    return params


def run_name(cfg: PipelineConfig | None, suffix: str | None = None) -> str:
    """A readable run name shared by the Prefect flow run and its MLflow run:
    `<config name>-<model preset>-<max_steps>-<suffix>`, e.g. `tiny-modern-1000-3fa2c1`
    (no preset part when `model.preset` is unset; characters other than `A-Za-z0-9._-` in
    the config name become `-`); `mlm-pretraining-<suffix>` without a config. `suffix`
    defaults to 6 random hex digits, so that two runs of one config have different names.
    `tracking.run_name`, when set, is used instead by the caller."""
    suffix = suffix or secrets.token_hex(3)
    if cfg is None:
        return f"mlm-pretraining-{suffix}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.name).strip("-") or "mlm"
    preset = f"{cfg.model.preset}-" if cfg.model.preset else ""
    return f"{name}-{preset}{cfg.train.max_steps}-{suffix}"


def _user() -> str:
    """The OS user (MLflow's `mlflow.user`); `unknown` when the system has none for the uid."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no $USER/$LOGNAME and no passwd entry (containers)
        return "unknown"


#: Distributions whose versions a run records (`package_versions`), by their PyPI names.
VERSIONED_PACKAGES = ("mlm-pipeline", "torch", "prefect", "mlflow", "sentencepiece",
                      "pyarrow", "transformers")


def package_versions() -> dict[str, str]:
    """Installed versions of `VERSIONED_PACKAGES`, `{distribution name: version}`, read with
    `importlib.metadata` (nothing is imported, Prefect included); a package that is not
    installed (e.g. `transformers`, an optional extra) is left out."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_tags(extra: dict[str, str] | None = None, source_name: str | None = None,
             source_type: str = "LOCAL") -> dict[str, str]:
    """Tags known when a run starts: code version, `mlflow.user`, `mlflow.source.name`
    (`source_name`, default the program's name, e.g. `mlm-pipeline`) and
    `mlflow.source.type` (`LOCAL`, or `JOB` for a deployment's run; MLflow's
    `SourceType`), the git commit (`mlflow.source.git.commit`, when running from a
    checkout), `version.<distribution>` for each of `package_versions` (e.g.
    `version.torch`) and whatever the caller adds (e.g. the Prefect flow-run id and URL)."""
    from mlm_pipeline import __version__

    tags = {"mlm_pipeline.version": __version__, "mlflow.user": _user(),
            "mlflow.source.name": source_name or Path(sys.argv[0]).name or "python",
            "mlflow.source.type": source_type}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    tags.update({f"version.{name}": v for name, v in package_versions().items()})
    tags.update(extra or {})
    return tags


def data_tags(corpus: CorpusManifest, tokenizer: TokenizerManifest,
              shards: ShardManifest) -> dict[str, str]:
    """Lineage: the digest of every data stage, so runs on the same data can be found."""
    return {"digest.corpus": corpus.digest, "digest.tokenizer": tokenizer.digest,
            "digest.shards": shards.digest, "tokenizer.model_sha256": tokenizer.model.sha256}


def data_accounting(corpus: CorpusManifest, tokenizer: TokenizerManifest,
                    shards: ShardManifest) -> dict[str, int]:
    """Ingestion accounting and data sizes: counts of documents (read, per split, dropped
    and repaired by reason), characters, vocabulary, rows and tokens, input files
    rejected as bad or skipped, and (when measured) the validation<->training n-gram
    overlap (`validation_13gram_windows`, `..._in_train`, documents mostly training text,
    validation lines removed as training lines). `record_data` logs them as params
    `data.<name>` and as the artifact `data/accounting.json`, not as metrics (one-point
    charts would bury the training curves in the MLflow UI)."""
    m: dict[str, int] = {
        "documents_read": corpus.documents_read,
        "documents_train": corpus.documents_train,
        "documents_validation": corpus.documents_validation,
        "characters": corpus.characters,
        "vocab_size": tokenizer.vocab_size,
        "train_rows": shards.train.rows,
        "validation_rows": shards.validation.rows,
        "train_tokens": shards.train.rows * shards.seq_len,
        "remainder_tokens": shards.train.remainder_tokens + shards.validation.remainder_tokens,
    }
    m.update({f"dropped_{k}": v for k, v in corpus.dropped.items()})
    m.update({f"repaired_{k}": v for k, v in corpus.repaired.items()})
    m["files_rejected"], m["files_skipped"] = len(corpus.bad_files), len(corpus.skipped_files)
    if (overlap := corpus.validation_overlap) is not None:  # ingest.overlap: what remains
        m[f"validation_{overlap.ngram}gram_windows"] = overlap.validation_windows
        m[f"validation_{overlap.ngram}gram_windows_in_train"] = (
            overlap.validation_windows_in_train)
        m["validation_documents_mostly_in_train"] = overlap.validation_documents_mostly_in_train
        m["validation_lines_removed"] = overlap.lines_removed
    return m


def record_data(tracker: MlflowTracker, run_id: str, corpus: CorpusManifest,
                tokenizer: TokenizerManifest, shards: ShardManifest) -> None:
    """Log data lineage (digest tags, and both shard splits as dataset inputs with contexts
    `training` / `validation`: `lineage.shard_inputs`), the accounting (`data_accounting`:
    params `data.<name>` and `data/accounting.json`), the rejected input files
    (`data/bad_files.json`, when any), the tokenizer files and the manifests.

    Raises:
        ManifestPathError: the tokenizer manifest lists a path outside its directory
            (a `ValueError` naming the manifest; nothing outside is logged or read).
    """
    tracker.set_tags(run_id, data_tags(corpus, tokenizer, shards))
    tracker.log_inputs(run_id, shard_inputs(shards))
    accounting = data_accounting(corpus, tokenizer, shards)
    tracker.log_params(run_id, {f"data.{k}": v for k, v in accounting.items()})
    tracker.log_dict(run_id, accounting, "data/accounting.json")
    if corpus.bad_files:
        tracker.log_dict(run_id, [b.model_dump() for b in corpus.bad_files],
                         "data/bad_files.json")
    for entry in tokenizer.tokenizer_files():  # spm.model + spm.vocab, or an adopted set
        tracker.log_artifacts(run_id, tokenizer.file(entry.path), "tokenizer")
    # Beside the model, so `Tokenizer.load` of the downloaded model finds its normalization.
    tracker.log_artifacts(run_id, tokenizer.path, "tokenizer")
    for m in (corpus, tokenizer, shards):
        tracker.log_artifacts(run_id, m.path, f"manifests/{m.stage}")


#: Tag set once the final evaluation's fill-mask rows are in the run's table (their step).
_FINAL_ROWS_TAG = "mlm.final_fill_mask_rows"


def train_tags(trained: TrainManifest) -> dict[str, str]:
    """The run tags of a finished training stage: `train.stopped_early`, `mlm.stop_reason`,
    `train.device`, `train.precision`, `mfu.peak_source`, and `mlm.compile_fallback`
    (`recompile_limit`) only when the compiled model fell back to eager code."""
    tags = {"train.stopped_early": str(trained.stopped_early),
            "mlm.stop_reason": trained.stop_reason, "train.device": trained.device,
            "train.precision": trained.precision,
            "mfu.peak_source": trained.peak_source or "unknown"}
    if trained.compile_fallback:
        tags["mlm.compile_fallback"] = trained.compile_fallback
    return tags


def record_results(tracker: MlflowTracker, run_id: str, cfg: PipelineConfig,
                   trained: TrainManifest, evaluated: EvalManifest,
                   fill_mask_rows: list[dict[str, Any]]) -> None:
    """Log eval metrics (at the final step: the curve's last point; those already there
    are not logged again), the fill-mask predictions (JSON, and `fill_mask_rows`, the final
    evaluation's rows of `evaluate.probes.table_rows`, appended once to the fill-mask table
    at the final step), the tags of `train_tags`, the holdout text's digest
    (`digest.holdout`, with a holdout), manifests and `plots/loss.png` (`plots.log_loss_plot`;
    a plot that cannot be drawn is a warning); the final training checkpoint (optimizer and
    RNG state included) only when `tracking.log_training_state` (the model itself is logged
    by `app.publish.publish`)."""
    from mlm_pipeline.tracking.fill_mask_table import log_fill_mask_rows
    from mlm_pipeline.tracking.registry import holdout_run_tags
    from mlm_pipeline.tracking.resume import log_missing_metrics

    # Idempotent: finishing a run whose end stages failed keeps one point per key and
    # step, and one set of final fill-mask rows (marked by a tag once appended).
    log_missing_metrics(tracker, run_id, evaluated.metrics, trained.steps)
    tracker.log_dict(run_id, evaluated.probes, "eval/fill_mask.json")
    if tracker.get_run(run_id).data.tags.get(_FINAL_ROWS_TAG) != str(trained.steps):
        log_fill_mask_rows(tracker, run_id, fill_mask_rows)
        tracker.set_tags(run_id, {_FINAL_ROWS_TAG: str(trained.steps)})
    try:
        log_loss_plot(tracker, run_id)
    except ValueError as exc:  # e.g. no train/tokens_seen logged (a run of 0 steps)
        logger.warning("run %s: plots/loss.png not logged: %s", run_id, exc)
    # The evaluation's own tags: why a downstream figure is missing, the tasks' digests.
    tracker.set_tags(run_id, {**train_tags(trained), **holdout_run_tags(evaluated),
                              **evaluated.tags})
    for m in (trained, evaluated):
        tracker.log_artifacts(run_id, m.path, f"manifests/{m.stage}")
    tracker.log_artifacts(run_id, trained.file(trained.metrics_log), "train")
    if cfg.tracking.log_training_state:
        ckpt = trained.file(trained.checkpoint_dir)
        tracker.log_artifacts(run_id, ckpt, f"checkpoints/{ckpt.name}")


def outputs_exist(manifest: Manifest, work_dir: str | Path | None = None) -> bool:
    """True when every file a manifest lists is still on disk with its recorded size and
    sha256 (through the work directory's hash memo, `HashMemo.of_stage_dir`; a changed file
    is named in a warning): an orchestrator's cached result is reused only then. With
    `work_dir`, `output_dir` must be inside it (`manifest.check_in_work_dir`).

    Raises:
        ManifestPathError: the stage's `manifest.json` lists a path outside its directory
            (a `ValueError` naming the manifest; nothing outside is read).
        OutsideWorkDirError: (a `ValueError`) `output_dir` is outside `work_dir`.
    """
    out_dir = Path(manifest.output_dir)
    if work_dir is not None:
        check_in_work_dir(out_dir, work_dir, f"{manifest.stage} output_dir")
    memo = HashMemo.of_stage_dir(out_dir)
    return load_if_complete(out_dir, type(manifest), manifest.digest,
                            memo.file_sha256) is not None


def accounting_rows(corpus: CorpusManifest) -> list[dict[str, Any]]:
    """Ingestion accounting as table rows: what was read, kept, dropped and repaired, with
    the reason and the number of documents (a dropped or repaired document is never silent)."""
    rows: list[dict[str, Any]] = [
        {"what": "read", "reason": "", "documents": corpus.documents_read},
        {"what": "kept (train)", "reason": "", "documents": corpus.documents_train},
        {"what": "kept (validation)", "reason": "", "documents": corpus.documents_validation},
    ]
    for what, counts in (("dropped", corpus.dropped), ("repaired", corpus.repaired)):
        rows += [{"what": what, "reason": k, "documents": v} for k, v in sorted(counts.items())]
    # A rejected file: its reason and path, and the records read from it before the error.
    rows += [{"what": "file rejected", "reason": f"{b.reason}: {b.path}", "documents": b.documents}
             for b in corpus.bad_files]
    return rows
