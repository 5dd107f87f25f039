"""The registry's decision: does a new model version take `champion`? Pure: no MLflow.

The first comparator of `COMPARATORS` that applies decides, in order: `first` (no
champion yet), `on_holdout` (the new version has a `holdout/bits_per_char`: the champion's
on the same text), `on_same_data` (the same `eval_data` digest: the two `eval/loss`),
`in_bits_per_char` (another tokenizer: losses are per piece of other vocabularies, so both
are scored in `eval/bits_per_char` on the new version's validation text), `rescored` (the
champion re-scored on the new version's evaluation data: same rows, masks and precision).

Lower wins (`promoted`), else `kept`; when the champion cannot be scored the versions are
`not_compared` and the reason says why. The scorers are objects the caller gives
(`mlm_pipeline.app.rescore`); their `RescoreUnavailable` becomes a reason here.
`tracking.registry.apply_decision` writes the decision (aliases, tags, run metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from mlm_pipeline.errors import OtherTokenizer, RescoreUnavailable

logger = logging.getLogger(__name__)

#: The metric the registry decides on (lower is better).
METRIC = "eval/loss"
#: The metric when the tokenizers differ (`evaluate.bpc.METRIC`; lower is better).
BPC_METRIC = "eval/bits_per_char"
#: The metric of a holdout decision (`evaluate.bpc.HOLDOUT_METRIC`).
HOLDOUT_METRIC = "holdout/bits_per_char"


@dataclass(frozen=True)
class Holdout:
    """A version's score on a holdout text: its digest, the word-choice seed (a tag
    value) and `holdout/bits_per_char`."""

    digest: str
    seed: str
    bits_per_char: float


@dataclass(frozen=True)
class Challenger:
    """What the new version brings to the decision.

    Attributes:
        name: the registered model's name.
        version: its registered version number.
        eval_loss: its held-out `eval/loss` (token-weighted mean, nats).
        eval_data: what that loss was measured on (`tracking.registry.eval_data_digest`).
        shards: the digest of its validation shards (shown to users).
        tokenizer: the digest of its tokenizer (None: unknown, never re-scored).
        bpc_text: the digest of the text `Evidence.bits_per_char` scores (None: unknown).
        holdout: its holdout score (None: not scored on a holdout).
    """

    name: str
    version: int
    eval_loss: float
    eval_data: str
    shards: str
    tokenizer: str | None = None
    bpc_text: str | None = None
    holdout: Holdout | None = None


class ChampionScorer(Protocol):
    """Scores the champion (its version record) on the new version's data; raises
    `RescoreUnavailable` (or `OtherTokenizer`) when it cannot."""

    def __call__(self, champion: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Evidence:
    """How the champion can be scored on the new version's data (None: it cannot).

    Attributes:
        champion_tokenizer: the champion's tokenizer digest (its version or run tag;
            None when unrecorded).
        rescore: its `eval/loss` on the new version's evaluation data (a float).
        bits_per_char: (the new version's, the champion's) `eval/bits_per_char` on the new
            version's validation text.
        holdout: the champion's `holdout/bits_per_char` on the new version's holdout text.
    """

    champion_tokenizer: str | None = None
    rescore: ChampionScorer | None = None
    bits_per_char: ChampionScorer | None = None
    holdout: ChampionScorer | None = None


@dataclass(frozen=True)
class Decision:
    """The outcome for one new version.

    Attributes:
        challenger: the new version's facts.
        champion: the champion's version record before the decision (None: there was none).
        decision: `first`, `promoted`, `kept` or `not_compared`.
        reason: one sentence naming the metric and the data.
        metric: the metric that decided (`eval/loss`, `eval/bits_per_char` or
            `holdout/bits_per_char`).
        champion_eval_loss: the champion's `eval/loss` on `challenger.eval_data` (its own
            or re-scored); None when losses were not compared.
        champion_rescored: whether that loss was re-scored.
        bits_per_char: (new, champion) `eval/bits_per_char` when that metric decided.
        holdout: the holdout record (`metric`, `digest`, `bits_per_char`,
            `champion_bits_per_char`, `champion_rescored`) when the holdout decided.
    """

    challenger: Challenger
    champion: dict[str, Any] | None
    decision: str
    reason: str
    metric: str = METRIC
    champion_eval_loss: float | None = None
    champion_rescored: bool = False
    bits_per_char: tuple[float, float] | None = None
    holdout: dict[str, Any] | None = None

    @property
    def promotes(self) -> bool:
        """True when the new version takes `champion`."""
        return self.decision in ("first", "promoted")

    @property
    def compared_on(self) -> str | None:
        """The digest of the data both scores were computed on; None when not compared."""
        if self.holdout is not None:
            return (self.holdout["digest"]
                    if self.holdout["champion_bits_per_char"] is not None else None)
        if self.champion_eval_loss is not None:
            return self.challenger.eval_data
        if self.bits_per_char is not None:
            return self.challenger.bpc_text or "unknown"
        return None

    def record(self) -> dict[str, Any]:
        """The decision as the run summary and the callers read it (`champion_version`: the
        one after; `holdout` only when the holdout decided)."""
        c, before = self.challenger, self.champion
        result = {
            "name": c.name, "version": c.version, "decision": self.decision,
            "reason": self.reason, "metric": self.metric, "eval_loss": float(c.eval_loss),
            "eval_data": c.eval_data,
            "bits_per_char": self.bits_per_char[0] if self.bits_per_char else None,
            "champion_bits_per_char": self.bits_per_char[1] if self.bits_per_char else None,
            "shards": c.shards, "champion_before": before,
            "champion_eval_loss": self.champion_eval_loss,
            "champion_rescored": self.champion_rescored, "compared_on": self.compared_on,
            "champion_version": c.version if self.promotes else before["version"]}
        if self.holdout is not None:
            result["holdout"] = self.holdout
        return result


@dataclass(frozen=True)
class Case:
    """What a comparator reads: the new version, the champion and how to score it.

    Attributes:
        challenger: the new version's facts.
        champion: the champion's version record (None: no champion).
        evidence: the champion's scorers.
        other_tokenizer: the champion's tokenizer digest when it differs from the new
            version's (None: the same, or unknown).
    """

    challenger: Challenger
    champion: dict[str, Any] | None
    evidence: Evidence
    other_tokenizer: str | None = None

    def decided(self, decision: str, reason: str, **fields: Any) -> Decision:
        """A `Decision` of this case."""
        return Decision(self.challenger, self.champion, decision, reason, **fields)

    def lower_wins(self, ours: float, theirs: float, data: str, metric: str = METRIC,
                   **fields: Any) -> Decision:
        """`promoted` when `ours` < the champion's `theirs` (both `metric`, lower is
        better, computed on the data `data` describes), else `kept`."""
        new, old = self.challenger.version, self.champion["version"]
        if ours < theirs:
            return self.decided("promoted", f"{metric} {ours:.4f} < champion version {old}'s "
                                f"{theirs:.4f} {data}: version {new} is champion",
                                metric=metric, **fields)
        return self.decided("kept", f"{metric} {ours:.4f} >= champion version {old}'s "
                            f"{theirs:.4f} {data}: champion stays", metric=metric, **fields)

    def not_compared(self, why: str, **fields: Any) -> Decision:
        """`not_compared`: the champion was evaluated on other data and `why` (the end
        of the sentence) it could not be scored on the new version's."""
        c, before = self.challenger, self.champion
        return self.decided("not_compared", (
            f"not compared: version {c.version} was evaluated on other data than champion "
            f"version {before['version']} (shards {c.shards[:12]} vs "
            f"{(before['shards'] or 'unknown')[:12]}, eval data {c.eval_data[:12]} vs "
            f"{(before['eval_data'] or 'unknown')[:12]}) and {why}; champion stays"), **fields)


Comparator = Callable[[Case], Decision | None]


def first(case: Case) -> Decision | None:
    """No champion yet: the new version is the first."""
    if case.champion is not None:
        return None
    c = case.challenger
    return case.decided("first", f"version {c.version} is the first champion of {c.name!r}")


def on_holdout(case: Case) -> Decision | None:
    """The new version has a holdout score: the champion's on the same text decides (its
    own when scored on the same digest and seed, else re-scored)."""
    held, before = case.challenger.holdout, case.champion
    if held is None:
        return None
    record = {"metric": HOLDOUT_METRIC, "digest": held.digest,
              "bits_per_char": held.bits_per_char, "champion_bits_per_char": None,
              "champion_rescored": False}
    own = before.get("holdout_bits_per_char")
    if (before.get("holdout_digest") == held.digest and before.get("holdout_seed") == held.seed
            and own is not None):
        theirs, rescored = float(own), False
    else:
        try:
            if case.evidence.holdout is None:
                raise RescoreUnavailable("no holdout scorer was given")
            theirs, rescored = float(case.evidence.holdout(before)), True
        except RescoreUnavailable as exc:
            logger.warning("registry: champion version %s not scored on holdout %s: %s",
                           before["version"], held.digest[:12], exc)
            return case.decided("not_compared", (
                f"not compared: champion version {before['version']} could not be scored "
                f"in {HOLDOUT_METRIC} on holdout {held.digest[:12]} ({exc}); champion "
                "stays"), metric=HOLDOUT_METRIC, holdout=record)
    record.update(champion_bits_per_char=theirs, champion_rescored=rescored)
    where = f"on holdout {held.digest[:12]} " + (
        f"(the champion re-scored on it; its own score was on "
        f"{(before.get('holdout_digest') or 'none')[:12]})" if rescored
        else "(the champion's own score on it)")
    return case.lower_wins(held.bits_per_char, theirs, where, HOLDOUT_METRIC, holdout=record)


def on_same_data(case: Case) -> Decision | None:
    """The champion was evaluated on the same data: the two losses decide."""
    c, before = case.challenger, case.champion
    if before["eval_data"] != c.eval_data or before["eval_loss"] is None:
        return None
    return case.lower_wins(c.eval_loss, before["eval_loss"], "on the same data",
                           champion_eval_loss=float(before["eval_loss"]))


def in_bits_per_char(case: Case) -> Decision | None:
    """The champion has another tokenizer: bits per character on the new version's
    validation text decide."""
    other = case.other_tokenizer
    if other is None:
        return None
    c = case.challenger
    head = (f"with another tokenizer (digest {(c.tokenizer or 'unknown')[:12]} vs "
            f"{other[:12]})")
    if case.evidence.bits_per_char is None:
        return case.not_compared(f"{head}: {METRIC} is per piece of another vocabulary, and "
                                 f"its validation text was not found for {BPC_METRIC}")
    try:
        ours, theirs = case.evidence.bits_per_char(case.champion)
    except RescoreUnavailable as exc:
        logger.warning("registry: champion version %s not scored in %s: %s",
                       case.champion["version"], BPC_METRIC, exc)
        return case.not_compared(f"{head}: {BPC_METRIC} could not be computed ({exc})")
    scores = (float(ours), float(theirs))
    return case.lower_wins(*scores, (
        f"on this version's validation text {(c.bpc_text or 'unknown')[:12]} (another "
        f"tokenizer: digest {(c.tokenizer or 'unknown')[:12]} vs {other[:12]})"),
        BPC_METRIC, bits_per_char=scores)


def rescored(case: Case) -> Decision:
    """The champion re-scored on the new version's evaluation data decides; a checkpoint
    that reveals another tokenizer hands over to `in_bits_per_char`."""
    c, before = case.challenger, case.champion
    if c.tokenizer is None or case.evidence.rescore is None:
        return case.not_compared("the champion was not re-scored on its data (its tokenizer "
                                 "digest or shards were not given)")
    try:
        theirs = float(case.evidence.rescore(before))
    except OtherTokenizer as exc:
        return in_bits_per_char(replace(case, other_tokenizer=exc.digest))
    except RescoreUnavailable as exc:
        logger.warning("registry: champion version %s not re-scored: %s", before["version"],
                       exc)
        return case.not_compared(f"the champion could not be re-scored on its data ({exc})")
    own = "unknown" if before["eval_loss"] is None else f"{before['eval_loss']:.4f}"
    return case.lower_wins(c.eval_loss, theirs, (
        f"re-scored on this version's eval data {c.eval_data[:12]} (its own {own} was on "
        f"{(before['eval_data'] or 'unknown')[:12]})"),
        champion_eval_loss=theirs, champion_rescored=True)


#: The comparators, in order; the last always decides.
COMPARATORS: tuple[Comparator, ...] = (first, on_holdout, on_same_data, in_bits_per_char,
                                       rescored)


def decide(challenger: Challenger, champion: dict[str, Any] | None,
           evidence: Evidence = Evidence()) -> Decision:  # noqa: B008 - frozen, empty
    """The decision for `challenger` against `champion` (the module docstring): the first
    comparator of `COMPARATORS` that applies.

    Args:
        challenger: the new version's facts.
        champion: the champion's version record (`tracking.registry.champion`: `version`,
            `run_id`, `eval_loss`, `eval_data`, `shards`, `tokenizer`, `holdout_*`); None
            when there is none.
        evidence: how to score the champion on the new version's data.
    """
    theirs = evidence.champion_tokenizer
    other = (theirs if challenger.tokenizer is not None and theirs is not None
             and theirs != challenger.tokenizer else None)
    case = Case(challenger, champion, evidence, other)
    return next(d for comparator in COMPARATORS if (d := comparator(case)) is not None)
