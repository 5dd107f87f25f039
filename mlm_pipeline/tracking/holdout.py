"""The registry's decision on the fixed holdout text (`eval.holdout_sources`).

When a run was scored on a holdout text (`evaluate.holdout`: the metric
`holdout/bits_per_char` in its evaluation, the text and its digest beside it), the
registry decides on that metric instead of the validation data, which moves with the
corpus (`tracking.registry.decide`):

- the new version carries its score as version tags (`holdout.digest`, `holdout.seed`,
  `holdout.bits_per_char`);
- the champion's score on the same text: its own tag when it was scored on the same
  digest with the same word choice (`eval.seed`); otherwise (another holdout digest,
  another seed, no holdout score) it is re-scored: its checkpoint and its own tokenizer
  (`rescore.load_champion`) on this run's holdout text (`holdout.json` of the evaluation,
  checked against its digest), with this run's seed, cap and device. A stale tag is
  never compared;
- lower wins; the decision's reason, the run's tags (`registry.metric`,
  `registry.holdout_digest`) and metrics (`registry/holdout_bits_per_char`,
  `registry/champion_holdout_bits_per_char`) and the version's tags (`compared_*`) name
  the metric, both scores and the digest. When the champion cannot be scored, the
  versions are not compared and the reason says why.

mlflow and torch are imported inside the functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mlm_pipeline.manifest import EvalManifest, TrainManifest
from mlm_pipeline.tracking.rescore import RescoreUnavailable, load_champion
from mlm_pipeline.tracking.resume import log_missing_metrics
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)

#: The metric (`evaluate.holdout.METRIC`; the same string, so that no torch is imported).
METRIC = "holdout/bits_per_char"
#: Model-version tags of a version's own holdout score.
DIGEST_TAG, SEED_TAG, SCORE_TAG = "holdout.digest", "holdout.seed", "holdout.bits_per_char"


def version_holdout(tags: dict[str, str]) -> dict[str, Any]:
    """A version's holdout score from its tags: `holdout_digest`, `holdout_seed` and
    `holdout_bits_per_char` (None each when it was not scored on a holdout)."""
    score = tags.get(SCORE_TAG)
    return {"holdout_digest": tags.get(DIGEST_TAG), "holdout_seed": tags.get(SEED_TAG),
            "holdout_bits_per_char": float(score) if score is not None else None}


@dataclass(frozen=True)
class HoldoutScores:
    """This run's holdout score, and the champion's on the same text (module docstring).

    Attributes:
        tracker: the MLflow backend the champion's run is read from.
        trained: this run's training manifest (its device).
        evaluated: this run's evaluation, scored on a holdout (`of` checks it).
    """

    tracker: MlflowTracker
    trained: TrainManifest
    evaluated: EvalManifest

    @classmethod
    def of(cls, tracker: MlflowTracker, trained: TrainManifest,
           evaluated: EvalManifest) -> HoldoutScores | None:
        """The scores of a run evaluated on a holdout; None when it was not."""
        if METRIC not in evaluated.metrics or not evaluated.config.get("holdout"):
            return None
        return cls(tracker, trained, evaluated)

    @property
    def digest(self) -> str:
        """The holdout text's digest (`ingest.holdout`)."""
        return self.evaluated.config["holdout"]["digest"]

    @property
    def seed(self) -> str:
        """The seed of the word choice (`eval.seed`), as a tag value."""
        return str(self.evaluated.config["eval"]["seed"])

    @property
    def ours(self) -> float:
        """This run's `holdout/bits_per_char`."""
        return float(self.evaluated.metrics[METRIC])

    def version_tags(self) -> dict[str, str]:
        """The new version's tags: its digest, seed and score."""
        return {DIGEST_TAG: self.digest, SEED_TAG: self.seed, SCORE_TAG: repr(self.ours)}

    def champion_score(self, champion: dict[str, Any]) -> tuple[float, bool]:
        """(the champion's `holdout/bits_per_char` on this text, whether it was re-scored):
        its tag when scored on the same digest and seed, else re-scored.

        Raises:
            RescoreUnavailable: it must be re-scored and its checkpoint, its tokenizer or
                this run's holdout text cannot be found, or its model cannot score it.
        """
        if (champion.get("holdout_digest") == self.digest and champion.get("holdout_seed")
                == self.seed and champion.get("holdout_bits_per_char") is not None):
            return float(champion["holdout_bits_per_char"]), False
        return self._rescore(champion), True

    def _rescore(self, champion: dict[str, Any]) -> float:
        from mlm_pipeline.config import EvalConfig
        from mlm_pipeline.evaluate.holdout import holdout_metrics, read_holdout_text

        cfg = EvalConfig.model_validate(self.evaluated.config["eval"])
        try:
            documents = read_holdout_text(self.evaluated.output_dir, self.digest)
        except (OSError, ValueError, KeyError) as exc:
            raise RescoreUnavailable(f"this run's holdout text: {exc}") from exc
        model, tok = load_champion(self.tracker, champion, self.trained.device)
        try:
            theirs = holdout_metrics(model, tok, documents, cfg, self.trained.device)[METRIC]
        except ValueError as exc:
            raise RescoreUnavailable(f"{METRIC}: {exc}") from exc
        logger.info("registry: champion version %s re-scored on holdout %s: %s %.4f (its "
                    "own tag: %s on %s)", champion["version"], self.digest[:12], METRIC,
                    theirs, champion.get("holdout_bits_per_char"),
                    (champion.get("holdout_digest") or "none")[:12])
        return float(theirs)

    def decide(self, new: int, before: dict[str, Any]) -> dict[str, Any]:
        """The comparison of version `new` with the champion `before` on the holdout:
        `decision` (`promoted`, `kept` or `not_compared`), `reason`, and the record
        `holdout` (`metric`, `digest`, `bits_per_char`, `champion_bits_per_char`, None
        when not compared, `champion_rescored`)."""
        record = {"metric": METRIC, "digest": self.digest, "bits_per_char": self.ours,
                  "champion_bits_per_char": None, "champion_rescored": False}
        try:
            theirs, rescored = self.champion_score(before)
        except RescoreUnavailable as exc:
            logger.warning("registry: champion version %s not scored on holdout %s: %s",
                           before["version"], self.digest[:12], exc)
            return {"decision": "not_compared", "holdout": record, "reason": (
                f"not compared: champion version {before['version']} could not be scored "
                f"in {METRIC} on holdout {self.digest[:12]} ({exc}); champion stays")}
        record.update(champion_bits_per_char=theirs, champion_rescored=rescored)
        where = f"on holdout {self.digest[:12]} " + (
            f"(the champion re-scored on it; its own score was on "
            f"{(before.get('holdout_digest') or 'none')[:12]})" if rescored
            else "(the champion's own score on it)")
        sign, verdict, decision = ((" <", f"version {new} is champion", "promoted")
                                   if self.ours < theirs else
                                   (" >=", "champion stays", "kept"))
        return {"decision": decision, "holdout": record, "reason": (
            f"{METRIC} {self.ours:.4f}{sign} champion version {before['version']}'s "
            f"{theirs:.4f} {where}: {verdict}")}


def record_holdout_decision(tracker: MlflowTracker, name: str, version: int, run_id: str,
                            result: dict[str, Any]) -> None:
    """Set the holdout comparison of `result` (`decide`'s, with `holdout`) on the run
    (tags `registry.holdout_digest`, `registry.champion_holdout_rescored`; metrics
    `registry/holdout_bits_per_char`, `registry/champion_holdout_bits_per_char`) and, when
    compared, on the model version (`compared_*` tags)."""
    held = result["holdout"]
    theirs = held["champion_bits_per_char"]
    tracker.set_tags(run_id, {"registry.holdout_digest": held["digest"],
                              "registry.champion_holdout_rescored":
                              str(held["champion_rescored"]).lower()})
    metrics = {"registry/holdout_bits_per_char": held["bits_per_char"]}
    if theirs is not None:
        metrics["registry/champion_holdout_bits_per_char"] = theirs
        before = result["champion_before"]
        for key, value in {"compared_metric": METRIC, "compared_holdout_digest": held["digest"],
                           "compared_bits_per_char": repr(float(held["bits_per_char"])),
                           "compared_champion_version": str(before["version"]),
                           "compared_champion_bits_per_char": repr(float(theirs)),
                           "compared_champion_rescored":
                           str(held["champion_rescored"]).lower()}.items():
            tracker.client.set_model_version_tag(name, str(version), key, value)
    log_missing_metrics(tracker, run_id, metrics, 0)


def holdout_run_tags(evaluated: EvalManifest) -> dict[str, str]:
    """The run's tag `digest.holdout` (the text its `holdout/*` metrics are on), or none."""
    held = evaluated.config.get("holdout")
    return {"digest.holdout": held["digest"]} if held else {}
