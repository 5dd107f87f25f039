"""The registry's decision (`app.decide`), comparator by comparator, without MLflow: each
test states the facts, the champion and the scorers, and the outcome a reader expects."""

from __future__ import annotations

import pytest

from mlm_pipeline.app.decide import (
    BPC_METRIC,
    COMPARATORS,
    HOLDOUT_METRIC,
    METRIC,
    Case,
    Challenger,
    Evidence,
    Holdout,
    decide,
    first,
    in_bits_per_char,
    on_holdout,
    on_same_data,
    rescored,
)
from mlm_pipeline.errors import OtherTokenizer, RescoreUnavailable

TOK, OTHER = "t" * 64, "o" * 64


def _new(**kw) -> Challenger:
    base = {"name": "m", "version": 2, "eval_loss": 3.0, "eval_data": "e" * 64,
            "shards": "s" * 64, "tokenizer": TOK, "bpc_text": "b" * 64}
    return Challenger(**{**base, **kw})


def _champion(**kw) -> dict:
    base = {"version": 1, "run_id": "r" * 32, "eval_loss": 4.0, "eval_data": "e" * 64,
            "shards": "s" * 64, "tokenizer": TOK, "holdout_digest": None,
            "holdout_seed": None, "holdout_bits_per_char": None}
    return {**base, **kw}


class Scorer:
    """A scorer returning `value` (or raising it), recording the champions it was asked."""

    def __init__(self, value):
        self.value, self.asked = value, []

    def __call__(self, champion):
        self.asked.append(champion["version"])
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_the_comparators_run_in_the_documented_order():
    assert COMPARATORS == (first, on_holdout, on_same_data, in_bits_per_char, rescored)


def test_first_applies_only_without_a_champion():
    d = first(Case(_new(), None, Evidence()))
    assert (d.decision, d.promotes, d.reason) == ("first", True,
                                                  "version 2 is the first champion of 'm'")
    assert d.record()["champion_version"] == 2 and d.compared_on is None
    assert first(Case(_new(), _champion(), Evidence())) is None


@pytest.mark.parametrize("ours, decision", [(3.0, "promoted"), (4.0, "kept"), (5.0, "kept")])
def test_same_data_lower_loss_wins(ours, decision):
    d = on_same_data(Case(_new(eval_loss=ours), _champion(eval_loss=4.0), Evidence()))
    assert d.decision == decision and d.metric == METRIC
    assert d.champion_eval_loss == 4.0 and not d.champion_rescored
    assert d.compared_on == "e" * 64
    assert d.record()["champion_version"] == (2 if decision == "promoted" else 1)


def test_same_data_does_not_apply_to_other_data_or_a_missing_loss():
    assert on_same_data(Case(_new(), _champion(eval_data="x" * 64), Evidence())) is None
    assert on_same_data(Case(_new(), _champion(eval_loss=None), Evidence())) is None


def test_holdout_uses_the_champions_own_score_on_the_same_text_and_seed():
    held = Holdout("h" * 64, "7", 1.5)
    scorer = Scorer(9.0)
    champ = _champion(holdout_digest="h" * 64, holdout_seed="7", holdout_bits_per_char=2.0)
    d = on_holdout(Case(_new(holdout=held), champ, Evidence(holdout=scorer)))
    assert d.decision == "promoted" and d.metric == HOLDOUT_METRIC
    assert d.holdout["champion_bits_per_char"] == 2.0 and not d.holdout["champion_rescored"]
    assert scorer.asked == []  # its own score: not re-scored
    assert d.compared_on == "h" * 64


@pytest.mark.parametrize("own", [("h" * 64, "8"), ("x" * 64, "7"), (None, None)])
def test_holdout_rescores_the_champion_on_another_text_or_seed(own):
    held = Holdout("h" * 64, "7", 1.5)
    scorer = Scorer(1.0)
    champ = _champion(holdout_digest=own[0], holdout_seed=own[1], holdout_bits_per_char=0.1)
    d = on_holdout(Case(_new(holdout=held), champ, Evidence(holdout=scorer)))
    assert d.decision == "kept" and scorer.asked == [1]  # 1.5 >= 1.0; its 0.1 never used
    assert d.holdout["champion_bits_per_char"] == 1.0 and d.holdout["champion_rescored"]


def test_holdout_not_scorable_is_not_compared_with_the_reason():
    held = Holdout("h" * 64, "7", 1.5)
    d = on_holdout(Case(_new(holdout=held), _champion(),
                        Evidence(holdout=Scorer(RescoreUnavailable("no text")))))
    assert d.decision == "not_compared" and "no text" in d.reason
    assert d.compared_on is None and not d.promotes
    assert on_holdout(Case(_new(), _champion(), Evidence())) is None


def test_bits_per_char_decides_across_tokenizers():
    scorer = Scorer((1.2, 1.4))
    d = in_bits_per_char(Case(_new(), _champion(), Evidence(bits_per_char=scorer), OTHER))
    assert d.decision == "promoted" and d.metric == BPC_METRIC
    assert d.bits_per_char == (1.2, 1.4) and d.champion_eval_loss is None
    assert d.compared_on == "b" * 64
    assert in_bits_per_char(Case(_new(), _champion(), Evidence(), None)) is None


def test_bits_per_char_without_text_or_scores_is_not_compared():
    d = in_bits_per_char(Case(_new(), _champion(), Evidence(), OTHER))
    assert d.decision == "not_compared" and "validation text was not found" in d.reason
    d = in_bits_per_char(Case(_new(), _champion(), Evidence(
        bits_per_char=Scorer(RescoreUnavailable("too short"))), OTHER))
    assert d.decision == "not_compared" and "could not be computed (too short)" in d.reason


def test_rescored_champion_loss_decides():
    scorer = Scorer(2.5)
    d = rescored(Case(_new(eval_loss=3.0), _champion(eval_data="x" * 64),
                      Evidence(rescore=scorer)))
    assert d.decision == "kept" and d.champion_eval_loss == 2.5 and d.champion_rescored
    assert scorer.asked == [1] and d.compared_on == "e" * 64


def test_rescoring_that_finds_another_tokenizer_hands_over_to_bits_per_char():
    bpc = Scorer((1.0, 2.0))
    d = rescored(Case(_new(), _champion(eval_data="x" * 64),
                      Evidence(rescore=Scorer(OtherTokenizer(OTHER)), bits_per_char=bpc)))
    assert d.decision == "promoted" and d.metric == BPC_METRIC and bpc.asked == [1]
    assert OTHER[:12] in d.reason


@pytest.mark.parametrize("evidence, tokenizer, why", [
    (Evidence(), TOK, "its tokenizer digest or shards were not given"),
    (Evidence(rescore=Scorer(2.0)), None, "its tokenizer digest or shards were not given"),
    (Evidence(rescore=Scorer(RescoreUnavailable("gone"))), TOK, "could not be re-scored"),
])
def test_rescore_impossible_is_not_compared(evidence, tokenizer, why):
    d = rescored(Case(_new(tokenizer=tokenizer), _champion(eval_data="x" * 64), evidence))
    assert d.decision == "not_compared" and why in d.reason and d.compared_on is None
    assert d.record()["champion_version"] == 1


def test_decide_picks_bits_per_char_when_the_champions_tokenizer_differs():
    rescore, bpc = Scorer(1.0), Scorer((1.0, 2.0))
    d = decide(_new(), _champion(eval_data="x" * 64),
               Evidence(champion_tokenizer=OTHER, rescore=rescore, bits_per_char=bpc))
    assert d.metric == BPC_METRIC and rescore.asked == [] and bpc.asked == [1]
    # unknown champion tokenizer: re-scored
    d = decide(_new(), _champion(eval_data="x" * 64), Evidence(rescore=rescore))
    assert d.champion_rescored and rescore.asked == [1]
