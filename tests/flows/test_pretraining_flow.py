"""The mlm-pretraining flow on the tiny test corpus, with a real Prefect API and MLflow."""

import importlib
import pkgutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import flows
from flows.pretraining import PretrainParams, mlm_pretraining

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.parametrize("name", [m.name for m in pkgutil.iter_modules(flows.__path__)])
def test_every_flow_module_imports(name):
    importlib.import_module(f"flows.{name}")


def _overrides(tmp_path, uri):
    return [
        f"work_dir={tmp_path / 'work'}",
        f"ingest.sources=[{ASSETS / 'tiny_fr.txt'}]",
        "ingest.validation_fraction=0.15",
        "tokenizer.vocab_size=128",
        "shards.seq_len=16",
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.intermediate_size=64",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.log_every=2",
        "eval.max_rows=20",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment_name=flow-test",
    ]


def test_flow_logs_a_complete_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    state = mlm_pretraining(
        PretrainParams(config="tiny", overrides=_overrides(tmp_path, uri)), return_state=True
    )
    assert state.is_completed()
    summary = state.result()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    # params: the flattened config, overrides applied
    assert run.data.params["train.max_steps"] == "6"
    assert run.data.params["tokenizer.vocab_size"] == "128"
    # lineage tags: every data stage digest, as the manifests record it
    for stage in ("corpus", "tokenizer", "shards"):
        path = summary["manifests"]["ingest" if stage == "corpus" else stage]
        assert run.data.tags[f"digest.{stage}"] in Path(path).read_text()
    assert run.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    # per-step training metrics (steps 2, 4, 6) and eval metrics
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6]
    for key in ("eval/loss", "eval/mlm_accuracy", "eval/perplexity", "eval/baseline_accuracy"):
        assert key in run.data.metrics
    assert run.data.metrics["eval/mlm_accuracy"] == summary["metrics"]["eval/mlm_accuracy"]
    # artifacts: tokenizer and final checkpoint
    names = {a.path for a in client.list_artifacts(run.info.run_id, "tokenizer")}
    assert names == {"tokenizer/spm.model", "tokenizer/spm.vocab"}
    ckpt = client.list_artifacts(run.info.run_id, "checkpoints")
    assert [a.path for a in ckpt] == ["checkpoints/step-00000006"]
    files = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, ckpt[0].path)}
    assert {"model.pt", "optimizer.pt", "state.json"} <= files


def test_a_failing_stage_fails_the_flow_and_the_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = _overrides(tmp_path, uri) + [f"ingest.sources=[{tmp_path / 'missing.txt'}]"]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_failed()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
