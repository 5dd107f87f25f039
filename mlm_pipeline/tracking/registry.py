"""The run's MLflow model and the model registry's champion and challenger.

At the end of a successful run `publish` exports the final checkpoint as a `transformers`
model directory (`train.export`), logs it as the run's MLflow model (the `transformers`
flavor, task `fill-mask`, with a signature, an input example and `step` = the final step),
registers it under `tracking.registered_model_name` (default: the experiment name) and
decides the aliases (`decide`):

- every new version gets the alias `challenger`;
- `champion` moves to it only if its held-out `eval/loss` is lower than the champion's on
  the same data (`eval_data_digest`: the validation shards digest, the evaluation seed and
  row cap, and the masking rates that place the masks). When the champion was evaluated
  on other data (a grown corpus) with the same tokenizer, it is re-scored on the new
  version's evaluation data first (`tracking.rescore`: its checkpoint evaluated on the
  same rows with the same masks and precision), and the two losses on that data decide.
  With another tokenizer the losses are per piece of other vocabularies: both models
  are then scored in `eval/bits_per_char` on the new version's validation text
  (`evaluate.bpc`, through `tracking.rescore.BpcComparison`), and those two decide. When
  the champion's checkpoint cannot be found (or the text or shards are not given), the
  versions are not compared; the decision says why;
- with a holdout text (`eval.holdout_sources`: the run has `holdout/bits_per_char`), the
  decision is made on it instead, the champion scored on the same text (its own score
  when on the same digest and seed, else re-scored; `tracking.holdout`);
- `promote` forces `champion` onto a run's version (`mlm-pipeline promote RUN_ID`).

The decision, the metric, both losses and the eval data digest they were computed on are
set on the run (tags `registry.*`, metrics `registry/eval_loss` and
`registry/champion_eval_loss`) and on the model version (tags `decision`, `compared_*`),
and returned for the run summary.

`download_model` turns an MLflow run id or a `models:/...` URI back into a local
`transformers` model directory (for `mlm-pipeline export` and `fill-mask`).

mlflow, torch and transformers are imported inside the functions.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlm_pipeline.errors import MissingDependencyError
from mlm_pipeline.manifest import CorpusManifest, EvalManifest, ShardManifest, TrainManifest
from mlm_pipeline.tracking.holdout import (
    HoldoutScores,
    record_holdout_decision,
    version_holdout,
)
from mlm_pipeline.tracking.rescore import (
    BPC_METRIC,
    METRIC,
    BpcComparison,
    ChampionRescorer,
    OtherTokenizer,
    bpc_scores,
    rescored_loss,
)
from mlm_pipeline.tracking.resume import log_missing_metrics
from mlm_pipeline.tracking.tracker import MlflowTracker, sqlite_db_path

logger = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
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
    """MLflow's fluent model API (`log_model`, `register_model`, `download_artifacts`)
    reads the process-wide tracking URI: use `uri` for the block, then restore the previous
    setting. A URI set before (`set_tracking_uri` or $MLFLOW_TRACKING_URI) is set again; an
    unset one is unset again with `set_tracking_uri(None)` (what MLflow's own private helper
    does; `get_tracking_uri()` would pin the default, `sqlite:///<cwd>/mlflow.db`, for the
    rest of the process), and $MLFLOW_TRACKING_URI, which this process's later trackers
    read, keeps its value. Checked by tests/flows/test_prefect_private.py."""
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
            model_id=logged.model_id,
            input_example=[input_example], step=step,
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


def decide(tracker: MlflowTracker, name: str, run_id: str, model_uri: str,
           eval_loss: float, eval_data: str, shards_digest: str,
           tokenizer_digest: str | None = None,
           rescore: Callable[[dict[str, Any]], float] | None = None,
           bpc: Callable[[dict[str, Any]], tuple[float, float]] | None = None,
           bpc_text: str | None = None,
           holdout: HoldoutScores | None = None) -> dict[str, Any]:
    """Register `model_uri` as a new version of `name`, give it `challenger`, and move
    `champion` to it when it is better on the same data (see the module docstring). A
    version `run_id` registered from `model_uri` before (an attempt that stopped before
    the aliases moved) is reused: no second version, the decision is made against the
    champion it was registered under (its tag `champion_before`).

    Args:
        tracker: the MLflow backend.
        name: registered model name (created when missing).
        run_id: the run that logged the model; the decision is recorded on it.
        model_uri: the logged model (`models:/m-...`).
        eval_loss: its held-out `eval/loss` (token-weighted mean, nats).
        eval_data: `eval_data_digest` of that evaluation.
        shards_digest: the shards digest of the validation data (shown to users).
        tokenizer_digest: the digest of its tokenizer (None: unknown, the champion is
            never re-scored).
        rescore: the champion's `eval/loss` on this version's evaluation data, given the
            champion's record (`tracking.rescore.ChampionRescorer`), called when the
            champion was evaluated on other data with the same tokenizer; it raises
            `RescoreUnavailable` when it cannot (None: never re-scored).
        bpc: (this version's, the champion's) `eval/bits_per_char` on this version's
            validation text, given the champion's record
            (`tracking.rescore.BpcComparison`), called when the champion was trained
            with another tokenizer; it raises `RescoreUnavailable` when it cannot (None:
            such versions are not compared).
        bpc_text: a digest of that text (`BpcComparison.text_digest`), recorded as
            what the two scores were computed on.
        holdout: this version's `holdout/bits_per_char` (`tracking.holdout`); given, the
            decision is made on it, the champion scored on the same holdout text, and
            the result's `holdout` records both scores and the digest.

    Returns:
        `name`, `version`, `decision` (`first`: no champion before; `promoted`: lower
        `eval/loss` on the same data, or lower `eval/bits_per_char` on the same text
        with another tokenizer; `kept`: not lower; `not_compared`: the champion
        was evaluated on other data and could not be re-scored on this version's),
        `reason` (a sentence naming the metric), `metric` (`eval/loss`, or
        `eval/bits_per_char` when the tokenizers differ and both were scored),
        `bits_per_char` and `champion_bits_per_char` (None unless that metric decided),
        `eval_loss`,
        `eval_data`, `shards`, `champion_eval_loss` (the champion's loss on `eval_data`,
        re-scored or its own; None when not compared), `champion_rescored`,
        `compared_on` (the eval data digest both losses were computed on; None when not
        compared), `champion_before` (the previous champion's record, or None),
        `champion_version` (after) and, when the holdout decided, `holdout`
        (`HoldoutScores.decide`'s record: metric, digest, both scores, re-scored or not;
        `compared_on` is then the holdout digest).
    """
    version = _registered(tracker, name, run_id, model_uri)
    if version is None:
        before = champion(tracker, name)
        with _tracking_uri(tracker.tracking_uri):
            import mlflow

            version = mlflow.register_model(model_uri, name, tags={
                "eval_loss": repr(float(eval_loss)), "eval_data": eval_data,
                "digest.shards": shards_digest,
                **({"digest.tokenizer": tokenizer_digest} if tokenizer_digest else {}),
                **(holdout.version_tags() if holdout is not None else {}),
                _BEFORE_TAG: str(before["version"]) if before else "none"})
    else:  # registered by an attempt that stopped before the aliases moved
        before = _champion_before(tracker, version)
        logger.info("registry %s: version %s of run %s exists: not registered again, "
                    "its aliases are set", name, version.version, run_id)
    new = int(version.version)
    theirs, rescored, metric, bpcs, held = None, False, METRIC, None, None
    if before is None:
        decision, reason = "first", f"version {new} is the first champion of {name!r}"
    elif holdout is not None:  # the fixed benchmark text decides (tracking.holdout)
        held = holdout.decide(new, before)
        metric, decision, reason = held["holdout"]["metric"], held["decision"], held["reason"]
    elif before["eval_data"] == eval_data and before["eval_loss"] is not None:
        theirs = before["eval_loss"]
        decision, reason = _compare(new, before, eval_loss, theirs, "on the same data")
    else:
        theirs, why = rescored_loss(tracker, before, tokenizer_digest, rescore)
        other = why.digest if isinstance(why, OtherTokenizer) else "unknown"
        if isinstance(why, OtherTokenizer):
            bpcs, why = bpc_scores(before, tokenizer_digest, why, bpc)
        if bpcs is not None:
            metric = BPC_METRIC
            decision, reason = _compare(
                new, before, *bpcs, f"on this version's validation text "
                f"{(bpc_text or 'unknown')[:12]} (another tokenizer: digest "
                f"{(tokenizer_digest or 'unknown')[:12]} vs "
                f"{other[:12]})",
                BPC_METRIC)
        elif theirs is None:
            decision = "not_compared"
            reason = (f"not compared: version {new} was evaluated on other data than "
                      f"champion version {before['version']} (shards {shards_digest[:12]} "
                      f"vs {(before['shards'] or 'unknown')[:12]}, eval data "
                      f"{eval_data[:12]} vs {(before['eval_data'] or 'unknown')[:12]}) "
                      f"and {why}; champion stays")
        else:
            rescored = True
            own = ("unknown" if before["eval_loss"] is None
                   else f"{before['eval_loss']:.4f}")
            decision, reason = _compare(
                new, before, eval_loss, theirs,
                f"re-scored on this version's eval data {eval_data[:12]} (its own "
                f"{own} was on {(before['eval_data'] or 'unknown')[:12]})")
    compared = theirs is not None
    client = tracker.client
    if bpcs is not None:
        for key, value in {"compared_metric": BPC_METRIC,
                           "compared_eval_data": bpc_text or "unknown",
                           "compared_bits_per_char": repr(float(bpcs[0])),
                           "compared_champion_version": str(before["version"]),
                           "compared_champion_bits_per_char": repr(float(bpcs[1]))}.items():
            client.set_model_version_tag(name, str(new), key, value)
    client.set_registered_model_alias(name, CHALLENGER, str(new))
    if decision in ("first", "promoted"):
        client.set_registered_model_alias(name, CHAMPION, str(new))
    client.set_model_version_tag(name, str(new), "decision", decision)
    if compared:
        for key, value in {"compared_metric": METRIC, "compared_eval_data": eval_data,
                           "compared_eval_loss": repr(float(eval_loss)),
                           "compared_champion_version": str(before["version"]),
                           "compared_champion_eval_loss": repr(float(theirs)),
                           "compared_champion_rescored": str(rescored).lower()}.items():
            client.set_model_version_tag(name, str(new), key, value)
    result = {"name": name, "version": new, "decision": decision, "reason": reason,
              "metric": metric, "eval_loss": float(eval_loss), "eval_data": eval_data,
              "bits_per_char": bpcs[0] if bpcs else None,
              "champion_bits_per_char": bpcs[1] if bpcs else None,
              "shards": shards_digest, "champion_before": before,
              "champion_eval_loss": float(theirs) if compared else None,
              "champion_rescored": rescored, "compared_on": eval_data if compared
              else (bpc_text or "unknown") if bpcs else None,
              "champion_version": new if decision in ("first", "promoted")
              else before["version"]}
    if held is not None:
        h = held["holdout"]
        result.update(holdout=h, compared_on=h["digest"] if h["champion_bits_per_char"]
                      is not None else None)
    _record_on_run(tracker, run_id, result)
    if held is not None:
        record_holdout_decision(tracker, name, new, run_id, result)
    logger.info("registry %s: %s: %s", name, decision, reason)
    return result


def _compare(new: int, before: dict[str, Any], ours: float, theirs: float,
             data: str, metric: str = METRIC) -> tuple[str, str]:
    """(`promoted` or `kept`, the reason) for `metric` (lower is better) `ours` vs the
    champion's `theirs`, both computed on the data `data` describes."""
    if ours < theirs:
        return "promoted", (f"{metric} {ours:.4f} < champion version {before['version']}'s "
                            f"{theirs:.4f} {data}: version {new} is champion")
    return "kept", (f"{metric} {ours:.4f} >= champion version {before['version']}'s "
                    f"{theirs:.4f} {data}: champion stays")


def _registered(tracker: MlflowTracker, name: str, run_id: str, model_uri: str):
    """The version of `name` already registered from `model_uri` by run `run_id` (the
    newest), or None."""
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


def publish(tracker: MlflowTracker, run_id: str, name: str, trained: TrainManifest,
            evaluated: EvalManifest, tokenizer_dir: str | Path,
            input_example: str, shards: ShardManifest | None = None,
            corpus: CorpusManifest | None = None) -> dict[str, Any]:
    """Export the run's final checkpoint, log it as the run's model and register it
    (`log_model`, then `decide`, which re-scores a champion evaluated on other data with
    the same tokenizer on this run's validation rows: `tracking.rescore`). Returns
    `decide`'s record with `model_uri`.

    `shards` are the run's shards (its validation rows); None looks for them by digest
    in the work directory above the training run (`train.export.find_stage_manifest`):
    not found, a champion evaluated on other data is not compared. `corpus` is the run's
    corpus (its validation documents are the text of `eval/bits_per_char` when the
    champion has another tokenizer); None looks for it by the shards' corpus digest in
    the same way (the ingest stage's directory): not found, such a champion is not
    compared.

    Idempotent, for a run finished after a failure: a model this run logged at this step
    (`logged_model_uri`) is not logged again, and a version registered from it is not
    registered again (`decide` only sets its aliases and tags).

    Raises:
        ValueError: the model cannot be exported (see `train.export.export_checkpoint`).
        MissingDependencyError: `transformers` is not installed.
    """
    from mlm_pipeline.train.export import export_checkpoint, find_stage_manifest

    model_uri = logged_model_uri(tracker, run_id, trained.steps)
    if model_uri is not None:
        logger.info("run %s logged its model already (%s): not logged again", run_id,
                    model_uri)
    else:
        with tempfile.TemporaryDirectory(prefix="mlm-export-") as tmp:
            out = export_checkpoint(trained.file(trained.checkpoint_dir),
                                    Path(tmp) / "model", tokenizer=tokenizer_dir)
            model_uri = log_model(tracker, run_id, out, trained.steps, input_example)
    if shards is None:
        shards = find_stage_manifest(Path(trained.output_dir), "shards",
                                     evaluated.inputs["shards"], ShardManifest)
    rescore = None if shards is None else ChampionRescorer(
        tracker, trained, evaluated, shards, tokenizer_dir)
    if corpus is None and shards is not None:
        corpus = find_stage_manifest(Path(trained.output_dir), "ingest",
                                     shards.inputs["corpus"], CorpusManifest)
    bpc = None if corpus is None else BpcComparison(
        tracker, trained, evaluated, corpus, tokenizer_dir)
    result = decide(tracker, name, run_id, model_uri, evaluated.metrics[METRIC],
                    eval_data_digest(evaluated), evaluated.inputs["shards"],
                    evaluated.inputs.get("tokenizer"), rescore, bpc,
                    None if bpc is None else bpc.text_digest(),
                    HoldoutScores.of(tracker, trained, evaluated))
    return {**result, "model_uri": model_uri}


def promote(tracker: MlflowTracker, run_id: str, name: str | None = None) -> dict[str, Any]:
    """Force `champion` onto the registered version of `run_id`'s model (the newest one
    when the run registered several); the decision `forced` is recorded on the run.

    Raises:
        ValueError: the run registered no version (under `name`, when given), or
            versions under several names and `name` is None.
    """
    query = f"run_id = '{run_id}'" + (f" and name = '{name}'" if name else "")
    versions = tracker.client.search_model_versions(query)
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
            data = (got / _CARD_DATA).read_text(encoding="utf-8") if (
                got / _CARD_DATA).is_file() else ""
            front = f"---\n{data}---\n" if data.strip() else ""
            (out / "README.md").write_text(front + (got / _CARD_TEXT).read_text(
                encoding="utf-8"), encoding="utf-8")
    return out
