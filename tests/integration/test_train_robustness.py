"""What a long run meets: damaged checkpoints, non-finite losses, steps without targets."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import Checkpointer, list_checkpoints, load_model_state
from mlm_pipeline.train.loop import NonFiniteLossError
from tests.fakes import FakePart as Part
from tests.faults.mlm_faults import nan_at_step


def _sections(model_cfg, masking=None, **train_kw):
    kw = {"micro_batch_size": 4, "max_steps": 6, "warmup_steps": 2, "log_every": 1, "lr": 1e-3,
          "seed": 5, **train_kw}
    return TrainConfig(**kw), model_cfg, masking or MaskingConfig()


def _losses(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["train/loss"] for line in lines}


def test_a_damaged_newest_checkpoint_falls_back_to_the_older_intact_one(
    tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest, caplog
):
    sections = _sections(tiny_model_config, checkpoint_every=2, keep_last_checkpoints=3)
    straight = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "a")
    run = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "b")
    step2, step4, step6 = list_checkpoints(run.file("checkpoints"))
    # A crash mid-run: step 6 never happened; step 4's weights lose a byte to the disk.
    import shutil

    shutil.rmtree(step6)
    run.path.unlink()
    weights = step4 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "b")
    assert "step-00000004 is damaged" in caplog.text and "model.safetensors" in caplog.text
    assert resumed.steps == 6
    assert _losses(resumed) == _losses(straight)  # steps 3-6 trained again from step 2
    a = load_model_state(straight.file(straight.checkpoint_dir))
    b = load_model_state(resumed.file(resumed.checkpoint_dir))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_checkpoint_is_never_written_from_non_finite_weights(tmp_path):
    parts = {name: Part({"x": 1}) for name in ("train_state", "cursor", "masker", "meter")}
    parts |= {"model": Part({"w": torch.tensor([1.0, float("nan")])}),
              "optimizer": Part({}), "lr_scheduler": Part({}), "rng": Part({})}
    with pytest.raises(ValueError, match="non-finite weights: w"):
        Checkpointer(tmp_path, parts, {}).save(step=3)
    assert list_checkpoints(tmp_path) == [] and not list(tmp_path.glob("step-*"))


def test_nonfinite_stop_names_the_first_bad_step_and_the_last_good_checkpoint(
    tmp_path, monkeypatch, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    nan_at_step(3, monkeypatch.setattr)
    sections = _sections(tiny_model_config, checkpoint_every=2, log_every=2)
    with pytest.raises(NonFiniteLossError, match="non-finite at step 3") as err:
        train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert err.value.step == 3 and err.value.last_checkpoint.name == "step-00000002"
    assert "step-00000002" in str(err.value)
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [c.name for c in ckpts] == ["step-00000002"]  # nothing saved past the bad step
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2]  # nothing non-finite was logged


def test_nonfinite_skip_drops_the_batch_and_counts_it(
    tmp_path, monkeypatch, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    nan_at_step(3, monkeypatch.setattr)
    sections = _sections(tiny_model_config, nonfinite="skip")
    m = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert m.steps == 6  # six applied steps; the dropped batch is not one of them
    records = [json.loads(line) for line in m.file(m.metrics_log).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["train/skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)
    assert sum(r["train/masked_tokens"] for r in records) > 0


def test_steps_without_a_selected_token_do_not_move_the_weights(
    tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    # At this rate no token of a 4-row batch is ever selected.
    masking = MaskingConfig(mlm_probability=1e-9)
    sections = _sections(tiny_model_config, masking, max_skipped_steps=3)
    with pytest.raises(ValueError, match="4 steps in a row selected no token"):
        train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
