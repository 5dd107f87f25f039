"""Concurrent `mlm-pipeline run`s of one config in one work directory all complete: each data
stage is built once, under its stage lock, and reused by the others.

Every run is a fresh process started at the same moment on a cold cache: an empty work
directory, Prefect home (result storage) and MLflow SQLite file that does not exist yet. The
runs must all exit 0 and see the same data-stage outputs: one stage directory per data
stage, the same digests in every run's summary, and every file with the sha256 its manifest
records (computed here from the bytes). No temporary file is left behind.

Slow (each run starts its own Prefect API, on a Prefect home the runs share, cold too: the
start-up lock is part of what is proved): `pytest -m slow`. On every push CI runs the pair
(cold, then warm); five at once is the `full` tier (one slice per push, all with CI_FULL=1).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
CLI = Path(sys.executable).parent / "mlm-pipeline"
DATA_STAGES = ("ingest", "tokenizer", "shards")


def _config(tmp: Path) -> Path:
    cfg = {
        "name": "concurrent",
        "work_dir": str(tmp / "work"),
        "ingest": {"sources": [str(ASSETS / "tiny_fr.txt")], "validation_fraction": 0.1},
        "tokenizer": {"vocab_size": 128},
        "shards": {"seq_len": 32, "rows_per_shard": 16},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "train": {"micro_batch_size": 4, "max_steps": 4, "warmup_steps": 1, "log_every": 2,
                  "precision": "fp32", "seed": 3},
        "eval": {"batch_size": 8, "max_rows": 8, "probes": []},
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                     "experiment_name": "concurrent", "log_model": False},
    }
    path = tmp / "concurrent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="400")
    return env


def _run_at_once(tmp: Path, n: int) -> list[tuple[int, str, float, Path]]:
    """Start `n` runs of the config together; (exit code, output, seconds, summary JSON)
    of each."""
    config = _config(tmp)
    start = time.monotonic()
    runs = len(list(tmp.glob("summary-*.json")))
    summaries = [tmp / f"summary-{runs + i}.json" for i in range(n)]
    procs = [subprocess.Popen([str(CLI), "run", str(config), "--summary-json", str(path)],
                              cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for path in summaries]
    results = []
    for p, path in zip(procs, summaries):
        out, _ = p.communicate(timeout=900)
        results.append((p.returncode, out, time.monotonic() - start, path))
    return results


def _check_outputs(tmp: Path, results: list[tuple[int, str, float, Path]]) -> None:
    failed = [out[-4000:] for code, out, _, _ in results if code != 0]
    assert not failed, f"{len(failed)} of {len(results)} runs failed:\n" + "\n----\n".join(failed)
    work = tmp / "work"
    manifests = {}
    for stage in DATA_STAGES:
        dirs = [d for d in (work / stage).iterdir()]
        assert len(dirs) == 1, (stage, dirs)  # built once, reused by every other run
        manifests[stage] = json.loads((dirs[0] / "manifest.json").read_text())
        listed = _files(manifests[stage])
        assert listed, stage
        for rel, sha in listed.items():
            assert hashlib.sha256((dirs[0] / rel).read_bytes()).hexdigest() == sha, (stage, rel)
        left = [p.name for p in dirs[0].iterdir() if p.name.startswith(".")]
        assert left == [], (stage, left)  # no temporary file left behind
    for *_, summary in results:
        paths = json.loads(summary.read_text())["manifests"]
        for stage in DATA_STAGES:
            seen = json.loads(Path(paths[stage]).read_text())
            assert seen["digest"] == manifests[stage]["digest"], stage
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * len(results)


def _files(manifest) -> dict[str, str]:
    """path -> sha256 of every file entry in a manifest (any depth)."""
    found = {}
    if isinstance(manifest, dict):
        if {"path", "bytes", "sha256"} <= manifest.keys():
            found[manifest["path"]] = manifest["sha256"]
        for value in manifest.values():
            found |= _files(value)
    elif isinstance(manifest, list):
        for value in manifest:
            found |= _files(value)
    return found


@pytest.mark.parametrize("n", [2, pytest.param(5, marks=pytest.mark.full)])
def test_concurrent_runs_on_a_cold_cache_all_complete(tmp_path, n):
    results = _run_at_once(tmp_path, n)
    _check_outputs(tmp_path, results)
    print(f"\n{n} concurrent cold runs: {n} started, "
          f"{sum(r[0] == 0 for r in results)} completed, "
          f"slowest {max(r[2] for r in results):.0f} s")
    if n == 2:  # and warm: both reuse every data stage
        warm = _run_at_once(tmp_path, n)
        _check_outputs(tmp_path, results + warm)
        print(f"{n} concurrent warm runs: {n} started, {sum(r[0] == 0 for r in warm)} completed, "
              f"slowest {max(r[2] for r in warm):.0f} s")
