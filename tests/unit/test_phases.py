"""Phases of a recipe (`train.phase_of`): the shipped phase configs load, name their parent
phase and differ from it only where the phase means to; the chain derived from them; the
chain's refusals."""

import pytest

from mlm_pipeline.app.phases import alone_warning, child_overrides, phase_chain
from mlm_pipeline.config_files import flatten, load_config, shipped_configs
from mlm_pipeline.errors import ConfigError

#: Each shipped phase config: its parent phase and every field in which it differs from
#: it, with the phase's value (the recipes' comments say why each one).
PHASES = {
    "bert-base-512": ("bert-base", {
        "name": "bert-base-512",
        "shards.seq_len": 512,
        "train.micro_batch_size": 64,          # 1024 rows x 512: bert-base's tokens per step
        "train.max_steps": 7778,               # 10 % of 77,778 (Devlin et al. 2019, A.2)
        "train.max_time_s": 28800.0,
        "train.phase_of": "bert-base",
        "eval.max_rows": 5000,                 # 5000 x 512 = 20000 x 128 tokens
        "eval.periodic_rows": 512,             # 512 x 512 = 2048 x 128 tokens
    }),
    "modern-base-8k": ("modern-base", {
        "name": "modern-base-8k",
        "shards.seq_len": 8192,
        "model.rope_base": 160000.0,           # ModernBERT's context extension
        "train.micro_batch_size": 4,           # 64 rows x 8192: modern-base's tokens per step
        "train.max_steps": 12350,
        "train.max_time_s": 86400.0,
        "train.phase_of": "modern-base",
        "train.lr": 3e-4,
        "train.warmup_ratio": 0.02,
        "train.decay_fraction": 0.167,
        "eval.batch_size": 8,
        "eval.max_rows": 312,                  # 312 x 8192 ~ 20000 x 128 tokens
        "eval.periodic_rows": 32,              # 32 x 8192 = 2048 x 128 tokens
    }),
}


def _tokens_per_step(cfg) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.shards.seq_len


@pytest.mark.parametrize("name", sorted(PHASES))
def test_a_phase_config_differs_from_its_parent_only_where_it_means_to(name):
    parent, expected = PHASES[name]
    child_cfg, parent_cfg = load_config(name), load_config(parent)
    child, base = flatten(child_cfg), flatten(parent_cfg)
    differ = {k: child.get(k) for k in child.keys() | base.keys() if child.get(k) != base.get(k)}
    assert differ == expected
    assert child_cfg.train.phase_of == parent and parent_cfg.train.phase_of is None
    assert _tokens_per_step(child_cfg) == _tokens_per_step(parent_cfg) == 4096 * 128


def test_shipped_chains_run_the_base_recipe_first():
    assert phase_chain("bert-base-512") == ["bert-base", "bert-base-512"]
    assert phase_chain("modern-base-8k") == ["modern-base", "modern-base-8k"]
    assert phase_chain("bert-base") == ["bert-base"]
    # every shipped phase_of names a shipped config
    for name in shipped_configs():  # adapt loads only with a parent (train.init_required)
        overrides = ["train.init_from=/models/parent"] if name == "adapt" else []
        assert set(phase_chain(name, overrides)) <= set(shipped_configs())


def test_an_override_may_name_the_parent_phase_of_a_file(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("name: long\nshards:\n  seq_len: 256\n")
    assert phase_chain(str(path)) == [str(path)]
    assert phase_chain(str(path), ["train.phase_of=bert-base-512"]) == [
        "bert-base", "bert-base-512", str(path)]


def test_refuses_a_parent_that_is_not_shipped_and_a_chain_that_loops():
    with pytest.raises(ConfigError, match=r"train.phase_of 'no-such' of config 'tiny' is not "
                       r"a shipped config \(shipped: .*bert-base-512"):
        phase_chain("tiny", ["train.phase_of=no-such"])
    with pytest.raises(ConfigError, match="comes back to 'tiny': tiny -> tiny"):
        phase_chain("tiny", ["train.phase_of=tiny"])


def test_a_child_phase_starts_from_its_parents_mlflow_run():
    assert child_overrides("0123abcd") == ["train.init_from=0123abcd"]
    with pytest.raises(ValueError, match="no MLflow run id"):
        child_overrides("")


def test_a_phase_run_alone_without_a_parent_is_told_it_starts_from_random_weights():
    message = alone_warning(load_config("bert-base-512"))
    assert message.startswith("config 'bert-base-512' is a phase of 'bert-base' "
                              "(train.phase_of) but sets no train.init_from")
    assert alone_warning(load_config("bert-base-512", ["train.init_from=0123abcd"])) is None
    assert alone_warning(load_config("bert-base")) is None
