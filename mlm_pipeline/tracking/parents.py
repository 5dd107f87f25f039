"""Warm-start parents (`train.init_from`) from any SOURCE, for the flows and the CLI.

A local SOURCE (checkpoint or training run directory) is used where it is. An MLflow
SOURCE (a run id, `models:/NAME@ALIAS`, `models:/NAME/VERSION`, `models:/m-...`) names
a run: its training checkpoint is the one its train manifest (artifact
`manifests/train/manifest.json`) names when that directory exists here (the same machine,
or a shared work directory), else the checkpoint the run uploaded
(`tracking.log_training_state`: artifacts `checkpoints/step-*`), downloaded with the
run's tokenizer (artifacts `tokenizer/`) to `<work_dir>/parents/<run id>/`, laid out as a
work directory (`train/<run id>/checkpoints/step-*`, `tokenizer/<digest[:16]>/`) so the
tokenizer is found beside the checkpoint. Either way the checkpoint is then verified and
loaded by `train.warm_start` (the exported `transformers` model is not a training
checkpoint and is not used).

mlflow and torch are imported inside the functions.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import CorpusManifest, TokenizerManifest, TrainManifest, read_manifest
from mlm_pipeline.progress import Progress
from mlm_pipeline.store import work_root
from mlm_pipeline.tracking.registry import CHAMPION, RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker, sqlite_db_path

if TYPE_CHECKING:  # pragma: no cover
    from mlm_pipeline.train.warm_start import InitSource

logger = logging.getLogger(__name__)

#: Where fetched MLflow parents go, under the (local mirror of the) work directory.
PARENTS_DIR = "parents"


def source_run_id(tracker: MlflowTracker, source: str) -> str:
    """The MLflow run behind an MLflow SOURCE: a run id as is; a registered version's or
    logged model's source run.

    Raises:
        ValueError: the tracking URI is a SQLite file that does not exist, or the model,
            alias, version or run is unknown (named).
    """
    from mlflow.exceptions import MlflowException

    db = sqlite_db_path(tracker.tracking_uri)
    if db is not None and not db.is_file():
        raise ValueError(f"train.init_from {source!r}: no MLflow database at {db} (set "
                         "tracking.tracking_uri or MLFLOW_TRACKING_URI)")
    client = tracker.client
    try:
        if RUN_ID.fullmatch(source):
            return client.get_run(source).info.run_id
        ref = source.removeprefix("models:/")
        if ref.startswith("m-"):
            run_id = client.get_logged_model(ref).source_run_id
        elif "@" in ref:
            name, alias = ref.split("@", 1)
            run_id = client.get_model_version_by_alias(name, alias).run_id
        else:
            name, _, version = ref.rpartition("/")
            run_id = client.get_model_version(name, version).run_id
    except MlflowException as exc:
        raise ValueError(f"train.init_from {source!r}: not found at {tracker.tracking_uri} "
                         f"({str(exc).splitlines()[0]})") from exc
    if not run_id:
        raise ValueError(f"train.init_from {source!r}: the model records no source run")
    return run_id


def registered_model_name(cfg: PipelineConfig) -> str:
    """The name a run of `cfg` registers its model under: `tracking.registered_model_name`,
    else `tracking.experiment_name` (as `train-evaluate`'s publish step uses)."""
    return cfg.tracking.registered_model_name or cfg.tracking.experiment_name


def champion_source(cfg: PipelineConfig) -> str | None:
    """The warm-start SOURCE of the registered champion of `cfg`'s model,
    `models:/<registered_model_name>@champion`, when that alias exists in `cfg`'s MLflow
    registry; None when it does not yet (no SQLite database, no registered model, or no
    version holds the alias: a first run trains from scratch).

    Raises:
        mlflow.exceptions.MlflowException: the registry could not be asked (a server that
            does not answer, a corrupt database): never read as "no champion".
    """
    from mlflow.exceptions import MlflowException

    tracker = MlflowTracker.from_config(cfg.tracking)
    db = sqlite_db_path(tracker.tracking_uri)
    if db is not None and not db.is_file():
        return None
    name = registered_model_name(cfg)
    try:
        tracker.client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        # the model is not registered yet / no version holds the alias
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
    return f"models:/{name}@{CHAMPION}"


def fetch_parent_checkpoint(tracker: MlflowTracker, source: str,
                            work_dir: str | Path) -> Path:
    """The training checkpoint of an MLflow SOURCE's run, on this machine (see the module
    docstring); not verified here (`train.warm_start.resolve_init` does).

    Raises:
        ValueError: the SOURCE is unknown (`source_run_id`), or its run has no train
            manifest, its checkpoint directory is not here and it uploaded none (the
            message says what to do).
    """
    from mlflow.exceptions import MlflowException

    run_id = source_run_id(tracker, source)
    client = tracker.client
    with tempfile.TemporaryDirectory(prefix="mlm-parent-") as tmp:
        try:
            path = client.download_artifacts(run_id, "manifests/train/manifest.json", tmp)
            trained = read_manifest(path, TrainManifest)
        except (MlflowException, OSError, ValueError) as exc:
            raise ValueError(f"train.init_from {source!r}: MLflow run {run_id} has no train "
                             "manifest (it did not finish training)") from exc
    local = Path(trained.output_dir) / trained.checkpoint_dir
    if (local / "state.json").is_file():
        return local
    name = Path(trained.checkpoint_dir).name
    if not any(Path(a.path).name == name for a in client.list_artifacts(run_id, "checkpoints")):
        raise ValueError(
            f"train.init_from {source!r}: the checkpoint of MLflow run {run_id} is neither "
            f"here ({local}) nor uploaded to the run (tracking.log_training_state was off); "
            "give its checkpoint directory instead")
    root = work_root(work_dir) / PARENTS_DIR / run_id
    checkpoint = root / "train" / run_id / "checkpoints" / name
    if not (checkpoint / "state.json").is_file():
        _download(client, run_id, f"checkpoints/{name}", checkpoint)
        logger.info("train.init_from %s: checkpoint of run %s downloaded to %s", source,
                    run_id, checkpoint)
    tokenizer = root / "tokenizer" / trained.inputs["tokenizer"][:16]
    if not (tokenizer / "manifest.json").is_file():
        _download(client, run_id, "tokenizer", tokenizer)
    return checkpoint


def _download(client: Any, run_id: str, artifact: str, dest: Path) -> None:
    """Download a run's artifact directory to `dest` atomically (renamed when complete)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.",
                                     suffix=".tmp") as tmp:
        got = Path(client.download_artifacts(run_id, artifact, tmp))
        shutil.rmtree(dest, ignore_errors=True)
        got.rename(dest)


def init_checkpoint(cfg: PipelineConfig) -> Callable[[], Path] | None:
    """What `train.train` takes as `init_checkpoint`: for an MLflow `train.init_from`, a
    function fetching its checkpoint (`fetch_parent_checkpoint`), called at a fresh start
    only (a resumed run never reads its parent again); None without `train.init_from` or
    for a local SOURCE (one that does not exist is refused by `train` at a fresh start)."""
    source = cfg.train.init_from
    if source is None or Path(source).expanduser().exists() or not (
            source.startswith("models:/") or RUN_ID.fullmatch(source)):
        return None
    return lambda: fetch_parent_checkpoint(MlflowTracker.from_config(cfg.tracking), source,
                                           cfg.work_dir)


def launch_init(cfg: PipelineConfig, out_dir: str | Path) -> dict[str, str]:
    """What a torchrun launch adds to its `extra` for the ranks' `train` (`init_checkpoint`):
    the MLflow parent fetched once here, before any rank starts, when the run directory
    `out_dir` holds no checkpoint yet (a fresh start); empty otherwise.

    Raises:
        ValueError: the errors of `fetch_parent_checkpoint`.
    """
    from mlm_pipeline.train.verified import list_checkpoints

    fetch = init_checkpoint(cfg)
    if fetch is None or list_checkpoints(Path(out_dir) / "checkpoints"):
        return {}
    return {"init_checkpoint": str(fetch())}


def parent_of(cfg: PipelineConfig) -> InitSource | None:
    """The verified parent of `cfg` (`train.warm_start.resolve_init`), fetched first when
    it is an MLflow SOURCE; None without `train.init_from`.

    Raises:
        ValueError, FileNotFoundError: the errors of `fetch_parent_checkpoint` and
            `resolve_init`.
    """
    from mlm_pipeline.train.warm_start import resolve_init

    if cfg.train.init_from is None:
        return None
    fetch = init_checkpoint(cfg)
    return resolve_init(cfg.train.init_from, fetch() if fetch else None,
                        cfg.train.trust_unverified_checkpoint)


def tokenizer_digest_for(cfg: PipelineConfig, corpus: CorpusManifest) -> str:
    """The digest of the tokenizer `prepare_tokenizer` gives `cfg`: the parent's with
    `tokenizer.from_init`, the adopted files' with `tokenizer.adopt_from`, else
    `tokenizer_digest(cfg.tokenizer, corpus)`.

    Raises:
        ValueError, FileNotFoundError: the errors of `parent_of` and
            `pretrained_tokenizer_digest`.
    """
    from mlm_pipeline.tokenizer import pretrained_tokenizer_digest, tokenizer_digest

    if cfg.tokenizer.adopt_from is not None:
        return pretrained_tokenizer_digest(cfg.tokenizer.adopt_from)
    if not cfg.tokenizer.from_init:
        return tokenizer_digest(cfg.tokenizer, corpus)
    parent = parent_of(cfg)
    return str(parent.state.get("tokenizer_digest"))


def prepare_tokenizer(cfg: PipelineConfig, corpus: CorpusManifest,
                      progress: Progress | None = None) -> TokenizerManifest:
    """The tokenizer stage of `cfg`: the Hugging Face tokenizer of `tokenizer.adopt_from`,
    the parent's tokenizer adopted into the work directory with `tokenizer.from_init`
    (nothing trained either way), else `train_tokenizer`.

    Raises:
        ValueError, FileNotFoundError, RuntimeError: the errors of `parent_of`,
            `warm_start.parent_tokenizer`, `adopt_tokenizer`,
            `adopt_pretrained_tokenizer` or `train_tokenizer`.
    """
    from mlm_pipeline.tokenizer import (
        adopt_pretrained_tokenizer,
        adopt_tokenizer,
        train_tokenizer,
    )
    from mlm_pipeline.train.warm_start import parent_tokenizer

    if cfg.tokenizer.adopt_from is not None:
        return adopt_pretrained_tokenizer(cfg.tokenizer.adopt_from, cfg.work_dir)
    if not cfg.tokenizer.from_init:
        return train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir, progress)
    return adopt_tokenizer(parent_tokenizer(parent_of(cfg)), cfg.work_dir)


def parent_tags(init: dict[str, Any] | None) -> dict[str, str]:
    """MLflow tags of a run's parent (`TrainManifest.init`): `mlm.init_from`,
    `mlm.init_digest`, `mlm.init_step`, `mlm.init_checkpoint`; empty without one."""
    if not init:
        return {}
    return {"mlm.init_from": str(init["source"]), "mlm.init_digest": str(init["digest"]),
            "mlm.init_step": str(init["step"]), "mlm.init_checkpoint": str(init["checkpoint"])}
