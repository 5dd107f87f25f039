"""Lineage of a registered model version: its parent, its data and what the run added,
as model-version tags, so the champion's history reads from the registry alone; the
final evaluation metrics linked to the MLflow logged model (the run's own points, never a
second one); and the asset keys of the stage outputs that the flows report to Prefect.

Model-version tags (`record_version_lineage`, after `app.publish.publish` registered the
version; the run gets the `lineage.parent*` and `lineage.steps_added` tags too):

- `lineage.parent_source`: `train.init_from` as given (`models:/NAME@champion`, a run id,
  a checkpoint path); `lineage.parent`: it resolved: `models:/NAME/VERSION` when it is a
  registered version (found by the checkpoint digest, else by the alias, version, logged
  model or run), else the run id, else the checkpoint path; `lineage.parent_version` and
  `lineage.parent_run_id` when known; `lineage.parent_digest` and `lineage.parent_step`:
  the parent checkpoint's `state_sha256` and step (`TrainManifest.init`). A version
  trained from random weights has `lineage.parent` = `none` and no other parent tag.
- `lineage.model_digest`: the `state_sha256` of the version's own checkpoint (what a
  child's `lineage.parent_digest` matches); `lineage.corpus_digest`,
  `lineage.tokenizer_digest`: the ingest and tokenizer manifests' digests;
  `lineage.steps_added`: optimizer steps this run trained (a warm start counts from 0);
  `lineage.decision`: the registry's decision at registration (the version's `decision`
  tag says `forced` after `mlm-pipeline promote`).

An alias moves: `models:/NAME@champion` read after registration may name the new version
itself (it was promoted); the parent is then the champion it was registered under
(`decide`'s `champion_before`).

mlflow is imported inside the functions.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlm_pipeline.manifest import EvalManifest, ShardManifest, TrainManifest
from mlm_pipeline.tracking.lineage import dataset_digest
from mlm_pipeline.tracking.registry import CHAMPION, RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker

__all__ = ["ASSET_SCHEME", "PREFIX", "asset_key", "log_model_metrics", "model_digest",
           "parent_label", "record_lineage", "record_version_lineage"]

#: Tag prefix of the lineage tags.
PREFIX = "lineage."
#: URI scheme of the Prefect asset keys.
ASSET_SCHEME = "mlm"
#: Digest characters in an asset key.
ASSET_DIGEST_CHARS = 16
#: A training run directory inside a checkpoint path (`<work>/train/<run id>/checkpoints`).
_RUN_DIR = re.compile(r"(?:^|/)train/([0-9a-f]{32})/checkpoints(?:/|$)")


def asset_key(stage: str, digest: str) -> str:
    """The Prefect asset key of a stage output: `mlm://<stage>/<digest[:16]>`
    (`stage`: `corpus`, `tokenizer`, `shards` or `model`; the model's digest is its
    checkpoint's `state_sha256`, `model_digest`). Keys name content, not experiments: the
    same data used by two experiments is one asset, and a parent model from any
    experiment links to its child. (Prefect 3.9 takes only `[a-z0-9]+` as a key's
    scheme, hence `mlm`, not `mlm-pipeline`.)

    Raises:
        ValueError: `digest` is not hex, or shorter than 16 characters.
    """
    if not re.fullmatch(r"[0-9a-f]{16,}", digest):
        raise ValueError(f"asset key of {stage}: digest {digest!r} is not 16+ hex characters")
    return f"{ASSET_SCHEME}://{stage}/{digest[:ASSET_DIGEST_CHARS]}"


def model_digest(trained: TrainManifest) -> str:
    """The `state_sha256` of `trained`'s final checkpoint (its `state.json`), what a warm
    start records as its parent's digest; the train manifest's digest when the checkpoint
    has none (an unverified one).

    Raises:
        FileNotFoundError: the checkpoint's `state.json` is missing.
        ValueError: it is not JSON (the message names the file).
    """
    path = trained.file(trained.checkpoint_dir) / "state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    return str(state.get("state_sha256") or trained.digest)


def _resolve_parent(tracker: MlflowTracker, name: str, new: int, init: Mapping[str, Any],
                    champion_before: Mapping[str, Any] | None) -> dict[str, str]:
    """`lineage.parent`, and `lineage.parent_version` / `lineage.parent_run_id` when known,
    of version `new` of `name` whose parent is `init` (`TrainManifest.init`)."""
    from mlflow.exceptions import MlflowException

    client = tracker.client
    source = str(init["source"])
    versions = [v for v in client.search_model_versions(f"name = '{name}'")
                if int(v.version) != new]

    def found(version) -> dict[str, str]:
        return {"parent": f"models:/{version.name}/{version.version}",
                "parent_version": str(version.version), "parent_run_id": version.run_id or ""}

    same = [v for v in versions if v.tags.get(f"{PREFIX}model_digest") == init["digest"]]
    if same:  # the exact checkpoint, whatever SOURCE named it
        return found(max(same, key=lambda v: int(v.version)))
    ref = source.removeprefix("models:/")
    try:
        if source.startswith("models:/") and ref.startswith("m-"):
            hits = [v for v in versions if getattr(v, "model_id", None) == ref]
            if hits:
                return found(max(hits, key=lambda v: int(v.version)))
            return {"parent": source,
                    "parent_run_id": client.get_logged_model(ref).source_run_id or ""}
        if source.startswith("models:/") and "@" in ref:
            model, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(model, alias)
            if model == name and int(version.version) == new:  # the alias moved to it
                if alias != CHAMPION or not champion_before:
                    return {"parent": source}
                version = client.get_model_version(name, str(champion_before["version"]))
            return found(version)
        if source.startswith("models:/"):
            model, _, number = ref.rpartition("/")
            return found(client.get_model_version(model, number))
    except MlflowException:  # deleted since: the SOURCE as given
        return {"parent": source}
    run_id = source if RUN_ID.fullmatch(source) else None
    if run_id is None and (match := _RUN_DIR.search(Path(str(init["checkpoint"])).as_posix())):
        run_id = match.group(1)
    hits = [v for v in versions if run_id and v.run_id == run_id]
    if hits:
        return found(max(hits, key=lambda v: int(v.version)))
    return {"parent": source if run_id == source else str(init["checkpoint"]),
            **({"parent_run_id": run_id} if run_id else {})}


def record_version_lineage(tracker: MlflowTracker, registered: Mapping[str, Any],
                           trained: TrainManifest, corpus_digest: str,
                           tokenizer_digest: str) -> dict[str, str]:
    """Tag the model version `app.publish.publish` registered with its lineage (module
    docstring) and the run with its parent and steps added.

    Args:
        tracker: the MLflow backend.
        registered: `app.publish.publish`'s record: `name`, `version`, `decision`,
            `champion_before` (the run is the version's).
        trained: the run's train manifest (`steps`, `init`, the final checkpoint).
        corpus_digest, tokenizer_digest: the ingest and tokenizer manifests' digests.

    Returns:
        The tags set on the version, keys without the `lineage.` prefix.

    Raises:
        FileNotFoundError, ValueError: the checkpoint's `state.json` (`model_digest`).
        mlflow.exceptions.MlflowException: the version does not exist.
    """
    client = tracker.client
    name, new = str(registered["name"]), int(registered["version"])
    version = client.get_model_version(name, str(new))
    tags = {"model_digest": model_digest(trained), "corpus_digest": corpus_digest,
            "tokenizer_digest": tokenizer_digest, "steps_added": str(trained.steps),
            "decision": str(registered["decision"])}
    init = trained.init
    if init:
        tags.update({"parent_source": str(init["source"]), "parent_digest": str(init["digest"]),
                     "parent_step": str(init["step"])})
        tags.update({k: v for k, v in _resolve_parent(
            tracker, name, new, init, registered.get("champion_before")).items() if v})
    else:
        tags["parent"] = "none"
    tags = {k: v for k, v in tags.items() if v}  # an unverified parent has no digest
    for key, value in tags.items():
        client.set_model_version_tag(name, str(new), PREFIX + key, value)
    tracker.set_tags(version.run_id, {PREFIX + k: tags[k] for k in (
        "parent", "parent_version", "parent_run_id", "steps_added") if k in tags})
    return tags


def parent_label(tags: Mapping[str, str]) -> str:
    """A short name of a run's or version's parent for tables: `v3` (a version of the same
    registered model), `NAME v3` (of another), a run-id prefix (8 characters), `@ALIAS`
    or the checkpoint directory's name for what could not be resolved, `-` without one.
    Reads the `lineage.*` tags, else the run's `mlm.init_from` / `mlm.init_checkpoint`."""
    parent = tags.get(f"{PREFIX}parent") or tags.get("mlm.init_from")
    if not parent or parent == "none":
        return "-"
    if version := tags.get(f"{PREFIX}parent_version"):
        return f"v{version}"
    ref = parent.removeprefix("models:/")
    if parent.startswith("models:/") and not ref.startswith("m-"):
        model, sep, number = ref.rpartition("/")
        if sep and number.isdigit():
            return f"{model} v{number}"
        return ref[ref.index("@"):] if "@" in ref else ref
    run_id = tags.get(f"{PREFIX}parent_run_id")
    if run_id is None and RUN_ID.fullmatch(parent):
        run_id = parent
    if run_id is None:
        match = _RUN_DIR.search(Path(tags.get("mlm.init_checkpoint", parent)).as_posix())
        run_id = match.group(1) if match else None
    return run_id[:8] if run_id else Path(parent).name


def log_model_metrics(tracker: MlflowTracker, run_id: str, model_uri: str,
                      metrics: Mapping[str, float], step: int, dataset_name: str,
                      dataset_digest: str) -> dict[str, float]:
    """Link the run's final evaluation points to the logged model `model_uri`
    (`models:/m-...`), so the model's page lists them, without ever adding a point to the
    run's history (one point per key and step, whatever the end stages did or redid).

    A link is the run's own point of that key at `step` (its timestamp and value) sent again
    with the model's id: MLflow stores a run's metric once per (key, timestamp, step, value),
    so the run's history is unchanged. Points MLflow's `log_model(step=...)` already linked,
    without a dataset, are left as they are (adding the dataset would take a second point of
    a new timestamp); points linked here carry `dataset_name` / `dataset_digest`. A key the
    run holds no point of at `step` is logged once here, linked, with the dataset.
    Non-finite values are skipped, as MLflow cannot store them.

    Args:
        tracker: the MLflow backend.
        run_id: the run that logged the model (RUNNING).
        model_uri: `models:/m-<id>` (`registry.log_model`).
        metrics: key -> value (`eval/loss`, ...).
        step: the final step (the step of the run's eval points).
        dataset_name, dataset_digest: a dataset input of the run (the validation shards).

    Returns:
        The points linked or logged here, key -> value (empty when all were linked).

    Raises:
        ValueError: `model_uri` is not a `models:/m-...` URI.
    """
    from mlflow.entities import Metric

    model_id = model_uri.removeprefix("models:/")
    if not model_uri.startswith("models:/m-"):
        raise ValueError(f"log_model_metrics: {model_uri!r} is not a logged model "
                         "(models:/m-...)")
    client = tracker.client
    linked = {(m.key, m.step) for m in client.get_logged_model(model_id).metrics or []}
    points = []
    for key, value in metrics.items():
        if not math.isfinite(value) or (key, step) in linked:
            continue
        own = [m for m in client.get_metric_history(run_id, key) if m.step == step]
        if own:  # the run's point itself: the run's history keeps one
            value, stamp = own[-1].value, own[-1].timestamp
        else:
            stamp = time.time_ns() // 1_000_000  # MLflow's unit: ms since the epoch
        points.append(Metric(key, float(value), stamp, step, model_id=model_id,
                             dataset_name=dataset_name, dataset_digest=dataset_digest,
                             run_id=run_id))
    if points:
        client.log_batch(run_id, metrics=points)
    return {p.key: p.value for p in points}


def record_lineage(tracker: MlflowTracker, registered: Mapping[str, Any],
                   trained: TrainManifest, evaluated: EvalManifest,
                   shards: ShardManifest, tokenizer_digest: str) -> dict[str, str]:
    """What `train-evaluate`'s publish step records after registration: the version's
    lineage (`record_version_lineage`, the corpus digest from `shards.inputs`) and the final
    evaluation metrics linked to the logged model `registered["model_uri"]`
    (`log_model_metrics`, dataset `shards-validation`, digest `lineage.dataset_digest`).
    Returns the version's lineage tags.

    Raises:
        The errors of `record_version_lineage` and `log_model_metrics`.
    """
    tags = record_version_lineage(tracker, registered, trained, shards.inputs["corpus"],
                                  tokenizer_digest)
    version = tracker.client.get_model_version(str(registered["name"]),
                                               str(registered["version"]))
    log_model_metrics(tracker, version.run_id, str(registered["model_uri"]),
                      evaluated.metrics, trained.steps, "shards-validation",
                      dataset_digest(shards))
    return tags
