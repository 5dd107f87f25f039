"""Data-parallel training under torchrun on CPU (gloo): two ranks against one process over
the same global batch, a failing rank, resume after a failure, resume on another world
size, FSDP2.

The reference is a real one-process `train()` whose micro-batch is twice each rank's: each
step covers the same rows (the ranks' strided slices of one order), with the same masks
(keyed by global row), so the per-step losses and final weights must agree up to the
order of floating-point sums (rel 1e-5 and atol 1e-6).
"""

import json
import shutil

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.config.stages import DistributedConfig
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import list_checkpoints, load_model_state
from mlm_pipeline.train.distributed import FAIL_RANK_ENV
from mlm_pipeline.train.launch import DistributedTrainingError, run_torchrun

pytestmark = pytest.mark.slow  # every test starts torchrun (two interpreters importing torch)


def _cfg(nproc: int, micro: int, **kw) -> TrainConfig:
    base = {"micro_batch_size": micro, "grad_accum_steps": 2, "max_steps": 4,
            "warmup_steps": 1, "log_every": 1, "lr": 3e-3, "seed": 5, "device": "cpu",
            "precision": "fp32", "compile": "off", "num_threads": 1, "checkpoint_every": 2,
            "checkpoint_interval_s": None, "keep_last_checkpoints": 5,
            "distributed": DistributedConfig(nproc_per_node=nproc, backend="gloo"), **kw}
    return TrainConfig(**base)


def _losses(manifest) -> dict[int, float]:
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["train/loss"] for line in lines}


def _weights(manifest) -> dict[str, torch.Tensor]:
    return load_model_state(manifest.file(manifest.checkpoint_dir))


def _launch(tmp_path, name, cfg, model_cfg, shards, tok, monkeypatch=None, lines=None):
    return run_torchrun(cfg, model_cfg, MaskingConfig(), shards, tok, tmp_path / name,
                        on_line=(lines.append if lines is not None else lambda _: None))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_two_ranks_match_one_process(tmp_path, tiny_model_config, tiny_shard_manifest,
                                     tiny_tokenizer_manifest):
    lines: list[str] = []
    two = _launch(tmp_path, "two", _cfg(2, 2), tiny_model_config, tiny_shard_manifest,
                  tiny_tokenizer_manifest, lines=lines)
    one = train(_cfg(1, 4), tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                tiny_tokenizer_manifest, tmp_path / "one")
    # the global batch: 2 rows x 2 micro-batches x 2 ranks = 4 rows x 2 micro-batches
    assert two.tokens_seen == one.tokens_seen == 4 * 8 * tiny_shard_manifest.seq_len
    got, want = _losses(two), _losses(one)
    assert list(got) == [1, 2, 3, 4]  # metrics.jsonl written once: each step once
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5)
    w2, w1 = _weights(two), _weights(one)
    assert w2.keys() == w1.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-6, msg=key)
    # checkpoints written once, by rank 0: steps 2 and 4, no other rank's temporary dirs
    root = tmp_path / "two" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004"]
    state = json.loads((root / "step-00000004" / "state.json").read_text())
    assert state["cursor"]["world_size"] == 2
    # the ranks' output reached the callback, metrics as rank 0's lines only
    assert any("[rank 0]" in line and "train/loss" in line for line in lines)
    assert not any("[rank 1]" in line and "train/loss" in line for line in lines)


def test_failing_rank_names_rank_and_exception(tmp_path, monkeypatch, tiny_model_config,
                                               tiny_shard_manifest, tiny_tokenizer_manifest):
    monkeypatch.setenv(FAIL_RANK_ENV, "1:2")
    with pytest.raises(DistributedTrainingError, match=r"rank 1: RuntimeError: test hook") as e:
        _launch(tmp_path, "fail", _cfg(2, 2), tiny_model_config, tiny_shard_manifest,
                tiny_tokenizer_manifest)
    assert e.value.rank == 1 and e.value.returncode != 0


def test_resume_after_failure_matches_uninterrupted(tmp_path, monkeypatch, tiny_model_config,
                                                    tiny_shard_manifest,
                                                    tiny_tokenizer_manifest):
    args = (tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest)
    whole = _launch(tmp_path, "whole", _cfg(2, 2), *args)
    monkeypatch.setenv(FAIL_RANK_ENV, "0:3")  # after the checkpoint of step 2
    with pytest.raises(DistributedTrainingError, match="rank 0"):
        _launch(tmp_path, "cut", _cfg(2, 2), *args)
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == [
        "step-00000002"]
    monkeypatch.delenv(FAIL_RANK_ENV)
    resumed = _launch(tmp_path, "cut", _cfg(2, 2), *args)
    assert _losses(resumed) == _losses(whole)  # exact, steps 1-4 once each
    w, r = _weights(whole), _weights(resumed)
    assert all(torch.equal(w[k], r[k]) for k in w)
    # the two-rank checkpoint does not resume in one process: both world sizes named
    shutil.copytree(tmp_path / "cut" / "checkpoints", tmp_path / "single" / "checkpoints")
    with pytest.raises(ValueError, match="world size 2.*world size 1"):
        train(_cfg(1, 4, max_steps=6), tiny_model_config, MaskingConfig(),
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "single")


def test_fsdp2_runs_on_cpu_gloo(tmp_path, tiny_model_config, tiny_shard_manifest,
                                tiny_tokenizer_manifest):
    fsdp = _launch(tmp_path, "fsdp", _cfg(2, 2, max_steps=2,
                                          distributed=DistributedConfig(
                                              nproc_per_node=2, backend="gloo",
                                              strategy="fsdp2")),
                   tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest)
    one = train(_cfg(1, 4, max_steps=2), tiny_model_config, MaskingConfig(),
                tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "one")
    got, want = _losses(fsdp), _losses(one)
    assert got == pytest.approx(want, rel=1e-5)
    w2, w1 = _weights(fsdp), _weights(one)
    for key in w1:  # the checkpoint holds the full (unsharded) weights
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-6, msg=key)
