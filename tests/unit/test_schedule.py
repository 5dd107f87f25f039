"""LR schedule: values written out by hand."""

import math

import pytest

from mlm_pipeline.train.schedule import lr_multiplier


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


def test_wsd_warmup_stable_then_linear_decay():
    # max_steps 20, decay_fraction 0.25 -> the last 5 steps decay: stable until step 15.
    kw = dict(warmup_steps=4, max_steps=20, decay="wsd", min_lr_ratio=0.0, decay_fraction=0.25)
    got = [lr_multiplier(s, **kw) for s in range(21)]
    want = [0.25, 0.5, 0.75, 1.0] + [1.0] * 11 + [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    assert got == pytest.approx(want)


def test_wsd_decays_to_the_floor():
    # D = round(0.1 * 100) = 10: stable through step 90, then 1 -> 0.2 over 10 steps.
    kw = dict(warmup_steps=10, max_steps=100, decay="wsd", min_lr_ratio=0.2, decay_fraction=0.1)
    assert lr_multiplier(50, **kw) == pytest.approx(1.0)
    assert lr_multiplier(90, **kw) == pytest.approx(1.0)
    assert lr_multiplier(95, **kw) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_multiplier(100, **kw) == pytest.approx(0.2)
    assert lr_multiplier(130, **kw) == pytest.approx(0.2)  # past max_steps: stays at the floor


def test_wsd_decay_longer_than_the_stable_phase_starts_after_warmup():
    # D = 10 of 10 steps, but the warm-up takes 2: the decay runs from step 2 to step 10.
    kw = dict(warmup_steps=2, max_steps=10, decay="wsd", min_lr_ratio=0.0, decay_fraction=1.0)
    got = [lr_multiplier(s, **kw) for s in range(11)]
    want = [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]
    assert got == pytest.approx(want)


def test_linear_and_cosine_ignore_decay_fraction():
    for decay in ("linear", "cosine"):
        kw = dict(warmup_steps=2, max_steps=12, decay=decay, min_lr_ratio=0.0)
        for s in range(13):
            assert lr_multiplier(s, **kw, decay_fraction=0.3) == lr_multiplier(s, **kw)
    # linear after warm-up 2 over 10 steps: 1 - (7 - 2) / 10 at step 7
    assert lr_multiplier(7, warmup_steps=2, max_steps=12, decay="linear",
                         min_lr_ratio=0.0) == pytest.approx(0.5)


def test_wsd_rejects_a_bad_decay_fraction():
    with pytest.raises(ValueError, match="decay_fraction"):
        lr_multiplier(5, warmup_steps=1, max_steps=10, decay="wsd", min_lr_ratio=0.0,
                      decay_fraction=0.0)


def test_warmup_ratio_scales_with_max_steps_and_explicit_steps_win():
    from mlm_pipeline.config import TrainConfig
    from mlm_pipeline.config_files import ConfigError, load_config

    assert load_config("tiny", []).train.warmup == 48  # 0.06 x 800
    assert load_config("tiny", ["train.max_steps=20"]).train.warmup == 1  # round(1.2)
    assert load_config("tiny", ["train.max_steps=20", "train.warmup_steps=5"]).train.warmup == 5
    with pytest.raises(ConfigError, match="warmup_steps 50 exceeds max_steps 20"):
        load_config("tiny", ["train.max_steps=20", "train.warmup_steps=50"])
    assert TrainConfig().warmup == 100  # no ratio: the warmup_steps default
    assert TrainConfig(warmup_ratio=0.25, max_steps=10).warmup == 2  # round(2.5): even


def test_params_record_the_warmup_in_effect():
    from mlm_pipeline.config_files import load_config
    from mlm_pipeline.tracking.records import run_params

    params = run_params(load_config("tiny", ["train.max_steps=200"]))
    assert params["train.warmup_ratio"] == 0.06 and params["train.warmup_in_effect"] == 12
