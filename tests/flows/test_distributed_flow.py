"""The mlm-pretraining flow with two training processes under torchrun (CPU, gloo): the
metrics reach MLflow once per logged step, and the checkpoint is a two-rank one."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.pretraining import PretrainParams, mlm_pretraining
from tests.flows.test_pretraining_flow import _overrides


@pytest.mark.slow  # the whole tiny pipeline plus a torchrun launch of two interpreters
def test_flow_trains_with_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [*_overrides(tmp_path, uri), "train.device=cpu",
                 "train.distributed.nproc_per_node=2"]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_completed()
    summary = state.result()
    run_id = summary["mlflow_run_id"]
    train_dir = tmp_path / "work" / "train" / run_id
    records = [json.loads(line)
               for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]  # train.log_every=2, written once
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train/loss"])
                                                   for r in records]
    # one torchrun launch; its checkpoint was written by a run of two ranks
    assert len(list((train_dir / "launch").glob("torchrun-*"))) == 1
    state_json = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    assert state_json["cursor"]["world_size"] == 2
