"""Runs survive any kill: `mlm-pipeline run` killed at many points and run again, each time
in a fresh process, continues the same MLflow run and ends bit for bit where an
uninterrupted run ends (the resume matrix).

Every case compares with an uninterrupted reference run of the same config (own work
directory and experiment): per-step `train/loss`, `train/lr` and `train/grad_norm` from
MLflow, and every tensor of the final weights. The MLflow checks use `MlflowClient` on the
SQLite store the runs wrote: one run, FINISHED, exactly one value per step for every key.

Slow (two to three CLI runs per case): `pytest -m slow`. The kill cases run their CLI
processes against one Prefect server for the session (`prefect_api_url`) and copy a migrated
MLflow store (`fresh_mlflow_db`): what they prove is the resume, not the start-up. The two
tests about the local Prefect API each `run` starts itself keep it. On every push CI runs the
SIGKILL case between checkpoints in the second epoch; the other kill points and the local API
tests are the `full` tier (one slice per push, all with CI_FULL=1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from mlm_pipeline.train.checkpoint import latest_checkpoint, list_checkpoints, load_model_state
from tests.faults.mlm_faults import child_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
CLI = Path(sys.executable).parent / "mlm-pipeline"
MAX_STEPS = 60
#: Keys whose values depend only on the computation (timing keys are logged once too, but
#: their values differ between processes).
EXACT_KEYS = ("train/loss", "train/lr", "train/grad_norm", "train/masked_tokens")


def _config(tmp: Path, name: str, preset: str, masking: str) -> Path:
    cfg = {
        "name": name,
        "work_dir": str(tmp / "work"),
        "ingest": {"sources": [str(ASSETS / "tiny_fr.txt")], "validation_fraction": 0.1},
        "tokenizer": {"vocab_size": 128},
        "shards": {"seq_len": 32, "rows_per_shard": 16},
        "masking": {"mode": masking, "dupe_factor": 2 if masking == "precomputed" else 1},
        "model": {"preset": preset, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "intermediate_size": 64},
        "train": {"micro_batch_size": 4, "max_steps": MAX_STEPS, "warmup_steps": 3,
                  "log_every": 1, "checkpoint_every": 5, "precision": "fp32", "seed": 3},
        "eval": {"batch_size": 8, "probes": []},
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                     "experiment_name": name, "log_model": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true", **extra)
    return env


def _run(tmp: Path, config: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "run", str(config)], cwd=tmp, env=_env(tmp, **env),
                          capture_output=True, text=True, timeout=600)


def _start(tmp: Path, config: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([str(CLI), "run", str(config)], cwd=tmp, env=_env(tmp, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _train_dirs(tmp: Path) -> list[Path]:
    return sorted((tmp / "work" / "train").glob("*")) if (tmp / "work" / "train").is_dir() else []


def _wait_for(proc: subprocess.Popen, ready, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill point:\n{proc.stdout.read()[-3000:]}")
        if ready():
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("kill point not reached")


def _logged_step(tmp: Path) -> int:
    """Highest step in the run's metrics.jsonl (the loop's own log, flushed per interval)."""
    best = 0
    for d in _train_dirs(tmp):
        log = d / "metrics.jsonl"
        if log.is_file():
            for line in log.read_text().splitlines():
                try:
                    best = max(best, json.loads(line)["step"])
                except ValueError:
                    pass
    return best


def _checkpoint_steps(tmp: Path) -> list[int]:
    return [int(c.name.split("-")[1]) for d in _train_dirs(tmp)
            for c in list_checkpoints(d / "checkpoints")]


def _history(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in run.data.metrics}


def _outcome(tmp: Path, experiment: str) -> dict:
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    (train_dir,) = _train_dirs(tmp)
    weights = load_model_state(latest_checkpoint(train_dir / "checkpoints"))
    return {"runs": runs, "history": {r.info.run_id: _history(client, r.info.run_id)
                                      for r in runs}, "weights": weights}


@pytest.fixture(scope="module")
def references(tmp_path_factory, prefect_api_url, fresh_mlflow_db):
    """`references(preset, masking)`: the outcome of an uninterrupted run of that config,
    run on first use (a slice of the cases needs only its own presets)."""
    out = {}

    def reference(preset: str, masking: str) -> dict:
        if (preset, masking) not in out:
            tmp = tmp_path_factory.mktemp(f"ref-{preset}-{masking}")
            name = f"resume-{preset}-{masking}"
            fresh_mlflow_db(tmp / "mlflow.db")
            proc = _run(tmp, _config(tmp, name, preset, masking), PREFECT_API_URL=prefect_api_url)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            out[(preset, masking)] = _outcome(tmp, name)
        return out[(preset, masking)]

    return reference


def _kill_after_step(step: int, sig: int):
    def kill(tmp, proc):
        _wait_for(proc, lambda: _logged_step(tmp) >= step)
        proc.send_signal(sig)
    return kill


def _kill_after_checkpoint(step: int):
    def kill(tmp, proc):
        _wait_for(proc, lambda: step in _checkpoint_steps(tmp))
        proc.send_signal(signal.SIGKILL)
    return kill


CASES = {
    # name: (preset, masking, kill, extra env of the killed run, expected exit codes)
    "sigkill-between-checkpoints-2nd-epoch": ("modern", "dynamic", _kill_after_step(47, signal.SIGKILL),
                                       {}, {-signal.SIGKILL}),
    "sigint-graceful": ("modern", "dynamic", _kill_after_step(12, signal.SIGINT), {}, {130}),
    "sigterm-dropout": ("bert", "dynamic", _kill_after_step(17, signal.SIGTERM), {}, {130}),
    "right-after-checkpoint-precomputed": ("modern", "precomputed", _kill_after_checkpoint(20),
                                           {}, {-signal.SIGKILL}),
    "mid-checkpoint-write": ("bert", "dynamic", None,
                             child_env(kill_in_checkpoint=15), {-signal.SIGKILL}),
}


#: The case CI runs on every push; the others are the `full` tier.
PUSH_CASE = "sigkill-between-checkpoints-2nd-epoch"


@pytest.mark.parametrize("case", [case if case == PUSH_CASE else pytest.param(
    case, marks=pytest.mark.full) for case in CASES])
def test_killed_run_resumes_bit_for_bit_in_the_same_mlflow_run(case, references, prefect_api_url,
                                                              fresh_mlflow_db, tmp_path,
                                                              record_property):
    preset, masking, kill, env, codes = CASES[case]
    want = references(preset, masking)
    name = f"resume-{preset}-{masking}"
    config = _config(tmp_path, name, preset, masking)
    fresh_mlflow_db(tmp_path / "mlflow.db")
    api = {"PREFECT_API_URL": prefect_api_url}
    proc = _start(tmp_path, config, **api, **env)
    if kill is not None:
        kill(tmp_path, proc)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode in codes, output[-3000:]
    if proc.returncode == 130:  # graceful: a checkpoint of the step reached, and how to go on
        assert "to continue, run the same command" in output
    again = _run(tmp_path, config, **api)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]

    got = _outcome(tmp_path, name)
    (run,) = got["runs"]  # continued, not a second run
    assert run.info.status == "FINISHED"
    assert "mlm.resume.1" in run.data.tags
    history = got["history"][run.info.run_id]
    (ref_history,) = want["history"].values()
    assert set(history) == set(ref_history)
    for key, values in history.items():
        steps = [s for s, _ in values]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {steps}"
        if key.startswith("system/"):  # sampled every 10 s of wall clock: counts vary
            continue
        assert steps == [s for s, _ in ref_history[key]], key
    max_dloss = 0.0
    for key in EXACT_KEYS:
        for (_, a), (_, b) in zip(history[key], ref_history[key]):
            assert a == b, key
            if key == "train/loss":
                max_dloss = max(max_dloss, abs(a - b))
    max_dweight = max(float((got["weights"][k] - w).abs().max())
                      for k, w in want["weights"].items())
    assert max_dweight == 0.0
    for k, w in want["weights"].items():
        assert torch.equal(got["weights"][k], w), k
    record_property("resume", {"case": case, "max_dloss": max_dloss,
                               "max_dweight": max_dweight,
                               "values_per_step": 1, "mlflow_runs": len(got["runs"])})


@pytest.mark.full
def test_no_process_is_left_after_sigterm(tmp_path):
    config = _config(tmp_path, "resume-procs", "modern", "dynamic")
    proc = _start(tmp_path, config)
    _wait_for(proc, lambda: _logged_step(tmp_path) >= 3)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    assert children, "the run should have started its Prefect API"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert time.monotonic() - started < 30
    time.sleep(1)
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
            f"/proc/{pid}/status").read_text().lower(), f"process {pid} outlived the run"


@pytest.mark.full
def test_the_prefect_api_dies_with_a_sigkilled_run(tmp_path):
    config = _config(tmp_path, "resume-orphans", "modern", "dynamic")
    proc = _start(tmp_path, config)
    _wait_for(proc, lambda: _logged_step(tmp_path) >= 2)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in children):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in children)
