"""The run's MLflow model and the model registry's champion and challenger: what is
written to MLflow and read back from it. The decision itself is `mlm_pipeline.app.decide`
(pure), composed with the model export and the champion's re-scoring in
`mlm_pipeline.app.publish`.

Every new version gets `challenger`; `champion` moves to it when the decision promotes it
(`promote` forces it). The decision, the metric, both scores and the data they were
computed on are set on the run (tags `registry.*`, metrics `registry/*`) and on the model
version (tags `decision`, `compared_*`). mlflow and transformers are imported inside the
functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlm_pipeline.errors import MissingDependencyError
from mlm_pipeline.manifest import EvalManifest
from mlm_pipeline.tracking.resume import log_missing_metrics
from mlm_pipeline.tracking.tracker import MlflowTracker, sqlite_db_path

logger = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
#: The metrics a decision names (`app.decide`; the same strings, no import of it needed).
METRIC, BPC_METRIC, HOLDOUT_METRIC = "eval/loss", "eval/bits_per_char", "holdout/bits_per_char"
#: Model-version tags of a version's own holdout score.
HOLDOUT_DIGEST_TAG, HOLDOUT_SEED_TAG, HOLDOUT_SCORE_TAG = (
    "holdout.digest", "holdout.seed", "holdout.bits_per_char")
#: Logged-model tag: the step of the checkpoint it was exported from.
_STEP_TAG = "mlm.step"
#: Model-version tag: the champion version when it was registered (`none`: there was none).
_BEFORE_TAG = "champion_before"
#: MLflow run ids: 32 lowercase hex digits.
RUN_ID = re.compile(r"[0-9a-f]{32}")
#: Where the flavor stores the weights and the tokenizer inside a logged model.
_MODEL_DIR, _TOKENIZER_DIR = "model", "components/tokenizer"
#: The model card as the flavor stores it: body and front matter apart.
_CARD_TEXT, _CARD_DATA = "model_card.md", "model_card_data.yaml"


def eval_data_digest(evaluated: EvalManifest) -> str:
    """What an `eval/loss` was measured on, as a sha256 (hex): the validation shards
    digest, the evaluation seed and row cap, and the masking rates. Two losses are
    comparable only when these digests are equal (the batch size and probes do not
    change the loss and are left out)."""
    eval_cfg = evaluated.config.get("eval", {})
    data = {"shards": evaluated.inputs["shards"], "seed": eval_cfg.get("seed"),
            "max_rows": eval_cfg.get("max_rows"), "masking": evaluated.config.get("masking")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """Set the process-wide tracking URI (read by MLflow's fluent model API) for the block,
    then restore it: an unset one is unset with `set_tracking_uri(None)`, as MLflow's own
    helper does (`get_tracking_uri()` would pin the default `sqlite:///<cwd>/mlflow.db`),
    and $MLFLOW_TRACKING_URI keeps its value. Checked by tests/flows/test_prefect_private.py."""
    import mlflow
    from mlflow.tracking import is_tracking_uri_set

    before = mlflow.get_tracking_uri() if is_tracking_uri_set() else None
    env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None: unset, as before the block
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env


def log_model(tracker: MlflowTracker, run_id: str, model_dir: Path, step: int,
              input_example: str) -> str:
    """Log a `transformers` model directory as the run's MLflow model (flavor
    `transformers`, task `fill-mask`; the signature is inferred from `input_example`, a
    text with `[MASK]`; the model card is the directory's `README.md`; served texts are
    truncated to the model's sequence length). Returns the `models:/m-...` URI.

    Raises:
        MissingDependencyError: `transformers` is not installed.
    """
    import mlflow

    try:
        import transformers
        from huggingface_hub import ModelCard
    except ImportError as exc:
        raise MissingDependencyError(
            f"logging the model needs transformers, which cannot be imported ({exc}); it is "
            "a dependency of mlm-pipeline: reinstall it (pip install mlm-pipeline)") from exc

    pipe = transformers.pipeline("fill-mask", model=str(model_dir), device="cpu")
    # Given explicitly, the card is not looked up on the Hugging Face Hub (offline runs).
    card = ModelCard.load(model_dir / "README.md")
    run = tracker.get_run(run_id)
    # Created here because `log_model` would put it in the fluent API's current experiment
    # (the Default one, artifacts under ./mlruns), not the run's.
    logged = tracker.client.create_logged_model(
        run.info.experiment_id, name="model", source_run_id=run_id,
        params=dict(run.data.params), tags={_STEP_TAG: str(step)})
    with _tracking_uri(tracker.tracking_uri):
        info = mlflow.transformers.log_model(
            pipe, name="model", task="fill-mask", model_card=card, run_id=run_id,
            model_id=logged.model_id, input_example=[input_example], step=step,
            # Texts longer than the model's sequence length are cut, not an index error.
            model_config={"tokenizer_kwargs": {"truncation": True}},
            pip_requirements=[f"transformers=={transformers.__version__}", "torch"])
    tracker.set_tags(run_id, {"mlm.model_uri": info.model_uri})
    return info.model_uri


def logged_model_uri(tracker: MlflowTracker, run_id: str, step: int) -> str | None:
    """The `models:/m-...` URI of the model `log_model` logged for run `run_id` at `step`
    and completed (READY), or None: finishing a run whose registration failed reuses it
    rather than logging the model twice."""
    run = tracker.get_run(run_id)
    models = tracker.client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    ready = [m for m in models if m.name == "model" and m.tags.get(_STEP_TAG) == str(step)
             and str(m.status) == "READY"]
    if not ready:
        return None
    uri = f"models:/{max(ready, key=lambda m: m.creation_timestamp).model_id}"
    tracker.set_tags(run_id, {"mlm.model_uri": uri})
    return uri


def _version_record(version) -> dict[str, Any]:
    tags = version.tags
    return {"version": int(version.version), "run_id": version.run_id,
            "eval_loss": float(tags["eval_loss"]) if "eval_loss" in tags else None,
            "eval_data": tags.get("eval_data"), "shards": tags.get("digest.shards"),
            "tokenizer": tags.get("digest.tokenizer"), **version_holdout(tags)}


def champion(tracker: MlflowTracker, name: str) -> dict[str, Any] | None:
    """The version holding `champion` (version, run id, eval loss, eval data digest,
    shards digest, tokenizer digest when recorded), or None when no version has it."""
    from mlflow.exceptions import MlflowException

    try:
        return _version_record(tracker.client.get_model_version_by_alias(name, CHAMPION))
    except MlflowException:
        return None


def champion_tokenizer_digest(tracker: MlflowTracker, champion: dict[str, Any]) -> str | None:
    """The tokenizer digest a champion version was trained with: its version tag
    `digest.tokenizer` (versions registered since the tag exists), else its run's tag
    `digest.tokenizer` (`records.data_tags`); None when neither records it."""
    if champion.get("tokenizer"):
        return champion["tokenizer"]
    from mlflow.exceptions import MlflowException

    try:
        return tracker.get_run(champion["run_id"]).data.tags.get("digest.tokenizer")
    except MlflowException:
        return None


def register_version(tracker: MlflowTracker, name: str, run_id: str, model_uri: str,
                     tags: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
    """Register `model_uri` as a new version of `name` (created when missing) with `tags`
    and the tag `champion_before`; returns (its version, the champion record before it).
    A version `run_id` registered from `model_uri` before (an attempt that stopped before
    the aliases moved) is reused: no second version, and the champion is the one it was
    registered under (its tag `champion_before`)."""
    if (version := _registered(tracker, name, run_id, model_uri)) is not None:
        logger.info("registry %s: version %s of run %s exists: not registered again, "
                    "its aliases are set", name, version.version, run_id)
        return int(version.version), _champion_before(tracker, version)
    before = champion(tracker, name)
    with _tracking_uri(tracker.tracking_uri):
        import mlflow

        version = mlflow.register_model(model_uri, name, tags={
            **tags, _BEFORE_TAG: str(before["version"]) if before else "none"})
    return int(version.version), before


def apply_decision(tracker: MlflowTracker, run_id: str, result: dict[str, Any]) -> None:
    """Write a decision (`app.decide.Decision.record()`): the aliases (`challenger`
    always, `champion` on `first` or `promoted`), the version's tags (`decision`,
    `compared_*`), the run's tags (`registry.*`) and metrics (`registry/*`)."""
    name, new, before = result["name"], str(result["version"]), result["champion_before"]
    client = tracker.client
    if result["bits_per_char"] is not None:
        _version_tags(client, name, new, {
            "compared_metric": BPC_METRIC, "compared_eval_data": result["compared_on"],
            "compared_bits_per_char": repr(result["bits_per_char"]),
            "compared_champion_version": str(before["version"]),
            "compared_champion_bits_per_char": repr(result["champion_bits_per_char"])})
    client.set_registered_model_alias(name, CHALLENGER, new)
    if result["decision"] in ("first", "promoted"):
        client.set_registered_model_alias(name, CHAMPION, new)
    client.set_model_version_tag(name, new, "decision", result["decision"])
    if result["champion_eval_loss"] is not None:
        _version_tags(client, name, new, {
            "compared_metric": METRIC, "compared_eval_data": result["eval_data"],
            "compared_eval_loss": repr(result["eval_loss"]),
            "compared_champion_version": str(before["version"]),
            "compared_champion_eval_loss": repr(result["champion_eval_loss"]),
            "compared_champion_rescored": str(result["champion_rescored"]).lower()})
    _record_on_run(tracker, run_id, result)
    if "holdout" in result:
        _record_holdout(tracker, name, new, run_id, result)
    logger.info("registry %s: %s: %s", name, result["decision"], result["reason"])


def _version_tags(client: Any, name: str, version: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)


def _registered(tracker: MlflowTracker, name: str, run_id: str, model_uri: str):
    """The newest version of `name` registered from `model_uri` by `run_id`, or None."""
    model_id = model_uri.removeprefix("models:/")
    versions = [v for v in tracker.client.search_model_versions(
        f"name = '{name}' and run_id = '{run_id}'")
        if getattr(v, "model_id", None) in (None, model_id)]
    return max(versions, key=lambda v: int(v.version), default=None)


def _champion_before(tracker: MlflowTracker, version) -> dict[str, Any] | None:
    """The champion when `version` was registered (its tag `champion_before`), or the
    current champion when the tag is missing and it is another version."""
    before = version.tags.get(_BEFORE_TAG)
    if before == "none":
        return None
    if before is not None:
        return _version_record(tracker.client.get_model_version(version.name, before))
    now = champion(tracker, version.name)
    return None if now is None or now["version"] == int(version.version) else now


def _record_on_run(tracker: MlflowTracker, run_id: str, result: dict[str, Any]) -> None:
    before = result["champion_before"]
    compared_on = result.get("compared_on")
    tracker.set_tags(run_id, {
        "registry.model_name": result["name"], "registry.version": str(result["version"]),
        "registry.decision": result["decision"], "registry.reason": result["reason"],
        "registry.champion_version": str(result["champion_version"]),
        "registry.eval_data": result["eval_data"], "registry.shards": result["shards"],
        "registry.metric": result.get("metric", METRIC),
        **({"registry.champion_before": str(before["version"]),
            "registry.champion_before_run_id": before["run_id"],
            "registry.champion_before_eval_data": before["eval_data"] or "unknown"}
           if before else {}),
        **({"registry.compared_eval_data": compared_on,
            "registry.champion_rescored": str(bool(result.get("champion_rescored"))).lower()}
           if compared_on else {}),
    })
    metrics = {"registry/eval_loss": result["eval_loss"]}
    theirs = result.get("champion_eval_loss")
    if theirs is None and before:  # not compared: the champion's own, on its own data
        theirs = before["eval_loss"]
    if theirs is not None:
        metrics["registry/champion_eval_loss"] = theirs
    if result.get("bits_per_char") is not None:
        metrics["registry/bits_per_char"] = result["bits_per_char"]
        metrics["registry/champion_bits_per_char"] = result["champion_bits_per_char"]
    log_missing_metrics(tracker, run_id, metrics, 0)


def promote(tracker: MlflowTracker, run_id: str, name: str | None = None) -> dict[str, Any]:
    """Force `champion` onto the registered version of `run_id`'s model (the newest one
    when the run registered several); the decision `forced` is recorded on the run.

    Raises:
        ValueError: the run registered no version (under `name`, when given), or
            versions under several names and `name` is None.
    """
    under = f" and name = '{name}'" if name else ""
    versions = tracker.client.search_model_versions(f"run_id = '{run_id}'{under}")
    names = sorted({v.name for v in versions})
    if not versions:
        raise ValueError(f"promote: run {run_id} registered no model version"
                         + (f" under {name!r}" if name else ""))
    if len(names) > 1:
        raise ValueError(f"promote: run {run_id} registered versions of {names}; name one")
    version = max(versions, key=lambda v: int(v.version))
    before = champion(tracker, version.name)
    tracker.client.set_registered_model_alias(version.name, CHAMPION, version.version)
    tracker.client.set_model_version_tag(version.name, version.version, "decision", "forced")
    record = _version_record(version)
    result = {"name": version.name, "version": record["version"], "decision": "forced",
              "reason": f"champion forced to version {version.version} by promote",
              "eval_loss": record["eval_loss"] if record["eval_loss"] is not None
              else float("nan"), "eval_data": record["eval_data"] or "unknown",
              "shards": record["shards"] or "unknown", "champion_before": before,
              "champion_version": record["version"]}
    _record_on_run(tracker, run_id, result)
    return result


def resolve_model_uri(tracker: MlflowTracker, source: str) -> str:
    """The model URI of an MLflow SOURCE: a `models:/...` URI as is, a run id's logged
    model (its `mlm.model_uri` tag).

    Raises:
        ValueError: SOURCE is neither, the tracking URI is a SQLite file that does not
            exist (it is not created), the run does not exist, or it logged no model.
    """
    db = sqlite_db_path(tracker.tracking_uri)
    if db is not None and not db.is_file():
        raise ValueError(f"{source!r}: no MLflow database at {db} (give --tracking-uri or "
                         "set MLFLOW_TRACKING_URI)")
    if source.startswith("models:/"):
        return source
    if not RUN_ID.fullmatch(source):
        raise ValueError(f"{source!r} is neither an MLflow run id (32 hex digits) nor a "
                         "models:/NAME@ALIAS URI")
    from mlflow.exceptions import MlflowException

    try:
        run = tracker.get_run(source)
    except MlflowException as exc:
        raise ValueError(f"MLflow run {source!r} not found at {tracker.tracking_uri}") from exc
    uri = run.data.tags.get("mlm.model_uri")
    if uri is None:
        raise ValueError(f"MLflow run {source} logged no model (tracking.log_model was off, "
                         "or the run did not finish)")
    return uri


def download_model(tracker: MlflowTracker, source: str, out_dir: str | Path,
                   overwrite: bool = False) -> Path:
    """Write the `transformers` model directory of an MLflow SOURCE (run id or
    `models:/NAME@ALIAS`, `models:/NAME/VERSION`, `models:/m-...`) to `out_dir`:
    weights, config, tokenizer files and the model card as `README.md`.

    Raises:
        ValueError: SOURCE is not an MLflow model (the message says what was expected).
        FileExistsError: `out_dir` exists, is not empty, and `overwrite` is false.
    """
    from mlflow.exceptions import MlflowException

    # A progress bar per download is noise on a terminal and in logs.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = resolve_model_uri(tracker, source)
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (choose a new directory, "
                              "or overwrite)")
    with tempfile.TemporaryDirectory(prefix="mlm-download-") as tmp, \
            _tracking_uri(tracker.tracking_uri):
        import mlflow

        try:
            got = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))
        except MlflowException as exc:
            raise ValueError(f"{source!r}: no such MLflow model at {tracker.tracking_uri} "
                             f"({str(exc).splitlines()[0]})") from exc
        if not (got / _MODEL_DIR / "config.json").is_file():
            raise ValueError(f"{source!r}: not a transformers model logged by mlm-pipeline")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(got / _MODEL_DIR, out)
        for f in (got / _TOKENIZER_DIR).iterdir():
            shutil.copy2(f, out / f.name)
        if (got / _CARD_TEXT).is_file():
            card_data = got / _CARD_DATA
            data = card_data.read_text(encoding="utf-8") if card_data.is_file() else ""
            front = f"---\n{data}---\n" if data.strip() else ""
            text = (got / _CARD_TEXT).read_text(encoding="utf-8")
            (out / "README.md").write_text(front + text, encoding="utf-8")
    return out


def version_holdout(tags: dict[str, str]) -> dict[str, Any]:
    """A version's holdout score from its tags: `holdout_digest`, `holdout_seed` and
    `holdout_bits_per_char` (None each when it was not scored on a holdout)."""
    score = tags.get(HOLDOUT_SCORE_TAG)
    return {"holdout_digest": tags.get(HOLDOUT_DIGEST_TAG),
            "holdout_seed": tags.get(HOLDOUT_SEED_TAG),
            "holdout_bits_per_char": float(score) if score is not None else None}


def holdout_version_tags(digest: str, seed: str, bits_per_char: float) -> dict[str, str]:
    """A new version's tags of its own holdout score (read back by `version_holdout`)."""
    return {HOLDOUT_DIGEST_TAG: digest, HOLDOUT_SEED_TAG: seed,
            HOLDOUT_SCORE_TAG: repr(float(bits_per_char))}


def _record_holdout(tracker: MlflowTracker, name: str, version: str, run_id: str,
                    result: dict[str, Any]) -> None:
    """Set `result["holdout"]` on the run and, when compared, on the model version."""
    held = result["holdout"]
    theirs, rescored = held["champion_bits_per_char"], str(held["champion_rescored"]).lower()
    tracker.set_tags(run_id, {"registry.holdout_digest": held["digest"],
                              "registry.champion_holdout_rescored": rescored})
    metrics = {"registry/holdout_bits_per_char": held["bits_per_char"]}
    if theirs is not None:
        metrics["registry/champion_holdout_bits_per_char"] = theirs
        _version_tags(tracker.client, name, version, {
            "compared_metric": HOLDOUT_METRIC, "compared_holdout_digest": held["digest"],
            "compared_bits_per_char": repr(float(held["bits_per_char"])),
            "compared_champion_version": str(result["champion_before"]["version"]),
            "compared_champion_bits_per_char": repr(float(theirs)),
            "compared_champion_rescored": rescored})
    log_missing_metrics(tracker, run_id, metrics, 0)


def holdout_run_tags(evaluated: EvalManifest) -> dict[str, str]:
    """The run's tag `digest.holdout` (the text its `holdout/*` metrics are on), or none."""
    held = evaluated.config.get("holdout")
    return {"digest.holdout": held["digest"]} if held else {}
