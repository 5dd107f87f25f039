"""The end of a run: its results recorded on the MLflow run, its model exported, logged,
registered and decided.

`publish` exports the final checkpoint as a `transformers` model directory, logs it as the
run's MLflow model, registers it and decides whether it takes `champion` (`app.decide`, the
champion scored on this run's data by `app.rescore`). Idempotent, for a run finished after a
failure: a model this run logged at this step is not logged again, nor a version registered
from it (only its aliases and tags are set).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlm_pipeline.app.decide import Challenger, Evidence, Holdout, decide
from mlm_pipeline.app.rescore import BpcComparison, ChampionRescorer, HoldoutRescorer
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (CorpusManifest, EvalManifest, ShardManifest,
                                   TokenizerManifest, TrainManifest)
from mlm_pipeline.tracking import records, registry
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)


def record_results(tracker: MlflowTracker, run_id: str, cfg: PipelineConfig,
                   trained: TrainManifest, evaluated: EvalManifest) -> None:
    """Log the final evaluation, its fill-mask rows, the manifests and the loss plot on the
    run (`tracking.records.record_results`)."""
    from mlm_pipeline.evaluate.probes import table_rows

    rows = table_rows(evaluated.probes, cfg.eval.probes, trained.steps)
    records.record_results(tracker, run_id, cfg, trained, evaluated, rows)


def challenger_of(name: str, version: int, evaluated: EvalManifest,
                  bpc: BpcComparison | None) -> Challenger:
    """The facts the decision reads of a new version of `name` evaluated as `evaluated`."""
    held = None
    if registry.HOLDOUT_METRIC in evaluated.metrics and evaluated.config.get("holdout"):
        held = Holdout(evaluated.config["holdout"]["digest"],
                       str(evaluated.config["eval"]["seed"]),
                       float(evaluated.metrics[registry.HOLDOUT_METRIC]))
    return Challenger(name, version, float(evaluated.metrics[registry.METRIC]),
                      registry.eval_data_digest(evaluated), evaluated.inputs["shards"],
                      evaluated.inputs.get("tokenizer"),
                      None if bpc is None else bpc.text_digest(), held)


def register_and_decide(tracker: MlflowTracker, name: str, run_id: str, model_uri: str,
                        challenger: Challenger, evidence: Evidence = Evidence()  # noqa: B008
                        ) -> dict[str, Any]:
    """Register `model_uri` as a version of `name`, decide, write the decision; returns
    `Decision.record()`.

    Args:
        tracker: the MLflow backend.
        name: the registered model.
        run_id: the run that logged the model; the decision is recorded on it.
        model_uri: the logged model (`models:/m-...`).
        challenger: the new version's facts; its `version` is set here.
        evidence: how to score the champion; its `champion_tokenizer`, when None, is read
            from the registry.
    """
    held = challenger.holdout
    version, before = registry.register_version(tracker, name, run_id, model_uri, {
        "eval_loss": repr(float(challenger.eval_loss)), "eval_data": challenger.eval_data,
        "digest.shards": challenger.shards,
        **({"digest.tokenizer": challenger.tokenizer} if challenger.tokenizer else {}),
        **(registry.holdout_version_tags(held.digest, held.seed, held.bits_per_char)
           if held is not None else {})})
    if before is not None and evidence.champion_tokenizer is None \
            and challenger.tokenizer is not None:
        evidence = Evidence(registry.champion_tokenizer_digest(tracker, before),
                            evidence.rescore, evidence.bits_per_char, evidence.holdout)
    challenger = replace(challenger, version=version)
    result = decide(challenger, before, evidence).record()
    registry.apply_decision(tracker, run_id, result)
    return result


def publish(tracker: MlflowTracker, run_id: str, name: str, trained: TrainManifest,
            evaluated: EvalManifest, tokenizer_dir: str | Path,
            input_example: str, shards: ShardManifest | None = None,
            corpus: CorpusManifest | None = None) -> dict[str, Any]:
    """Export the run's final checkpoint, log it as the run's model, register it and
    decide (`register_and_decide`). Returns the decision's record with `model_uri`.

    `shards` (whose validation rows a champion evaluated on other data is re-scored on) and
    `corpus` (whose validation documents score `eval/bits_per_char` against a champion with
    another tokenizer): None looks for them by digest in the work directory above the
    training run (`train.export.find_stage_manifest`); not found, that comparison is not made.

    Raises:
        ValueError: the model cannot be exported (see `train.export.export_checkpoint`).
        MissingDependencyError: `transformers` is not installed.
    """
    from mlm_pipeline.train.export import export_checkpoint, find_stage_manifest

    model_uri = registry.logged_model_uri(tracker, run_id, trained.steps)
    if model_uri is not None:
        logger.info("run %s logged its model already (%s): not logged again", run_id, model_uri)
    else:
        with tempfile.TemporaryDirectory(prefix="mlm-export-") as tmp:
            out = export_checkpoint(trained.file(trained.checkpoint_dir),
                                    Path(tmp) / "model", tokenizer=tokenizer_dir)
            model_uri = registry.log_model(tracker, run_id, out, trained.steps,
                                           input_example)
    if shards is None:
        shards = find_stage_manifest(Path(trained.output_dir), "shards",
                                     evaluated.inputs["shards"], ShardManifest)
    if corpus is None and shards is not None:
        corpus = find_stage_manifest(Path(trained.output_dir), "ingest",
                                     shards.inputs["corpus"], CorpusManifest)
    bpc = None if corpus is None else BpcComparison(
        tracker, trained, evaluated, corpus, tokenizer_dir)
    challenger = challenger_of(name, 0, evaluated, bpc)
    evidence = Evidence(
        rescore=None if shards is None else ChampionRescorer(
            tracker, trained, evaluated, shards, tokenizer_dir),
        bits_per_char=bpc,
        holdout=None if challenger.holdout is None else HoldoutRescorer(
            tracker, trained, evaluated))
    result = register_and_decide(tracker, name, run_id, model_uri, challenger, evidence)
    return {**result, "model_uri": model_uri}


def publish_model(cfg: PipelineConfig, run_id: str, trained: TrainManifest,
                  evaluated: EvalManifest, tokenizer: TokenizerManifest,
                  shards: ShardManifest | None = None) -> dict[str, Any] | None:
    """`publish` under the config's registered name (None when `tracking.log_model` is
    off), then the version's lineage tags and the eval metrics on the logged model
    (`tracking.version_lineage.record_lineage`, with `shards`)."""
    if not cfg.tracking.log_model:
        return None
    from mlm_pipeline.tracking.fetch import registered_model_name
    from mlm_pipeline.tracking.version_lineage import record_lineage

    tracker = MlflowTracker.from_config(cfg.tracking)
    registered = publish(tracker, run_id, registered_model_name(cfg), trained, evaluated,
                         tokenizer.output_dir,
                         next((p.text for p in cfg.eval.probes), "[MASK]."), shards)
    if shards is not None:
        record_lineage(tracker, registered, trained, evaluated, shards, tokenizer.digest)
    return registered
