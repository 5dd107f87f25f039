"""The warm-start saving of `benchmarks/bench_retrain.py` (its slow smoke run is in
tests/integration/test_benchmarks_smoke.py): the step at which the from-scratch curve
reaches the warm start's final loss, on curves whose answer is worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_retrain.py"


def _saving_lines():
    spec = importlib.util.spec_from_file_location("bench_retrain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.saving_lines


PARENT = {5: (6.0, 0.0), 10: (5.5, 0.0)}  # the champion's own curve: 10 steps on v1


def test_scratch_reaching_the_loss_between_two_points_is_interpolated():
    warm = {10: (4.2, 0.30), 20: (4.0, 0.35)}
    cold = {10: (4.5, 0.20), 20: (3.5, 0.40)}
    # 4.0 lies halfway from 4.5 (step 10) to 3.5 (step 20): step 15, 5 of 20 saved
    text = "\n".join(_saving_lines()(warm, cold, PARENT))
    assert "| 10 | 4.2000 | 4.5000 | +0.3000 | 0.3000 | 0.2000 |" in text
    assert "| 20 | 4.0000 | 3.5000 | -0.5000 | 0.3500 | 0.4000 |" in text
    assert "reaches 4.0000 at about step 15 of 20" in text
    assert "saves about 5 of 20 steps" in text
    assert "trained 10 steps on v1 before: 30 steps in all against 20" in text


def test_scratch_that_never_reaches_the_loss_gives_no_step_count():
    warm = {10: (4.2, 0.3), 20: (4.0, 0.35)}
    cold = {10: (5.0, 0.1), 20: (4.01, 0.2)}
    text = "\n".join(_saving_lines()(warm, cold, PARENT))
    assert "0.0100 nats lower" in text
    assert "From scratch does not reach 4.0000 within 20 steps" in text
    assert "saves about" not in text


def test_scratch_below_at_its_first_point_reaches_it_there():
    warm = {10: (4.2, 0.3), 20: (4.0, 0.35)}
    cold = {10: (3.9, 0.4), 20: (3.0, 0.5)}
    text = "\n".join(_saving_lines()(warm, cold, PARENT))
    assert "reaches 4.0000 at about step 10 of 20" in text
