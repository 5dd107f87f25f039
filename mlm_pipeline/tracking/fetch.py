"""An MLflow run's training checkpoint and tokenizer fetched to this machine: the parent of
a warm start (`train.init_from`), or the champion the registry re-scores.

An MLflow SOURCE (a run id, `models:/NAME@ALIAS`, `models:/NAME/VERSION`, `models:/m-...`)
names a run: its checkpoint is the one its train manifest (artifact
`manifests/train/manifest.json`) names when that directory exists here, else the one the
run uploaded (`tracking.log_training_state`), downloaded with the run's tokenizer to
`<work_dir>/parents/<run id>/`, laid out as a work directory
(`train/<run id>/checkpoints/step-*`, `tokenizer/<digest[:16]>/`) so the tokenizer is
found beside the checkpoint.
`train.warm_start` verifies and loads it; `mlm_pipeline.app.parents` picks the parent.
mlflow is imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import TrainManifest, read_manifest
from mlm_pipeline.store import work_root
from mlm_pipeline.tracking.registry import CHAMPION, RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker, sqlite_db_path

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


def parent_tags(init: dict[str, Any] | None) -> dict[str, str]:
    """MLflow tags of a run's parent (`TrainManifest.init`): `mlm.init_from`,
    `mlm.init_digest`, `mlm.init_step`, `mlm.init_checkpoint`, `mlm.init_hf_class` for a
    Hugging Face parent (its `transformers` class; its directory is `mlm.init_checkpoint`,
    its directory digest `mlm.init_digest`), and `mlm.init_changes` (JSON: what a length
    phase changed, e.g. `seq_len` and `model.rope_base`) when it changed something; empty
    without one."""
    if not init:
        return {}
    tags = {"mlm.init_from": str(init["source"]), "mlm.init_digest": str(init["digest"]),
            "mlm.init_step": str(init["step"]), "mlm.init_checkpoint": str(init["checkpoint"])}
    if init.get("hf_class"):
        tags["mlm.init_hf_class"] = str(init["hf_class"])
    if init.get("changes"):
        tags["mlm.init_changes"] = json.dumps(init["changes"], sort_keys=True)
    return tags
