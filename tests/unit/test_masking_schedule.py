"""Masking-rate schedules (`masking.mlm_probability` as a constant, `linear` or `stepwise`).

A constant rate masks bit for bit as before schedules existed (sha256 of the masks made by
the code before this feature, recorded below); a schedule's realised masking rate follows
the rate this test computes from the schedule's definition, within a 6-sigma binomial
bound; evaluation keeps its fixed rate; bad schedules are refused naming the field.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, PipelineConfig
from mlm_pipeline.config_files import ConfigError, load_config
from mlm_pipeline.masking import KeyedMasking, build_masker
from mlm_pipeline.masking.keyed import mask_tokens

VOCAB = 300
LINEAR = {"schedule": "linear", "start": 0.3, "end": 0.15}

#: sha256 of the masks (corrupted ids, then labels, epochs 0 and 3) that
#: `build_masker(MaskingConfig(mlm_probability=0.3, ...))` gave for `_golden_rows()` before
#: masking-rate schedules existed, per (selection, whole_word).
GOLDEN = {
    ("bernoulli", False): "48567af0cdd3724de35fa60b4b3021f53cd9051da68adc7889035660e5a87137",
    ("bernoulli", True): "994eb1892b99ad233261a3db58919a9a2022da9641d1c27c9c1ed95b9c7b16be",
    ("exact_k", False): "336f708f8c2fde45e15c84d8316999796bb9dc75f5c7b614e719da7d7cd8086e",
    ("exact_k", True): "a6e694c2195d44919c90cd77c8f7961253c132f2f46d8495a72db15f3119f051",
}


def _golden_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """64 rows of 48 ids with [CLS], [SEP] and an inner [SEP]; word starts for 300 ids."""
    ids = torch.randint(5, VOCAB, (64, 48), generator=torch.Generator().manual_seed(123))
    ids[:, 0], ids[:, -1] = 2, 3
    ids[::3, 20] = 3
    starts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(9)) < 0.5
    starts[:5] = True
    return ids, starts


@pytest.mark.parametrize(("selection", "whole_word"), list(GOLDEN))
@pytest.mark.parametrize("step", [0, 250])
def test_constant_rate_masks_as_before_schedules(selection, whole_word, step):
    ids, starts = _golden_rows()
    cfg = MaskingConfig(mlm_probability=0.3, selection=selection, whole_word=whole_word,
                        seed=17)
    masker = build_masker(cfg, VOCAB, word_starts=starts, max_steps=1000)
    digest = hashlib.sha256()
    for epoch in (0, 3):
        corrupted, labels = masker(ids, torch.arange(1000, 1064), epoch, step)
        digest.update(corrupted.numpy().tobytes())
        digest.update(labels.numpy().tobytes())
    assert digest.hexdigest() == GOLDEN[(selection, whole_word)]
    assert masker.mlm_probability_at(step) == 0.3
    # The config dumps (and so hashes into digests) as it did: a plain float.
    assert cfg.model_dump(mode="json")["mlm_probability"] == 0.3


def _realised_rate(masker, step: int) -> tuple[float, int]:
    """Share of maskable tokens selected at `step` over 2000 rows of 64, and their count."""
    ids = torch.randint(5, VOCAB, (2000, 64), generator=torch.Generator().manual_seed(4))
    ids[:, 0], ids[:, -1] = 2, 3
    _, labels = masker(ids, torch.arange(2000), 0, step)
    maskable = int((ids >= 5).sum())
    return int((labels != -100).sum()) / maskable, maskable


@pytest.mark.parametrize("step", [0, 1, 50, 98, 99, 150])
def test_linear_schedule_realised_rate(step):
    max_steps = 100
    masker = build_masker(MaskingConfig(mlm_probability=LINEAR), VOCAB, max_steps=max_steps)
    # 0.3 at step 0, 0.15 at the last step (max_steps - 1) and after, linear between.
    want = 0.3 + (0.15 - 0.3) * min(step, max_steps - 1) / (max_steps - 1)
    assert masker.mlm_probability_at(step) == pytest.approx(want, rel=1e-12)
    got, n = _realised_rate(masker, step)
    assert abs(got - want) < 6 * math.sqrt(want * (1 - want) / n)


def test_stepwise_schedule_realised_rate():
    cfg = MaskingConfig(mlm_probability={"schedule": "stepwise",
                                         "rates": [[0, 0.3], [10, 0.15], [20, 0.05]]})
    masker = build_masker(cfg, VOCAB, max_steps=30)
    for step, want in [(0, 0.3), (9, 0.3), (10, 0.15), (19, 0.15), (20, 0.05), (29, 0.05)]:
        assert masker.mlm_probability_at(step) == want
    for step, want in [(9, 0.3), (10, 0.15), (29, 0.05)]:
        got, n = _realised_rate(masker, step)
        assert abs(got - want) < 6 * math.sqrt(want * (1 - want) / n)


def test_a_lower_rate_selects_a_subset_and_keeps_the_key():
    # Bernoulli: the same (seed, epoch, row) draws at a lower threshold, so the positions
    # at step 99 (0.15) are among those at step 0 (0.3); the masks depend on the step
    # only through the rate, so a fresh masker at any step reproduces them (resume).
    masker = build_masker(MaskingConfig(mlm_probability=LINEAR), VOCAB, max_steps=100)
    ids, _ = _golden_rows()
    rows = torch.arange(64)
    early = masker(ids, rows, 2, 0)[1] != -100
    late = masker(ids, rows, 2, 99)[1] != -100
    assert bool((late & ~early).sum() == 0) and late.sum() < early.sum()
    again = build_masker(MaskingConfig(mlm_probability=LINEAR), VOCAB, max_steps=100)
    for step in (0, 37, 99):
        a, b = masker(ids, rows, 2, step), again(ids, rows, 2, step)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        want = mask_tokens(ids, vocab_size=VOCAB, row_index=rows, epoch=2,
                           mlm_probability=0.3 - 0.15 * step / 99)
        assert torch.equal(a[1], want[1])


def test_evaluation_masks_at_the_fixed_eval_rate():
    ids, _ = _golden_rows()
    rows = torch.arange(64)
    for cfg, rate in [(MaskingConfig(mlm_probability=LINEAR), 0.15),
                      (MaskingConfig(mlm_probability={**LINEAR, "eval_rate": 0.2}), 0.2),
                      (MaskingConfig(mlm_probability=0.3), 0.3)]:
        got = KeyedMasking(cfg, VOCAB, seed=8)(ids, rows, 0)
        want = mask_tokens(ids, vocab_size=VOCAB, row_index=rows, seed=8, epoch=0,
                           mlm_probability=rate)
        assert torch.equal(got[1], want[1]), cfg


@pytest.mark.parametrize(("value", "words"), [
    ({**LINEAR, "start": 1.2}, ["masking.mlm_probability", "start", "less than 1"]),
    ({**LINEAR, "end": 0.0}, ["masking.mlm_probability", "end", "greater than 0"]),
    ({"schedule": "stepwise", "rates": [[0, 0.3], [5, 1.0]]},
     ["masking.mlm_probability", "rates", "less than 1"]),
    (1.0, ["masking.mlm_probability", "less than 1"]),
    ({**LINEAR, "end_step": 20}, ["masking.mlm_probability.end_step", "out of range",
                                  "train.max_steps 20"]),
    ({"schedule": "stepwise", "rates": [[0, 0.3], [25, 0.1]]},
     ["masking.mlm_probability.rates", "[25]", "out of range", "train.max_steps 20"]),
    ({"schedule": "stepwise", "rates": [[3, 0.3]]},
     ["masking.mlm_probability", "first", "step 0"]),
    ({"schedule": "stepwise", "rates": [[0, 0.3], [9, 0.2], [9, 0.1]]},
     ["masking.mlm_probability", "strictly increasing"]),
    ({"schedule": "cosine", "start": 0.3, "end": 0.1},
     ["masking.mlm_probability", "'cosine'", "linear", "stepwise"]),
])
def test_bad_schedules_name_the_field(value, words):
    with pytest.raises(ValueError) as info:
        PipelineConfig.model_validate({"masking": {"mlm_probability": value},
                                       "train": {"max_steps": 20, "warmup_steps": 2}})
    for word in words:
        assert word in str(info.value)


def test_precomputed_masking_refuses_a_schedule_naming_both_fields():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["masking.mode=precomputed",
                           "masking.mlm_probability={schedule: linear, start: 0.3, end: 0.15}"])
    assert "masking.mlm_probability" in str(info.value)
    assert "masking.mode" in str(info.value)
    # The same schedule with dynamic masking loads from an override (parsed as YAML).
    cfg = load_config(None, [
        "masking.mlm_probability={schedule: stepwise, rates: [[0, 0.3], [500, 0.15]]}"])
    assert cfg.masking.mlm_probability_at(499, 1000) == 0.3
    assert cfg.masking.mlm_probability_at(500, 1000) == 0.15


def test_build_masker_checks_the_schedule_against_max_steps():
    cfg = MaskingConfig(mlm_probability={**LINEAR, "end_step": 50})
    with pytest.raises(ValueError, match="needs train.max_steps"):
        build_masker(cfg, VOCAB)
    with pytest.raises(ValueError, match="end_step 50 is out of range"):
        build_masker(cfg, VOCAB, max_steps=50)
    assert build_masker(cfg, VOCAB, max_steps=51).mlm_probability_at(50) == 0.15
