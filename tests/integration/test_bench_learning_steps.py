"""`benchmarks/bench_learning.py --steps N`: every model trains exactly N optimizer steps
(no wall-clock calibration), and `train.lr: auto` resolves per model recipe (post-LN
`bert` 1e-4, pre-LN `modern` 1e-3), as the JSON it writes reports.

In-process on the `--smoke` data and toy shape (the fresh-process run of the script is
`test_benchmarks_smoke.py`'s); only our two models, so `transformers` is not needed.
Slow: it builds the smoke data and trains two models (seconds on a quiet machine).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learning.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_learning_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a fresh module: `--smoke` edits its SHAPE
    return module


@pytest.mark.slow
def test_steps_trains_exactly_n_steps_and_resolves_lr_auto_per_recipe(tmp_path, capsys):
    out = tmp_path / "out.json"
    bench = load_bench()
    rc = bench.main(["--smoke", "--steps", "3", "--models", "ours-bert,ours-modern",
                     "--work", str(tmp_path / "work"), "--out", str(out),
                     "--set", "train.lr=auto", "--seeds", "0,1", "--downstream", "none",
                     "--mlm-probability", "0.3"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 3 and report["budget_s"] is None
    assert list(report["modes"]) == ["steps"] and report["mlm_probability"] == 0.3
    results = report["modes"]["steps"]
    bert, modern = results["ours-bert"], results["ours-modern"]
    # micro_batch_size 16 (configs/tiny.yaml) x seq_len 32 (the smoke shards) x 3 steps
    for result in (bert, modern):
        assert [r["seed"] for r in result["seeds"]] == [0, 1]
        for row in result["seeds"]:
            assert row["steps"] == 3
            assert row["tokens_seen"] == 3 * 16 * 32
            assert not row["stopped_early"]
            # tiny's warmup_ratio 0.06 of 3 steps rounds to 0; at least one warm-up step
            assert row["warmup_steps"] == 1
        accuracies = [r["eval/mlm_accuracy"] for r in result["seeds"]]
        assert result["eval/mlm_accuracy_mean"] == pytest.approx(sum(accuracies) / 2)
    assert bert["seeds"][0]["lr"] == pytest.approx(5e-4)
    assert modern["seeds"][0]["lr"] == pytest.approx(1e-3)
    printed = capsys.readouterr().out
    assert "3 steps per model" in printed
    assert "every model trained at 0.3 masking, evaluated at 0.15" in printed
    assert "ours-bert seed 0: accuracy" in printed and "peak lr 0.0005" in printed


def test_steps_below_two_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench().main(["--smoke", "--steps", "1"])
    assert exc.value.code == 2
    assert "--steps must be at least 2, got 1" in capsys.readouterr().err
