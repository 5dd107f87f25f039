"""Training with a masking-rate schedule: the rate is logged as `train/mlm_probability`,
follows the schedule step by step, and a run resumed mid-schedule trains exactly as an
uninterrupted one (the rate is a function of the step alone)."""

import json
import shutil

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import list_checkpoints, load_model_state

SCHEDULE = MaskingConfig(mlm_probability={"schedule": "linear", "start": 0.4, "end": 0.1})


def _records(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_resume_mid_schedule_is_exact(tmp_path, tiny_model_config, tiny_shard_manifest,
                                      tiny_tokenizer_manifest):
    sections = (TrainConfig(micro_batch_size=4, max_steps=8, warmup_steps=2, log_every=1,
                            lr=1e-3, seed=3, checkpoint_every=3, keep_last_checkpoints=3),
                tiny_model_config, SCHEDULE)
    straight = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    records = _records(straight)
    # Step s (1-based) masks after s - 1 completed steps: 0.4 down to 0.1 at step 8.
    assert [r["train/mlm_probability"] for r in records] == pytest.approx(
        [0.4 + (0.1 - 0.4) * (s - 1) / 7 for s in range(1, 9)], rel=1e-12)
    weights = load_model_state(straight.file(straight.checkpoint_dir))

    ckpts = list_checkpoints(straight.file("checkpoints"))
    assert ckpts[-2].name == "step-00000006"
    shutil.rmtree(ckpts[-1])  # resume from step 6, mid-schedule
    straight.path.unlink()
    resumed = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert resumed.steps == 8
    keys = ("step", "train/loss", "train/masked_tokens", "train/mlm_probability")
    assert [[r[k] for k in keys] for r in _records(resumed)] == [
        [r[k] for k in keys] for r in records]
    again = load_model_state(resumed.file(resumed.checkpoint_dir))
    for key in weights:
        torch.testing.assert_close(again[key], weights[key], rtol=0, atol=0, msg=key)
    # Fewer tokens are predicted as the rate falls (same rows per step).
    masked = [r["train/masked_tokens"] for r in records]
    assert sum(masked[:3]) > 2 * sum(masked[-3:])
