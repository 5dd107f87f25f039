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
    assert r.data.params["data.documents_read"] == "1200"
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


def test_validation_curve_table_plot_and_linear_probe(run, tmp_path):
    """The shipped config evaluates every 100 steps: points at 100 and 200, the final
    evaluation at 250; the fill-mask table holds every evaluation; the loss plot and the
    downstream probe (with its TF-IDF baseline) are on the run."""
    summary, client, _ = run
    run_id = summary["mlflow_run_id"]
    curve = {m.step: m.value for m in client.get_metric_history(run_id, "eval/loss")}
    assert sorted(curve) == [100, 200, 250]
    assert curve[250] == pytest.approx(summary["metrics"]["eval/loss"])
    path = client.download_artifacts(run_id, "eval/fill_mask_table.json", str(tmp_path))
    table = json.loads(Path(path).read_text())  # pandas orient="split": columns, data
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert sorted({r["step"] for r in rows}) == [100, 200, 250]
    probes = len({r["sentence"] for r in rows})
    assert probes >= 2 and len(rows) == 3 * probes * 5
    paths = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert "plots/loss.png" in paths
    metrics = client.get_run(run_id).data.metrics
    if "probe/accuracy" in metrics:  # skipped (with a warning) when PyPI is unreachable
        assert 0.5 < metrics["probe/tfidf_accuracy"] < 0.95
        assert metrics["probe/majority_accuracy"] == pytest.approx(0.57, abs=0.02)
