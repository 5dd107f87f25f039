"""A phase that raises the RoPE base (ModernBERT's context extension: the global layers'
base 10,000 -> 160,000) starts from its parent's weights, and its lineage records the
change: the train manifest's parent record and the MLflow tag `mlm.init_changes`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mlm_pipeline.config import MaskingConfig, ModelConfig, TrainConfig
from mlm_pipeline.tracking.fetch import parent_tags
from mlm_pipeline.train import train


def _train_cfg(**kw) -> TrainConfig:
    base = {"micro_batch_size": 4, "max_steps": 2, "warmup_steps": 1, "log_every": 1,
            "lr": 1e-3, "seed": 11, "precision": "fp32", "compile": "off",
            "checkpoint_interval_s": None}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def rope_model():
    """The tiny shape with the `modern` preset (rotary positions, a global layer then a
    local one)."""
    return ModelConfig(preset="modern", hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64)


def test_a_rope_base_change_is_allowed_and_recorded(tmp_path, rope_model, tiny_shard_manifest,
                                                    tiny_tokenizer_manifest):
    parent = train(_train_cfg(), rope_model, MaskingConfig(), tiny_shard_manifest,
                   tiny_tokenizer_manifest, tmp_path / "parent")
    longer = rope_model.model_copy(update={"rope_base": 160_000.0})
    # lr ~0: the child's final weights are the ones it started from (within 1e-9)
    child = train(_train_cfg(init_from=str(parent.output_dir), lr=1e-12), longer,
                  MaskingConfig(), tiny_shard_manifest, tiny_tokenizer_manifest,
                  tmp_path / "child")
    assert child.init["changes"] == {"model.rope_base": [10000.0, 160000.0]}
    assert json.loads(parent_tags(child.init)["mlm.init_changes"]) == {
        "model.rope_base": [10000.0, 160000.0]}
    before = load_file(parent.file(parent.checkpoint_dir) / "model.safetensors")
    after = load_file(child.file(child.checkpoint_dir) / "model.safetensors")
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-9, msg=name)


def test_a_change_of_the_local_rope_base_is_recorded_beside_the_global_one(
        tmp_path, rope_model, tiny_shard_manifest, tiny_tokenizer_manifest):
    parent = train(_train_cfg(max_steps=1), rope_model, MaskingConfig(), tiny_shard_manifest,
                   tiny_tokenizer_manifest, tmp_path / "parent")
    both = rope_model.model_copy(update={"rope_base": 160_000.0, "local_rope_base": 20_000.0})
    child = train(_train_cfg(max_steps=1, init_from=str(parent.output_dir)), both,
                  MaskingConfig(), tiny_shard_manifest, tiny_tokenizer_manifest,
                  tmp_path / "child")
    assert child.init["changes"] == {"model.rope_base": [10000.0, 160000.0],
                                     "model.local_rope_base": [10000.0, 20000.0]}


def test_naming_a_parent_phase_leaves_the_runs_identity_alone(rope_model, tiny_shard_manifest,
                                                              tiny_tokenizer_manifest):
    from mlm_pipeline.train.stage import train_digest

    args = (rope_model, MaskingConfig(), tiny_shard_manifest, tiny_tokenizer_manifest, "run")
    assert train_digest(_train_cfg(phase_of="tiny"), *args) == train_digest(_train_cfg(), *args)
    assert train_digest(_train_cfg(lr=2e-3), *args) != train_digest(_train_cfg(), *args)
