"""The run summary marks stages reused from an earlier run and reports mean training speed."""

from __future__ import annotations

from pathlib import Path

from mlm_pipeline.manifest import EvalManifest, Manifest, TrainManifest
from mlm_pipeline.tracking.records import summary, summary_markdown
from mlm_pipeline.tracking.tracker import MlflowTracker


def _base(stage: str, created_at: float, wall: float) -> dict:
    return {"stage": stage, "digest": stage * 4, "output_dir": f"/w/{stage}", "config": {},
            "inputs": {}, "created_at": created_at, "wall_time_s": wall}


def _stage(stage: str, created_at: float, wall: float) -> Manifest:
    return Manifest(**_base(stage, created_at, wall))


def test_reused_stages_and_mean_speed(tmp_path, tiny_tokenizer_manifest):
    run_start = 1_000.0
    trained = TrainManifest(**_base("train", 1_010.0, 40.0), checkpoint_dir="ckpt/step-10",
                            steps=10, tokens_seen=20_480, final_metrics={"train/loss": 5.0},
                            metrics_log="metrics.jsonl", stopped_early=False, device="cpu",
                            precision="fp32")
    evaluated = EvalManifest(**_base("evaluate", 1_060.0, 3.0), metrics={"eval/accuracy": 0.25},
                             probes=[])
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tokenizer = tiny_tokenizer_manifest.model_copy(update={"created_at": 950.0,
                                                           "wall_time_s": 4.0})
    out = summary(tracker, "run1", _stage("ingest", 900.0, 7.5), tokenizer,
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
    assert "mean training speed: 512 tokens/s" in md
    # Without a start time nothing is called reused.
    assert summary(tracker, "run1", _stage("ingest", 900.0, 7.5), tokenizer,
                   _stage("shards", 1_001.0, 2.0), trained, evaluated)["reused_stages"] == []
