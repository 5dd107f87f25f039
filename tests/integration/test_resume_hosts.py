"""Which unfinished MLflow run a rerun continues (`tracking.resume.find_resumable`), by the
host and process that ran it: a real MLflow store (SQLite), real runs and tags.

A RUNNING run of another host may still be training (a shared MLflow server, an `s3://`
work directory seen by several machines): it is neither continued nor closed. A RUNNING
run of this host whose process is gone is continued from its checkpoint.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from mlm_pipeline.config import PipelineConfig, TrackingConfig
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking.records import run_params


def _dead_pid() -> int:
    """The pid of a process that has exited (reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _setup(tmp_path: Path, host: str, pid: int) -> tuple[MlflowTracker, PipelineConfig, str]:
    cfg = PipelineConfig(work_dir=str(tmp_path / "work"), tracking=TrackingConfig(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="hosts"))
    tracker = MlflowTracker.from_config(cfg.tracking)
    run_id = tracker.start_run(run_params(cfg), {
        resume.JOB_KEY_TAG: resume.job_key(cfg), resume.HOST_TAG: host,
        resume.PID_TAG: str(pid)})
    return tracker, cfg, run_id


def test_a_running_run_of_another_host_is_left_alone(tmp_path, caplog):
    tracker, cfg, run_id = _setup(tmp_path, "another-host.example", _dead_pid())
    checkpoint = tmp_path / "step-00000005"
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.tracking.resume"):
        found = resume.find_resumable(tracker, cfg, run_params(cfg), lambda _: checkpoint)
    assert found is None
    assert tracker.get_run(run_id).info.status == "RUNNING"  # not closed either
    assert any("another-host.example" in r.getMessage() and
               f"tracking.resume_run_id={run_id}" in r.getMessage() for r in caplog.records)


def test_a_running_run_of_a_dead_process_here_is_continued(tmp_path):
    import socket

    tracker, cfg, run_id = _setup(tmp_path, socket.gethostname(), _dead_pid())
    checkpoint = tmp_path / "step-00000005"
    found = resume.find_resumable(tracker, cfg, run_params(cfg), lambda _: checkpoint)
    assert found is not None and (found.run_id, found.checkpoint) == (run_id, checkpoint)
