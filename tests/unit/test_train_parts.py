"""The Stateful parts of the training loop: the `Checkpointer` with fakes (STYLE rule 14),
the `Meter`'s open interval and `TrainState`."""

from __future__ import annotations

import json

import pytest
import torch

from mlm_pipeline.train.checkpoint import (
    LAYOUT,
    Checkpointer,
    list_checkpoints,
    read_state,
    seal_state,
)
from mlm_pipeline.train.loop import TrainState
from mlm_pipeline.train.meter import Meter
from tests.fakes import FakePart, fake_parts


def _parts(seed: int) -> dict[str, FakePart]:
    """Random tensor states for the `.pt` parts, JSON values for the `state.json` ones."""
    return fake_parts(seed, random=True)


def test_round_trip_under_fixed_keys(tmp_path):
    saved = _parts(1)
    meta = {"config": {"model": {"hidden_size": 8}}, "seq_len": 16}
    path = Checkpointer(tmp_path, saved, meta).save(step=7)
    assert path.name == "step-00000007"
    assert {p.name for p in path.iterdir()} == {f for f, _ in LAYOUT.values()}
    state = read_state(path)
    assert state["format"] == 3 and state["seq_len"] == 16 and state["masker"]["name"] == "masker"

    loaded = _parts(2)
    Checkpointer(tmp_path, loaded, meta).load(path)
    for name, part in loaded.items():
        if isinstance(part.state, dict) and "w" in part.state:
            torch.testing.assert_close(part.state["w"], saved[name].state["w"], rtol=0, atol=0)
        else:
            assert part.state == saved[name].state


def test_keep_last_and_partial_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path, _parts(0), {}, keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step)
    (tmp_path / ".step-00000004.tmp").mkdir()  # a crash while writing step 4
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert ckpt.latest().name == "step-00000003"


def test_parts_and_meta_are_checked(tmp_path):
    parts = _parts(0)
    with pytest.raises(ValueError, match="must be"):
        Checkpointer(tmp_path, {k: v for k, v in parts.items() if k != "masker"}, {})
    with pytest.raises(ValueError, match="reserved"):
        Checkpointer(tmp_path, parts, {"cursor": 1})


def test_a_missing_part_state_is_refused(tmp_path):
    path = Checkpointer(tmp_path, _parts(0), {}).save(1)
    state = json.loads((path / "state.json").read_text())
    del state["meter"]
    (path / "state.json").write_text(json.dumps(seal_state(state)))  # intact, but no meter
    with pytest.raises(ValueError, match="'meter'"):
        Checkpointer(tmp_path, _parts(1), {}).load(path)


def test_meter_resumes_its_open_interval_bit_for_bit():
    def run(steps, resume_after=None):
        meter = Meter(torch.device("cpu"), tokens_per_step=64, flops_per_token=1e3,
                      peak_flops=None)
        meter.start()
        g = torch.Generator().manual_seed(0)
        for i in range(steps):
            if i == resume_after:
                fresh = Meter(torch.device("cpu"), 64, 1e3, None)
                fresh.load_state_dict(json.loads(json.dumps(meter.state_dict())))
                fresh.start()
                meter = fresh
            meter.update(torch.rand((), generator=g) * 100, torch.randint(1, 9, (), generator=g))
        return meter.report(step=steps, lr=1e-3, grad_norm=torch.tensor(0.5), epoch=0,
                            tokens_seen=steps * 64)

    whole, resumed = run(5), run(5, resume_after=3)
    assert resumed["train/loss"] == whole["train/loss"]
    assert "train/mfu_pct" not in whole and whole["train/tokens_per_s"] > 0
    assert whole["train/grad_norm"] == 0.5


def test_meter_report_starts_a_new_interval_and_names_a_bad_step():
    meter = Meter(torch.device("cpu"), 16, 1.0, peak_flops=1e9)
    meter.update(torch.tensor(6.0), torch.tensor(3))
    first = meter.report(step=1, lr=0.1, grad_norm=1.0, epoch=2, tokens_seen=16)
    assert first["train/loss"] == 2.0 and first["train/epoch"] == 2.0
    assert first["train/mfu_pct"] > 0
    assert meter.state_dict()["steps"] == 0 and meter.state_dict()["masked_sum"] == 0
    meter.update(torch.tensor(float("nan")), torch.tensor(1))
    with pytest.raises(RuntimeError, match="step 2"):
        meter.report(step=2, lr=0.1, grad_norm=1.0, epoch=2, tokens_seen=32)


def test_train_state_round_trip():
    state = TrainState(step=3, tokens_seen=192)
    other = TrainState()
    other.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert other == state
