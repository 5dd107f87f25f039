"""`train.lr: auto` resolution per model recipe, at config load (so params and digests
hold numbers), without changing what a config with numbers resolves to."""

import pytest

from mlm_pipeline.config import ModelConfig, PipelineConfig, TrainConfig, resolve_lr
from mlm_pipeline.config_files import ConfigError, flatten, load_config


def _cfg(**sections):
    return PipelineConfig.model_validate(sections)


def test_bert_gets_the_swept_peak_and_a_six_percent_warmup():
    cfg = _cfg(model={"preset": "bert"}, train={"lr": "auto", "max_steps": 20_000})
    # benchmarks/sweep_lr.py on tiny: 5e-4 best of {1e-4, 3e-4, 5e-4, 1e-3} at 6 % warm-up
    # -> 6 % of 20k = 1,200.
    assert (cfg.train.lr, cfg.train.warmup_ratio, cfg.train.warmup) == (5e-4, 0.06, 1200)
    assert flatten(cfg)["train.lr"] == 5e-4  # what MLflow logs as a param
    # A warm-up the config sets wins.
    own = _cfg(model={"preset": "bert"}, train={"lr": "auto", "warmup_steps": 7})
    assert (own.train.lr, own.train.warmup) == (5e-4, 7)
    # The default model is post-LN (BERT's architecture): the same recipe.
    assert _cfg(train={"lr": "auto"}).train.lr == 5e-4


def test_modern_gets_todays_values():
    cfg = _cfg(model={"preset": "modern"}, train={"lr": "auto", "max_steps": 1000})
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.warmup_ratio) == (1e-3, None, None)
    assert cfg == _cfg(model={"preset": "modern"}, train={"lr": 1e-3, "max_steps": 1000})


def test_tiny_resolves_as_before():
    tiny = load_config("tiny")
    assert tiny.model.preset == "modern" and tiny.train.lr == 1e-3
    # Same resolved config, so the same digest and the same run (loss curve) as tiny's.
    assert load_config("tiny", ["train.lr=auto"]) == tiny
    # tiny says `lr: auto`, so switching its preset to BERT's switches the peak lr too.
    bert = load_config("tiny", ["model.preset=bert"])
    assert (bert.train.lr, bert.train.warmup) == (5e-4, 48)  # tiny's own 6 % of 800


def test_resolve_lr_on_a_train_section():
    bert, modern = ModelConfig(preset="bert"), ModelConfig(preset="modern")
    numbers = TrainConfig(lr=3e-4)
    assert resolve_lr(numbers, bert) is numbers
    # Alone, `auto` defers the warm-up check to resolution: 100 default steps > 50.
    alone = TrainConfig(lr="auto", max_steps=50)
    assert resolve_lr(alone, bert).warmup == 3  # round(0.06 * 50)
    with pytest.raises(ValueError, match="warmup_steps 100 exceeds max_steps 50"):
        resolve_lr(alone, modern)


def test_bad_lr_names_the_field():
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"train\.lr.*greater than 0"):
        load_config(None, ["train.lr=0"])
