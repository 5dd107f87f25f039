"""The main job as a user runs it: `mlm-pipeline run tiny` on a slice of the real corpus.

Slow (fetches Debian packages, trains for about a minute): run with `pytest -m slow`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from mlflow.tracking import MlflowClient

from mlm_pipeline.masking.keyed import mask_tokens

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _rows(manifest: dict, split: str) -> np.ndarray:
    """Read token rows with plain pyarrow (not the project's reader)."""
    out = []
    for shard in manifest[split]["shards"]:
        with pa.memory_map(str(Path(manifest["output_dir"]) / shard["path"])) as src:
            table = pa.ipc.open_file(src).read_all()
        out.append(np.stack(table.column("input_ids").to_pylist()))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    mlm_pipeline = Path(sys.executable).parent / "mlm-pipeline"  # the console script
    cmd = [str(mlm_pipeline), "run", "tiny",
           "--set", f"work_dir={tmp / 'work'}",
           "--set", "ingest.max_documents=1200",
           "--set", "train.max_steps=250",
           "--set", "train.warmup_steps=25",
           "--set", "train.checkpoint_every=null",
           "--summary-json", str(tmp / "summary.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp / "summary.json").read_text())
    return summary, MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]), proc.stdout


def test_run_prints_run_id_and_metrics(run):
    summary, _, stdout = run
    assert summary["mlflow_run_id"] in stdout
    assert "eval/mlm_accuracy" in stdout


def test_mlflow_run_has_params_metrics_artifacts(run):
    summary, client, _ = run
    r = client.get_run(summary["mlflow_run_id"])
    assert r.info.status == "FINISHED"
    assert r.data.params["ingest.sources"] == "debian:fr"
    assert r.data.params["train.max_steps"] == "250"
    assert r.data.metrics["data/documents_read"] == 1200
    tops = {a.path for a in client.list_artifacts(r.info.run_id)}
    # the resumable training state stays local (tracking.log_training_state is off);
    # the model leaves as the run's MLflow model, registered
    assert {"tokenizer", "manifests", "eval", "train"} <= tops
    assert "checkpoints" not in tops
    assert r.data.tags["registry.decision"] in ("first", "promoted", "kept", "not_compared")
    losses = [m.value for m in client.get_metric_history(r.info.run_id, "train/loss")]
    tenth = max(1, len(losses) // 10)
    assert np.mean(losses[-tenth:]) < np.mean(losses[:tenth])


def test_accuracy_beats_the_most_frequent_token(run):
    summary, client, _ = run
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    shards = json.loads(Path(summary["manifests"]["shards"]).read_text())
    train_rows = _rows(shards, "train")
    counts = np.bincount(train_rows.ravel(), minlength=shards["vocab_size"])
    counts[:5] = -1  # special ids are never predicted
    top = int(counts.argmax())
    valid = torch.from_numpy(_rows(shards, "validation").astype(np.int64))
    valid = valid[: int(metrics["eval/rows"])]
    params = client.get_run(summary["mlflow_run_id"]).data.params
    _, labels = mask_tokens(
        valid, vocab_size=shards["vocab_size"], row_index=torch.arange(len(valid)),
        seed=int(params["eval.seed"]), epoch=0,
        mlm_probability=float(params["masking.mlm_probability"]),
        mask_replace_prob=float(params["masking.mask_replace_prob"]),
        random_replace_prob=float(params["masking.random_replace_prob"]),
    )
    predicted = labels[labels != -100]
    assert len(predicted) == metrics["eval/masked_tokens"]
    baseline = float((predicted == top).float().mean())
    assert metrics["eval/baseline_accuracy"] == pytest.approx(baseline)
    assert metrics["eval/mlm_accuracy"] > baseline
