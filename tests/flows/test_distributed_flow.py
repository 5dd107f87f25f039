"""The mlm-pretraining flow with two training processes under torchrun (CPU, gloo): rank 0
logs the metrics and the periodic evaluations to MLflow while training (once per logged
step, also across a failure and its resume), and the checkpoint is a two-rank one.

The first test is the torchrun pair CI runs on every push; the resumed two-rank run is the
`full` tier (one slice per push, all with CI_FULL=1). Neither is about the exported model:
`tracking.log_model=false`."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
from mlm_pipeline_flows.train_evaluate import train_task
from tests.faults.mlm_faults import FAIL_RANK_AT_STEP, child_env
from tests.flows.test_pretraining_flow import _overrides, run_tree


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def _records(train_dir: Path) -> list[dict]:
    return [json.loads(line)
            for line in (train_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the whole tiny pipeline plus a torchrun launch of two interpreters
def test_flow_trains_with_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [*_overrides(tmp_path, uri), "train.device=cpu", "tracking.log_model=false",
                 "train.distributed.nproc_per_node=2", "eval.every_steps=2"]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_completed()
    summary = state.result()
    run_id = summary["mlflow_run_id"]
    train_dir = tmp_path / "work" / "train" / run_id
    records = _records(train_dir)
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6]  # train.log_every=2, written once
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train/loss"])
                                                   for r in train_records]
    # periodic evaluations at steps 2 and 4 (rank 0, during training), the final one at 6
    eval_records = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in eval_records] == [2, 4]
    eval_history = client.get_metric_history(run_id, "eval/loss")
    assert [m.step for m in eval_history] == [2, 4, 6]
    assert [m.value for m in eval_history[:2]] == [r["eval/loss"] for r in eval_records]
    # logged live: every point is older than the train manifest, written when training
    # ended (a replay of metrics.jsonl after the launch would come after it)
    manifest_ms = (train_dir / "manifest.json").stat().st_mtime_ns // 1_000_000
    assert all(m.timestamp <= manifest_ms for m in [*history, *eval_history[:2]])
    # the periodic evaluator's fill-mask rows reached the run's table at steps 2 and 4
    table = json.loads(Path(client.download_artifacts(
        run_id, "eval/fill_mask_table.json", str(tmp_path / "dl"))).read_text())
    step_column = table["columns"].index("step")
    assert {row[step_column] for row in table["data"]} == {2, 4, 6}
    # the progress artifact followed rank 0's metric lines to the last step
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=run_tree(state.state_details.flow_run_id))))
    assert float({a.key: a for a in artifacts}["training-progress"].data) == 100.0
    # one torchrun launch; its checkpoint was written by a run of two ranks
    assert len(list((train_dir / "launch").glob("torchrun-*"))) == 1
    state_json = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    assert state_json["cursor"]["world_size"] == 2


@pytest.mark.slow  # three torchrun launches of two interpreters, the tiny pipeline twice
@pytest.mark.full
def test_resumed_two_rank_run_logs_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [*_overrides(tmp_path, uri), "train.device=cpu", "tracking.log_model=false",
                 "train.distributed.nproc_per_node=2", "train.log_every=1",
                 "train.checkpoint_every=3", "eval.every_steps=2"]
    params = PretrainParams(config="tiny", overrides=overrides)
    # rank 0 fails before step 5: steps 1-4 and the evaluations at 2 and 4 are in MLflow,
    # the checkpoint is step 3; the task's retry resumes there and fails again at step 5
    for name, value in child_env(fail_rank_at_step=(0, 5)).items():  # torchrun's ranks
        monkeypatch.setenv(name, value)
    assert mlm_pretraining(params, return_state=True).is_failed()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    run_id = run.info.run_id
    assert _steps(client, run_id, "train/loss") == [1, 2, 3, 4]
    assert _steps(client, run_id, "eval/loss") == [2, 4]
    train_dir = tmp_path / "work" / "train" / run_id
    assert len(list((train_dir / "launch").glob("torchrun-*"))) == 2  # the retry's too
    # the same command again continues the run from step 3: step 4 and its evaluation
    # are trained again but not sent twice
    monkeypatch.delenv(FAIL_RANK_AT_STEP)
    state = mlm_pretraining(params, return_state=True)
    assert state.is_completed()
    assert state.result()["mlflow_run_id"] == run_id
    assert _steps(client, run_id, "train/loss") == [1, 2, 3, 4, 5, 6]
    assert _steps(client, run_id, "eval/loss") == [2, 4, 6]
    # and MLflow holds what the resumed run's metrics.jsonl holds, value for value
    records = [r for r in _records(train_dir) if "train/loss" in r]
    assert [m.value for m in client.get_metric_history(run_id, "train/loss")] == [
        r["train/loss"] for r in records]


def test_fsdp2_with_periodic_evaluation_is_refused_before_launching(
        tmp_path, tiny_shard_manifest, tiny_tokenizer_manifest):
    cfg = PretrainParams(config="tiny", overrides=[
        *_overrides(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"), "train.device=cpu",
        "train.distributed.nproc_per_node=2", "train.distributed.strategy=fsdp2",
        "eval.every_steps=2"]).load()
    with pytest.raises(ValueError, match="eval.every_steps.*FSDP2.*strategy ddp"):
        train_task.fn(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, "run-id")
    assert not (tmp_path / "work" / "train").exists()  # no launch, no run directory
