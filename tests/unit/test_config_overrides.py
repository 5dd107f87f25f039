"""Overrides take the literal choices a field offers, even where YAML reads them otherwise."""

import pytest

from mlm_pipeline.config_files import ConfigError, load_config


@pytest.mark.parametrize("value", ["on", "off", "auto"])
def test_compile_accepts_its_choices_from_the_command_line(value):
    # YAML 1.1 reads a bare `on`/`off` as a boolean
    assert load_config("tiny", [f"train.compile={value}"]).train.compile == value


def test_compile_rejects_other_values():
    with pytest.raises(ConfigError, match="train.compile"):
        load_config("tiny", ["train.compile=maybe"])


def test_the_tiny_time_cap_is_only_a_safety_net():
    cfg = load_config("tiny")
    # 1,000 steps take about 3 minutes on 2 cores: the cap must be far above that
    assert cfg.train.max_time_s >= 10 * 180


@pytest.mark.parametrize(("typo", "suggestion"), [
    ("train.max_step=5", "train.max_steps"),
    ("masking.mlm_probabilty=0.2", "masking.mlm_probability"),
    ("tokenizr.vocab_size=100", "tokenizer"),
])
def test_an_unknown_key_suggests_the_nearest_valid_one(typo, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        load_config("tiny", [typo])


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.zzzz=1"])
    assert "did you mean" not in str(err.value)
