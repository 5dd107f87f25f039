"""Ctrl-C on `mlm-pipeline run ... | tee log`: the terminal's SIGINT reaches both, and the
reader of the run's stdout is gone (here from the start, as with `| head -c0`). The run must
still exit 130 and say on stderr how to continue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

# a variant of the signal proofs: one slice of the landings in CI (the SIGKILL resume case
# and the in-process stop tests run on every push)
pytestmark = [pytest.mark.slow, pytest.mark.full]

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "mlm-pipeline"


def _logged_step(work: Path) -> int:
    best = 0
    for log in (work / "train").glob("*/metrics.jsonl"):
        for line in log.read_text().splitlines():
            try:
                best = max(best, json.loads(line)["step"])
            except ValueError:
                pass
    return best


@pytest.mark.parametrize("piped", ["stdout", "stdout-and-stderr"])
def test_ctrl_c_behind_a_closed_pipe_exits_130_with_the_continue_line(tmp_path, piped,
                                                                      fresh_mlflow_db):
    """`| head -c0` (stderr kept: the line must be there) and `2>&1 | head -c0` (the line
    cannot reach the pipe; the exit status must still be 130, not a BrokenPipeError's 1
    or the 120 of a failed flush at exit)."""
    fresh_mlflow_db(tmp_path / "mlflow.db")
    cfg = {
        "name": "pipe", "work_dir": str(tmp_path / "work"),
        "ingest": {"sources": [str(ROOT / "tests" / "assets" / "tiny_fr.txt")],
                   "validation_fraction": 0.1},
        "tokenizer": {"vocab_size": 128}, "shards": {"seq_len": 32, "rows_per_shard": 16},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
        "train": {"micro_batch_size": 4, "max_steps": 100_000, "warmup_steps": 3,
                  "log_every": 1, "checkpoint_every": 1000, "precision": "fp32"},
        "eval": {"batch_size": 8, "probes": []}, "linear_probe": {"enabled": False},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                     "experiment_name": "pipe", "log_model": False},
    }
    config = tmp_path / "pipe.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"),  # the run starts its local API
               PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true")
    read_end, write_end = os.pipe()  # stdout to `head -c0`, which exits at once
    os.close(read_end)
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen([str(CLI), "run", str(config)], cwd=tmp_path, env=env,
                                stdout=write_end,
                                stderr=err if piped == "stdout" else write_end)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 420
        while _logged_step(tmp_path / "work") < 3:
            assert proc.poll() is None, f"exit {proc.returncode} before training: " + (
                tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 130, stderr[-3000:]
    if piped == "stdout":
        assert "to continue, run the same command: mlm-pipeline run" in stderr
        assert "BrokenPipeError" not in stderr
