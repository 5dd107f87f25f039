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
    # 800 steps take 3 to 14 minutes on 2 cores: the cap must be far above that
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


def test_a_bad_override_is_named_not_the_config_file():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.max_steps=20", "train.lr=abc"])
    message = str(err.value)
    assert "--set train.lr=abc: train.lr: " in message
    assert "invalid --set override" in message and "tiny.yaml: invalid config" not in message
    assert "max_steps" not in message  # the good override is not blamed


def test_file_and_override_errors_are_told_apart(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  micro_batch_size: many\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["model.num_layers=two"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: invalid config"
    assert any(line.startswith("  --set model.num_layers=two: model.num_layers: ")
               for line in lines)
    assert any(line.startswith("  train.micro_batch_size: ") for line in lines)
