"""The two halves of the pipeline as flows of their own: `prepare-data` once, then any
number of `train-evaluate` runs (a sweep) on its output, none of which prepares data again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline_flows.pretraining import (
    PreparedData,
    PretrainParams,
    prepare_data_flow,
    train_evaluate_flow,
)
from tests.flows.test_pretraining_flow import NO_MODEL, _overrides, _stage_states


def _task_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted(r.name.rsplit("-", 1)[0] for r in runs)


def test_one_preparation_serves_a_sweep_of_two_learning_rates(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "train.warmup_steps=1",
                                        "eval.probes=[]", NO_MODEL]
    prepared = prepare_data_flow(PretrainParams(config="tiny", overrides=base),
                                 return_state=True)
    assert prepared.is_completed()
    assert _stage_states(prepared.state_details.flow_run_id) == {
        "ingest": "Completed", "tokenizer": "Completed", "shards": "Completed"}
    # What a deployment gets: the manifests by path and digest, as JSON.
    data = PreparedData.model_validate(json.loads(prepared.result().model_dump_json()))
    shards_file = Path(data.shards.path)
    shards_before = json.loads(shards_file.read_text())
    assert shards_before["digest"] == data.shards.digest
    client = MlflowClient(tracking_uri=uri)
    runs = []
    for lr in ("0.001", "0.002"):
        state = train_evaluate_flow(
            PretrainParams(config="tiny", overrides=base + [f"train.lr={lr}"]), data,
            return_state=True)
        assert state.is_completed(), state
        # No data stage ran in this flow run: only the training run's tasks.
        names = _task_names(state.state_details.flow_run_id)
        assert not {"ingest", "tokenizer", "shards"} & set(names), names
        assert {"start-tracking", "record-data", "train", "evaluate", "end-tracking"} <= set(
            names)
        run = client.get_run(state.result()["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.params["train.lr"] == lr
        assert run.data.tags["digest.shards"] == data.shards.digest
        assert run.data.tags["mlflow.source.name"] == \
            "flows/train_evaluate.py:train_evaluate_flow"
        assert run.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
        # The data stages are listed as reused (made before this run started).
        assert set(state.result()["reused_stages"]) >= {"ingest", "tokenizer", "shards"}
        runs.append(run.info.run_id)
    assert len(set(runs)) == 2
    # The shards were not written again: same manifest, same creation time.
    assert json.loads(shards_file.read_text()) == shards_before


def test_train_evaluate_refuses_data_prepared_with_other_settings(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "eval.probes=[]"]
    data = prepare_data_flow(PretrainParams(config="tiny", overrides=base))
    state = train_evaluate_flow(
        PretrainParams(config="tiny", overrides=base + ["shards.seq_len=32"]), data,
        return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="not the shards this config"):
        state.result()
    # The MLflow run it opened is closed FAILED with the reason.
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["mlm.error"].startswith("ValueError: ")
