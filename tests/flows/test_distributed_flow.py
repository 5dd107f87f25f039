"""The mlm-pretraining flow with two training processes under torchrun (CPU, gloo): the
ranks' output reaches the Prefect logs and the metrics reach MLflow once per step."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.pretraining import PretrainParams, mlm_pretraining

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.slow  # the whole tiny pipeline plus a torchrun launch of two interpreters
def test_flow_trains_with_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        f"work_dir={tmp_path / 'work'}", f"ingest.sources=[{ASSETS / 'tiny_fr.txt'}]",
        "ingest.validation_fraction=0.15", "tokenizer.vocab_size=128", "shards.seq_len=16",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "train.micro_batch_size=2", "train.max_steps=4",
        "train.warmup_steps=1", "train.log_every=2", "train.device=cpu",
        "train.distributed.nproc_per_node=2", "eval.max_rows=20",
        "linear_probe.enabled=false", f"tracking.tracking_uri={uri}",
        "tracking.experiment_name=flow-ddp-test",
    ]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_completed()
    summary = state.result()
    run_id = summary["mlflow_run_id"]
    train_dir = tmp_path / "work" / "train" / run_id
    records = [json.loads(line)
               for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train/loss"])
                                                   for r in records]
    # one torchrun launch; its checkpoint was written by a run of two ranks
    launches = list((train_dir / "launch").glob("torchrun-*"))
    assert len(launches) == 1
    state_json = json.loads(
        (Path(summary["checkpoint"]) / "state.json").read_text())
    assert state_json["cursor"]["world_size"] == 2
