"""The main job on a busy machine: `mlm-pipeline run tiny` while two CPU-bound processes keep
both cores busy must start its Prefect API, train every step it was asked for and finish.

The README's command trains 800 steps (3 to 4 minutes on a quiet machine, more than
twice that here); to keep CI short this runs it with 50 steps (a periodic evaluation at 25
and the final one: every kind of work the main job does between start-up and stop), on a
copy of the session's ingested corpus and tokenizer (`debian_tiny_data`: the run reuses
both), without the model export and the linear probe, which exercises the same start-up and
stop logic. The full command under load is recorded in benchmarks/RESULTS.md. Slow, and the
`full` tier: CI runs it in one slice of the landings, every one with CI_FULL=1. It keeps its own local Prefect API
(its start under load is what it proves).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.full]
ROOT = Path(__file__).resolve().parents[2]
BURN = "import time\nend = time.time() + 900\nwhile time.time() < end:\n    pass\n"


def test_main_job_trains_every_step_with_both_cores_busy(tmp_path, debian_tiny_data):
    shutil.copytree(debian_tiny_data[0], tmp_path / "work")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(2)]
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
        env.update(PREFECT_HOME=str(tmp_path / "prefect"),
                   MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        cmd = [str(Path(sys.executable).parent / "mlm-pipeline"), "run", "tiny",
               "--set", f"work_dir={tmp_path / 'work'}",
               "--set", "train.max_steps=50",
               "--set", "eval.every_steps=25",
               "--set", "tracking.log_model=false",
               "--set", "linear_probe.enabled=false",
               "--summary-json", str(tmp_path / "summary.json")]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1500)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 50
    assert summary["stop_reason"] == "max_steps"
    assert not summary["stopped_early"]
    assert "Reused:        ingest, tokenizer" in proc.stdout  # the session's, copied
