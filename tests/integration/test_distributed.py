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
from mlm_pipeline.train.data import RowCursor
from mlm_pipeline.train.launch import (
    DistributedTrainingError,
    _error_handler,
    read_launch_inputs,
    root_cause,
    run_torchrun,
    sink_line_step,
    torchrun_command,
    write_launch_inputs,
)
from tests.faults.mlm_faults import FAIL_RANK_AT_STEP, child_env


def slow(test):
    """Every torchrun test starts two interpreters importing torch (about 20 s each
    launch): `slow`, and the `full` tier (one slice of the landings in CI); the flow's
    two-rank run (tests/flows/test_distributed_flow.py) is the pair run on every push."""
    return pytest.mark.slow(pytest.mark.full(test))


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


def _launch(tmp_path, name, cfg, model_cfg, shards, tok, lines=None):
    return run_torchrun(cfg, model_cfg, MaskingConfig(), shards, tok, tmp_path / name,
                        on_line=(lines.append if lines is not None else lambda _: None))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@slow
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
    # ... from which a launcher follows the progress: steps 1-4, once each
    assert [s for s in map(sink_line_step, lines) if s is not None] == [1, 2, 3, 4]


@slow
def test_failing_rank_names_rank_and_exception(tmp_path, monkeypatch, tiny_model_config,
                                               tiny_shard_manifest, tiny_tokenizer_manifest):
    for name, value in child_env(fail_rank_at_step=(1, 2)).items():  # torchrun's ranks
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedTrainingError,
                       match=r"rank 1: RuntimeError: injected fault") as e:
        _launch(tmp_path, "fail", _cfg(2, 2), tiny_model_config, tiny_shard_manifest,
                tiny_tokenizer_manifest)
    assert e.value.rank == 1 and e.value.returncode != 0


@slow
def test_resume_after_failure_matches_uninterrupted(tmp_path, monkeypatch, tiny_model_config,
                                                    tiny_shard_manifest,
                                                    tiny_tokenizer_manifest):
    args = (tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest)
    whole = _launch(tmp_path, "whole", _cfg(2, 2), *args)
    for name, value in child_env(fail_rank_at_step=(0, 3)).items():  # after checkpoint 2
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedTrainingError, match="rank 0"):
        _launch(tmp_path, "cut", _cfg(2, 2), *args)
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == [
        "step-00000002"]
    monkeypatch.delenv(FAIL_RANK_AT_STEP)
    resumed = _launch(tmp_path, "cut", _cfg(2, 2), *args)
    assert _losses(resumed) == _losses(whole)  # exact, steps 1-4 once each
    w, r = _weights(whole), _weights(resumed)
    assert all(torch.equal(w[k], r[k]) for k in w)
    # the two-rank checkpoint does not resume in one process: both world sizes named
    shutil.copytree(tmp_path / "cut" / "checkpoints", tmp_path / "single" / "checkpoints")
    with pytest.raises(ValueError, match="world size 2.*world size 1"):
        train(_cfg(1, 4, max_steps=6), tiny_model_config, MaskingConfig(),
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "single")


@slow
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


def test_ranks_read_the_rows_of_one_process_batches():
    # 23 rows: rank 0's strided slice holds 12, rank 1's 11; both must end epochs together
    ranks = [RowCursor(23, batch_size=2, seed=3, rank=r, world_size=2) for r in (0, 1)]
    one = RowCursor(23, batch_size=4, seed=3)
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == 23 // 4
    for _ in range(3 * 23 // 4 + 1):  # across three epoch boundaries
        (rows0, epoch0), (rows1, epoch1) = (c.next_batch() for c in ranks)
        rows, epoch = one.next_batch()
        assert epoch0 == epoch1 == epoch
        assert sorted([*rows0, *rows1]) == sorted(rows)


def test_cursor_state_is_rank_agnostic_but_tied_to_the_world_size():
    saved = RowCursor(40, batch_size=5, seed=1, rank=0, world_size=2)
    saved.next_batch()
    other_rank = RowCursor(40, batch_size=5, seed=1, rank=1, world_size=2)
    other_rank.load_state_dict(saved.state_dict())  # rank 0's checkpoint resumes rank 1
    assert other_rank.offset == 1
    with pytest.raises(ValueError, match="world size 2.*world size 4"):
        RowCursor(40, batch_size=5, seed=1, rank=0, world_size=4).load_state_dict(
            saved.state_dict())


def test_root_cause_is_the_first_rank_to_fail(tmp_path, monkeypatch):
    # torch's elastic error files, written by the entry point's handler, rank 1 first
    for rank in (1, 0):
        path = tmp_path / "run" / "attempt_0" / str(rank) / "error.json"
        path.parent.mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setenv("RANK", str(rank))
        try:
            raise RuntimeError(f"failure {rank}")
        except RuntimeError as exc:
            _error_handler().record_exception(exc)
    rank, message = root_cause(tmp_path)
    assert rank == 1
    assert message.startswith("RuntimeError: failure 1")
    assert root_cause(tmp_path / "empty") is None


def test_train_refuses_several_ranks_outside_torchrun(tmp_path, monkeypatch, tiny_model_config,
                                                      tiny_shard_manifest,
                                                      tiny_tokenizer_manifest):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="asks for 2 processes.*not started by torchrun"):
        train(_cfg(2, 2), tiny_model_config, MaskingConfig(), tiny_shard_manifest,
              tiny_tokenizer_manifest, tmp_path / "run")


def test_torchrun_command_and_rendezvous_rule(tmp_path):
    one_node = _cfg(4, 2)
    cmd = torchrun_command(one_node, tmp_path / "in.json", tmp_path, tmp_path / "logs")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[-6:-4] == ["-m", "mlm_pipeline.train.launch"]
    other = torchrun_command(one_node, tmp_path / "in.json", tmp_path, tmp_path / "logs",
                             entry="mlm_pipeline.app.torchrun_entry")
    assert other[-6:] == ["-m", "mlm_pipeline.app.torchrun_entry", "--inputs",
                          str(tmp_path / "in.json"), "--out-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="nnodes 2 needs rdzv_endpoint"):
        DistributedConfig(nproc_per_node=8, nnodes=2)
    two = _cfg(1, 2, distributed=DistributedConfig(nproc_per_node=8, nnodes=2,
                                                   rdzv_endpoint="head:29400"))
    assert two.distributed.world_size == 16
    cmd = torchrun_command(two, tmp_path / "in.json", tmp_path, tmp_path / "logs")
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "head:29400" and "--standalone" not in cmd


def test_launch_inputs_round_trip_with_an_entrys_extra(tmp_path, tiny_model_config,
                                                       tiny_shard_manifest,
                                                       tiny_tokenizer_manifest):
    cfg, extra = _cfg(2, 2), {"run_id": "abc", "nested": {"uri": "sqlite:///x.db"}}
    path = write_launch_inputs(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                               tiny_tokenizer_manifest, tmp_path, extra)
    back = read_launch_inputs(path)
    assert (back.train, back.model, back.masking) == (cfg, tiny_model_config, MaskingConfig())
    assert back.shards == tiny_shard_manifest and back.tokenizer == tiny_tokenizer_manifest
    assert back.extra == extra
    data = json.loads(path.read_text())
    del data["shards"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"inputs\.json: section 'shards' is missing"):
        read_launch_inputs(path)


def test_sink_line_step_reads_rank_0_metric_lines_only():
    assert sink_line_step("[rank 0] INFO mlm_pipeline.sinks: step 12 | train/loss 5.1") == 12
    assert sink_line_step("[rank 1] INFO mlm_pipeline.sinks: step 12 | train/loss 5.1") is None
    assert sink_line_step("[rank 0] INFO mlm_pipeline.train.stage: step 12 | resumed") is None
    assert sink_line_step("[rank 0] WARNING mlm_pipeline.sinks: step 3 | x 1") is None
