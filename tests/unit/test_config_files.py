"""Config files: the shipped configs are found from anywhere, and what `mlm-pipeline config`
prints trains exactly as the config it came from (STYLE rule 5: every shipped YAML validates)."""

from pathlib import Path

import pytest
import yaml

from mlm_pipeline import cli
from mlm_pipeline.config import DEFAULT_WARMUP_STEPS, TrainConfig
from mlm_pipeline.config.lr_auto import AUTO_LR
from mlm_pipeline.config_files import (
    ConfigError,
    dump_config,
    load_config,
    resolve_config_path,
    shipped_configs,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def test_every_yaml_in_configs_is_shipped():
    assert SHIPPED and sorted(shipped_configs()) == SHIPPED


#: Shipped configs that need `train.init_from` (`train.init_required`), and a parent
#: path for them: not read at load time (only a Hugging Face directory would be).
NEEDS_PARENT = {"adapt": ["train.init_from=/models/parent-checkpoint"]}


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("overrides", [[], ["train.max_steps=200"], ["train.warmup_steps=7"]])
def test_printed_config_round_trips(name, overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped config, not a ./configs folder
    overrides = NEEDS_PARENT.get(name, []) + overrides
    original = load_config(name, overrides)
    assert cli.main(["config", name, *[f"--set={o}" for o in overrides]]) == 0
    printed = tmp_path / "my.yaml"
    printed.write_text(capsys.readouterr().out, encoding="utf-8")
    reloaded = load_config(printed)
    assert reloaded == original
    assert reloaded.model_dump() == original.model_dump()
    assert reloaded.train.warmup == original.train.warmup
    assert dump_config(reloaded) == printed.read_text(encoding="utf-8")


def test_adapt_without_a_parent_fails_at_load_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    needing = [n for n in SHIPPED if (yaml.safe_load((CONFIGS / f"{n}.yaml").read_text(
        encoding="utf-8")).get("train") or {}).get("init_required")]
    assert needing == sorted(NEEDS_PARENT)
    with pytest.raises(ConfigError, match=r"train\.init_from is required.*--set "
                       r"train\.init_from=DIR.*save_pretrained"):
        load_config("adapt")
    cfg = load_config("adapt", NEEDS_PARENT["adapt"])
    assert cfg.train.init_from == "/models/parent-checkpoint" and cfg.train.init_required
    # adaptation defaults: a lower peak lr than from scratch, a short warm-up, evaluation on
    assert cfg.train.lr == 1e-4 < min(AUTO_LR.values())  # the from-scratch `lr: auto`
    assert cfg.train.warmup == 48 and cfg.masking.mlm_probability == 0.15
    assert cfg.linear_probe.enabled and cfg.finetune.enabled and cfg.tokenizer.from_init
    assert cfg.ingest.sources == ["debian:fr"]


def test_tiny_warmup_survives_printing(tmp_path, monkeypatch):
    # The bug this pins: the printed `warmup_steps: 100` beat `warmup_ratio: 0.06`.
    monkeypatch.chdir(tmp_path)
    printed = yaml.safe_load(dump_config(load_config("tiny")))
    assert printed["train"]["warmup_steps"] is None and printed["train"]["warmup_ratio"] == 0.06
    (tmp_path / "my.yaml").write_text(dump_config(load_config("tiny")), encoding="utf-8")
    assert load_config("my.yaml").train.warmup == 48  # 0.06 x 800


def test_warmup_in_effect():
    assert TrainConfig().warmup == DEFAULT_WARMUP_STEPS == 100
    assert TrainConfig(warmup_ratio=0.1, max_steps=300).warmup == 30
    assert TrainConfig(warmup_ratio=0.1, max_steps=300, warmup_steps=0).warmup == 0
    assert TrainConfig(warmup_steps=100).warmup == TrainConfig().warmup  # explicit = default
    with pytest.raises(ValueError, match="warmup_steps 100 exceeds max_steps 50"):
        TrainConfig(max_steps=50)  # as before: the default warm-up must fit


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = resolve_config_path("tiny")
    assert shipped.name == "tiny.yaml" and load_config("tiny").name == "tiny"
    # a ./configs/NAME.yaml of the user's own shadows the shipped one
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("name: mine\n", encoding="utf-8")
    assert load_config("tiny").name == "mine"
    with pytest.raises(ConfigError, match=r"shipped config 'nope' \(shipped: .*tiny"):
        load_config("nope")
    with pytest.raises(ConfigError, match="config not found: tried missing.yaml$"):
        load_config("missing.yaml")
