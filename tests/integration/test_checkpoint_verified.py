"""Every reader of a checkpoint verifies it (`train.verified`): `fill-mask` and `export`
refuse a flipped tensor and an edited `state.json` naming the file, pick the newest
*intact* checkpoint of a run directory, refuse a declared size its tensors do not have
before allocating, and refuse a checkpoint without a digest unless trusted; a killed
writer's temporary directory goes at the next save; a run that restarts from step 0 logs
each step once.

The run is trained once per module (4 steps, checkpoints at 2 and 4); each test tampers
with its own copy. Expected outcomes are worked out from the tampering, never from the
code under test.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_pipeline import cli
from mlm_pipeline.config import TrainConfig
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import (
    STATE_DIGEST,
    Checkpointer,
    list_checkpoints,
    seal_state,
)
from tests.fakes import fake_parts

TEXT = "Le [MASK] est là."


def _train_cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"micro_batch_size": 4, "max_steps": 4, "warmup_steps": 0,
                          "checkpoint_every": 2, "keep_last_checkpoints": 2, "log_every": 1,
                          "precision": "fp32", **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    root = tmp_path_factory.mktemp("verified")
    train(_train_cfg(), tiny_model_config, _masking(), tiny_shard_manifest,
          tiny_tokenizer_manifest, root / "run")
    return root / "run"


def _masking():
    from mlm_pipeline.config import MaskingConfig

    return MaskingConfig()


@pytest.fixture()
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


@pytest.fixture()
def spm(tiny_tokenizer_manifest) -> str:
    return str(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path))


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _flip_a_tensor_byte(checkpoint: Path) -> Path:
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor's data: the file parses, the value differs
    weights.write_bytes(bytes(data))
    return weights


def _edit_state(checkpoint: Path, edit) -> Path:
    path = checkpoint / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state, indent=2))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`mlm-pipeline ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "mlm_pipeline.cli", *args],
                          capture_output=True, text=True, timeout=300)


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("mlm-pipeline: error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def _one_step_later(state):
    state["train_state"]["step"] += 1  # 4 -> 5: a resume would start at a wrong step


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings in CI; the same checks run in-process on every push
def test_fresh_processes_refuse_a_flipped_tensor_and_an_edited_state(
        run, spm, tmp_path, tiny_tokenizer_manifest):
    weights = _flip_a_tensor_byte(_step(run, 4))
    _refused(_cli("fill-mask", str(_step(run, 4)), spm, TEXT), str(weights), "sha256")
    state = _edit_state(_step(run, 2), _one_step_later)
    proc = _cli("export", str(_step(run, 2)), str(tmp_path / "out"),
                "--tokenizer", str(tiny_tokenizer_manifest.output_dir))
    _refused(proc, str(state), "digest")
    assert not (tmp_path / "out").exists()


def test_fill_mask_and_export_refuse_a_flipped_tensor_and_an_edited_state(
        run, spm, tmp_path, tiny_tokenizer_manifest, capsys):
    weights = _flip_a_tensor_byte(_step(run, 4))
    state = _edit_state(_step(run, 2), _one_step_later)
    tok = ["--tokenizer", str(tiny_tokenizer_manifest.output_dir)]
    for checkpoint, named in ((_step(run, 4), weights), (_step(run, 2), state)):
        assert cli.main(["fill-mask", str(checkpoint), spm, TEXT]) == 1
        assert str(named) in capsys.readouterr().err
        assert cli.main(["export", str(checkpoint), str(tmp_path / "out"), *tok]) == 1
        assert str(named) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_directory_means_its_newest_intact_checkpoint(run, spm, capsys):
    assert cli.main(["fill-mask", str(_step(run, 2)), spm, TEXT]) == 0
    from_step2 = json.loads(capsys.readouterr().out)
    assert cli.main(["fill-mask", str(_step(run, 4)), spm, TEXT]) == 0
    assert json.loads(capsys.readouterr().out) != from_step2  # the two really differ
    _flip_a_tensor_byte(_step(run, 4))
    for source in (run, run / "checkpoints"):
        assert cli.main(["fill-mask", str(source), spm, TEXT]) == 0
        assert json.loads(capsys.readouterr().out) == from_step2
    _edit_state(_step(run, 2), lambda s: s.update(seq_len=s["seq_len"] + 1))
    assert cli.main(["fill-mask", str(run), spm, TEXT]) == 1  # none intact: refused
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "step-00000004" in err and "step-00000002" in err


def test_a_huge_declared_size_is_refused_before_allocating(run, spm, tmp_path, capsys):
    # Sealed: the digests match, only the declared size is a lie (2e9 * hidden * 4 bytes
    # would be ~1 TB with a real model; the refusal comes from the tensors' header).
    path = _step(run, 4) / "state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps(seal_state({**state, "vocab_size": 2_000_000_000})))
    assert cli.main(["fill-mask", str(_step(run, 4)), spm, TEXT]) == 1
    err = capsys.readouterr().err
    assert "vocab_size 2000000000" in err and "word_embeddings" in err and str(path) in err
    assert cli.main(["export", str(_step(run, 4)), str(tmp_path / "out")]) == 1
    assert "vocab_size 2000000000" in capsys.readouterr().err


def test_a_checkpoint_without_digests_is_refused_unless_trusted(run, spm, capsys):
    def old_format(state):
        del state["files"], state[STATE_DIGEST]

    path = _edit_state(_step(run, 4), old_format)
    assert cli.main(["fill-mask", str(_step(run, 4)), spm, TEXT]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "cannot be verified" in err and "--trust-unverified" in err
    assert cli.main(["fill-mask", str(_step(run, 4)), spm, TEXT, "--trust-unverified"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["text"] == TEXT
    # Deleting only the `files` record leaves a digest that no longer matches: damaged.
    _edit_state(_step(run, 2), lambda s: s.pop("files"))
    assert cli.main(["fill-mask", str(_step(run, 2)), spm, TEXT, "--trust-unverified"]) == 1
    assert "differs from its digest" in capsys.readouterr().err


def test_a_killed_writers_temporary_directory_goes_at_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)  # that process has exited
    host = socket.gethostname()
    left = [tmp_path / f".step-00000003.{host}.{dead_pid}.tmp",
            tmp_path / f".step-00000003.{dead_pid}.tmp"]  # a name from before hosts
    kept = [tmp_path / f".step-00000003.{host}.{os.getppid()}.tmp",  # a live writer
            tmp_path / f".step-00000003.other-host.{dead_pid}.tmp"]  # another host's
    for d in left + kept:
        d.mkdir()
        (d / "optimizer.pt").write_bytes(b"partial")
    Checkpointer(tmp_path, fake_parts(0), {}).save(4)
    assert [d for d in left if d.exists()] == []
    assert all(d.is_dir() for d in kept)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]


def test_a_restart_from_step_0_logs_each_step_once(run, tiny_model_config, tiny_shard_manifest,
                                                   tiny_tokenizer_manifest):
    for step in (2, 4):
        _flip_a_tensor_byte(_step(run, step))  # every checkpoint damaged
    (run / "manifest.json").unlink()  # as if the process had been killed after step 4
    again = train(_train_cfg(), tiny_model_config, _masking(), tiny_shard_manifest,
                  tiny_tokenizer_manifest, run)
    steps = [json.loads(line)["step"] for line in
             again.file(again.metrics_log).read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
