"""The run summary marks stages reused from an earlier run, reports the mean training speed
over the training loop's time and the last interval's, the stop reason, device, precision,
the MFU peak and package versions (also MLflow tags from the run's start)."""

from __future__ import annotations

from pathlib import Path

from mlm_pipeline.manifest import EvalManifest, Manifest, TrainManifest
from mlm_pipeline.app.summary import summary, summary_markdown
from mlm_pipeline.tracking.tracker import MlflowTracker


def _base(stage: str, created_at: float, wall: float) -> dict:
    return {"stage": stage, "digest": stage * 4, "output_dir": f"/w/{stage}", "config": {},
            "inputs": {}, "created_at": created_at, "wall_time_s": wall}


def _stage(stage: str, created_at: float, wall: float) -> Manifest:
    return Manifest(**_base(stage, created_at, wall))


def _run(tracker: MlflowTracker) -> str:
    """A run in the tracker's store: the summary reads its experiment for the UI links."""
    return tracker.client.create_run(tracker.client.create_experiment("summary")).info.run_id


def test_reused_stages_and_mean_speed(tmp_path, tiny_tokenizer_manifest):
    run_start = 1_000.0
    trained = TrainManifest(**_base("train", 1_010.0, 40.0), checkpoint_dir="ckpt/step-10",
                            steps=10, tokens_seen=20_480, final_metrics={"train/loss": 5.0},
                            metrics_log="metrics.jsonl", stopped_early=False, device="cpu",
                            precision="fp32")
    evaluated = EvalManifest(**_base("evaluate", 1_060.0, 3.0), metrics={"eval/accuracy": 0.25},
                             probes=[])
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run1 = _run(tracker)
    tokenizer = tiny_tokenizer_manifest.model_copy(update={"created_at": 950.0,
                                                           "wall_time_s": 4.0})
    out = summary(tracker, run1, _stage("ingest", 900.0, 7.5), tokenizer,
                  _stage("shards", 1_001.0, 2.0), trained, evaluated, started_at=run_start)
    # ingest and tokenizer were made before this run started; shards, train, evaluate in it.
    assert out["reused_stages"] == ["ingest", "tokenizer"]
    assert out["train_tokens_per_s_mean"] == 512.0  # 20,480 tokens / 40 s
    assert out["wall_time_s"]["ingest"] == 7.5
    model = Path(tiny_tokenizer_manifest.output_dir) / "spm.model"
    assert out["tokenizer_model"] == str(model) and model.is_file()
    md = summary_markdown(out)
    assert "| ingest | reused (7.5 when made) |" in md
    assert "| shards | 2.0 |" in md
    assert "mean 512 tokens/s over the run" in md
    # Without a start time nothing is called reused.
    assert summary(tracker, run1, _stage("ingest", 900.0, 7.5), tokenizer,
                   _stage("shards", 1_001.0, 2.0), trained, evaluated)["reused_stages"] == []


def test_summary_speeds_stop_reason_device_and_versions(tmp_path, tiny_tokenizer_manifest):
    import mlflow
    import pyarrow
    import sentencepiece
    import torch

    trained = TrainManifest(**_base("train", 1_010.0, 40.0), checkpoint_dir="ckpt/step-10",
                            steps=10, tokens_seen=20_480,
                            final_metrics={"train/loss": 5.0, "train/tokens_per_s": 900.0},
                            metrics_log="metrics.jsonl", stopped_early=True,
                            stop_reason="time_cap", device="cpu", precision="bf16",
                            train_time_s=32.0, peak_tflops=0.25, peak_source="measured")
    evaluated = EvalManifest(**_base("evaluate", 1_060.0, 3.0), metrics={}, probes=[])
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run1 = _run(tracker)
    out = summary(tracker, run1, _stage("ingest", 900.0, 7.5), tiny_tokenizer_manifest,
                  _stage("shards", 1_001.0, 2.0), trained, evaluated)
    # Over the training loop's 32 s (both segments), not the stage's 40 s of wall time.
    assert out["train_tokens_per_s_mean"] == 640.0 and out["train_time_s"] == 32.0
    assert out["train_tokens_per_s_last"] == 900.0
    assert (out["stop_reason"], out["device"], out["precision"]) == ("time_cap", "cpu", "bf16")
    assert (out["mfu_peak_tflops"], out["mfu_peak_source"]) == (0.25, "measured")
    want = {"torch": torch.__version__, "mlflow": mlflow.__version__,
            "pyarrow": pyarrow.__version__, "sentencepiece": sentencepiece.__version__}
    assert {k: out["versions"][k] for k in want} == want
    assert "mlm-pipeline" in out["versions"] and "prefect" in out["versions"]
    md = summary_markdown(out)
    assert "mean 640 tokens/s over the run, 900 tokens/s in the last log interval" in md
    assert "Stop reason: time_cap (stopped early: train.max_time_s was reached)" in md
    assert "Device: cpu, precision bf16; MFU peak 0.25 TFLOP/s (measured)" in md
    assert f"torch {torch.__version__}" in md


def test_versions_are_tags_of_the_run_from_its_start(tmp_path):
    import importlib.metadata

    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    from mlm_pipeline.tracking.records import run_tags

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = MlflowTracker(uri).start_run({}, tags=run_tags())
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["version.torch"] == torch.__version__
    assert tags["version.mlflow"] == mlflow.__version__
    assert tags["version.prefect"] == importlib.metadata.version("prefect")
    assert "version.mlm-pipeline" in tags and "version.sentencepiece" in tags
