"""The run summary's mean tokens/s is tokens seen over the training loop's time of every
segment of a resumed run, not over the last segment's time.

The training time each test expects is computed from the loop's own log, `metrics.jsonl`:
an interval of n steps that logged `train/tokens_per_s` = r took n * tokens_per_step / r
seconds; with `log_every: 1` every record is one step.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.manifest import EvalManifest, Manifest, TrainManifest
from mlm_pipeline.sinks import MetricsSink
from mlm_pipeline.train import train
from mlm_pipeline.train.loop import StopSignal, TrainingInterrupted


def _interval_seconds(records: list[dict], tokens_per_step: int) -> list[tuple[int, float]]:
    """(step, seconds) of each one-step interval of a `log_every: 1` metrics log."""
    return [(r["step"], tokens_per_step / r["train/tokens_per_s"]) for r in records
            if "train/tokens_per_s" in r]


class _StopAt(MetricsSink):
    """A sink that asks the loop to stop (as SIGINT does) once `step` is logged."""

    def __init__(self, step: int, stop: StopSignal) -> None:
        self.step, self.stop = step, stop

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step >= self.step:
            self.stop.request()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_train_time_spans_both_segments_of_a_resumed_run(
        tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    from mlm_pipeline.app.summary import summary
    from mlm_pipeline.tracking.tracker import MlflowTracker

    cfg = TrainConfig(micro_batch_size=4, max_steps=8, warmup_steps=2, log_every=1,
                      checkpoint_every=100, seed=5)
    sections = (cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                tiny_tokenizer_manifest, tmp_path / "run")
    stop = StopSignal()
    with pytest.raises(TrainingInterrupted) as stopped:
        train(*sections, sink=_StopAt(3, stop), stop=stop)
    resumed_at = stopped.value.step
    manifest = train(*sections)  # a second segment, from the interruption's checkpoint
    assert manifest.steps == 8 and 0 < resumed_at < 8
    tokens_per_step = cfg.micro_batch_size * tiny_shard_manifest.seq_len
    records = [json.loads(line)
               for line in manifest.file(manifest.metrics_log).read_text().splitlines()]
    intervals = _interval_seconds(records, tokens_per_step)
    assert [s for s, _ in intervals] == list(range(1, 9))
    both = sum(seconds for _, seconds in intervals)
    second = sum(seconds for step, seconds in intervals if step > resumed_at)
    assert manifest.train_time_s == pytest.approx(both, rel=1e-9)
    assert second < both

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = tracker.client.create_run(tracker.client.create_experiment("summary")).info.run_id
    out = summary(tracker, run_id, _manifest(Manifest, "ingest"), tiny_tokenizer_manifest,
                  _manifest(Manifest, "shards"), manifest,
                  _manifest(EvalManifest, "evaluate", metrics={"eval/loss": 4.0}, probes=[]))
    assert out["train_tokens_per_s_mean"] == pytest.approx(manifest.tokens_seen / both,
                                                          abs=0.051)
    assert out["train_tokens_per_s_mean"] < manifest.tokens_seen / second
    assert out["train_tokens_per_s_last"] == pytest.approx(
        records[-1]["train/tokens_per_s"], abs=0.051)


def _manifest(cls: type[Manifest], stage: str, **fields) -> Manifest:
    """A stand-in manifest of another stage (the summary reads only its common fields)."""
    return cls(stage=stage, digest=stage * 4, output_dir=f"/w/{stage}", config={}, inputs={},
               created_at=0.0, wall_time_s=1.0, **fields)


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings in CI; the test above runs on every push
def test_cli_summary_mean_after_an_interrupted_run_is_resumed(tmp_path, prefect_api_url,
                                                              fresh_mlflow_db):
    """Through `mlm-pipeline run` in fresh processes (on the session's Prefect server):
    interrupted with SIGINT after step 12, run again to the end with `--summary-json`."""
    from tests.flows.test_resume_cli import (
        CLI,
        _config,
        _env,
        _logged_step,
        _start,
        _wait_for,
    )

    config = _config(tmp_path, "honest-summary", "modern", "dynamic")
    cfg = yaml.safe_load(config.read_text())
    fresh_mlflow_db(tmp_path / "mlflow.db")
    api = {"PREFECT_API_URL": prefect_api_url}
    proc = _start(tmp_path, config, **api)
    _wait_for(proc, lambda: _logged_step(tmp_path) >= 12)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output[-3000:]
    (train_dir,) = (tmp_path / "work" / "train").glob("*")
    resumed_at = max(json.loads(line)["step"]
                     for line in (train_dir / "metrics.jsonl").read_text().splitlines())

    summary_path = tmp_path / "summary.json"
    again = subprocess.run([str(CLI), "run", str(config), "--summary-json", str(summary_path)],
                           check=False, cwd=tmp_path, env=_env(tmp_path, **api),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    out = json.loads(summary_path.read_text())
    manifest = TrainManifest.model_validate_json(Path(out["manifests"]["train"]).read_text())
    tokens_per_step = cfg["train"]["micro_batch_size"] * cfg["shards"]["seq_len"]
    records = [json.loads(line)
               for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    intervals = _interval_seconds(records, tokens_per_step)
    assert [s for s, _ in intervals] == list(range(1, cfg["train"]["max_steps"] + 1))
    both = sum(seconds for _, seconds in intervals)
    second = sum(seconds for step, seconds in intervals if step > resumed_at)
    assert out["tokens_seen"] == cfg["train"]["max_steps"] * tokens_per_step
    assert manifest.train_time_s == pytest.approx(both, rel=1e-9)
    assert out["train_tokens_per_s_mean"] == pytest.approx(out["tokens_seen"] / both, abs=0.051)
    assert out["train_tokens_per_s_mean"] < out["tokens_seen"] / second
    assert out["stop_reason"] == "max_steps" and out["device"] == "cpu"
    assert out["precision"] == "fp32" and "torch" in out["versions"]
