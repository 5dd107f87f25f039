"""LR schedule: values written out by hand."""

import math

import pytest

from mlm_pipeline.train.loop import lr_multiplier


def test_linear_warmup_then_linear_decay():
    kw = dict(warmup_steps=4, max_steps=14, decay="linear", min_lr_ratio=0.0)
    got = [lr_multiplier(s, **kw) for s in range(15)]
    # warm-up: 1/4, 2/4, 3/4, 4/4; then the decay from 1.0 at step 4 to 0.0 at step 14.
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]
    assert got == pytest.approx(want)


def test_cosine_decay_with_floor():
    kw = dict(warmup_steps=0, max_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(1.0)
    # halfway: cos(pi/2) = 0 -> floor + (1 - floor) / 2
    assert lr_multiplier(5, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(10, **kw) == pytest.approx(0.1)
    assert lr_multiplier(3, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.3)))


def test_unknown_decay_is_an_error():
    with pytest.raises(ValueError, match="unknown decay"):
        lr_multiplier(5, warmup_steps=1, max_steps=10, decay="step", min_lr_ratio=0.0)
