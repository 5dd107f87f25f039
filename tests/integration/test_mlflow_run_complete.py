"""A complete MLflow run without the orchestrator (real MLflow on SQLite): dataset inputs,
data accounting as params, system metrics, the experiment kind, the run name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.tracking import records
from mlm_pipeline.tracking.tracker import MlflowTracker


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def test_record_data_logs_both_splits_as_inputs_and_accounting_as_params(
    uri, tmp_path, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest,
):
    tracker = MlflowTracker(uri, "lineage")
    run_id = tracker.start_run({}, run_name="lineage-run")
    records.record_data(tracker, run_id, tiny_corpus_manifest, tiny_tokenizer_manifest,
                        tiny_shard_manifest)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    saved = json.loads(Path(tiny_shard_manifest.path).read_text())  # the manifest file
    by_context = {{t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset
                  for i in run.inputs.dataset_inputs}
    assert set(by_context) == {"training", "validation"}
    for split, context in (("train", "training"), ("validation", "validation")):
        ds = by_context[context]
        assert ds.digest == saved["digest"][:36]
        assert json.loads(ds.profile)["rows"] == saved[split]["rows"]
        assert json.loads(ds.profile)["documents"] == saved[split]["documents"]
        schema = json.loads(json.loads(ds.schema)["mlflow_tensorspec"]["features"])
        assert schema[0]["name"] == "input_ids"
        assert schema[0]["tensor-spec"]["shape"] == [-1, saved["seq_len"]]
    # Runs on the same data are found by digest.
    found = client.search_runs([run.info.experiment_id],
                               f"dataset.digest = '{saved['digest'][:36]}'")
    assert [r.info.run_id for r in found] == [run_id]
    # Accounting: params and an artifact, no metrics.
    ingest = json.loads(Path(tiny_corpus_manifest.path).read_text())
    assert run.data.metrics == {}
    assert run.data.params["data.documents_read"] == str(ingest["documents_read"])
    assert run.data.params["data.train_tokens"] == str(
        saved["train"]["rows"] * saved["seq_len"])
    got = json.loads(Path(client.download_artifacts(
        run_id, "data/accounting.json", str(tmp_path))).read_text())
    assert got["documents_train"] == ingest["documents_train"]
    assert {f"data.{k}": str(v) for k, v in got.items()}.items() <= run.data.params.items()


def test_experiment_kind_is_set_on_new_and_existing_experiments(uri):
    client = MlflowClient(uri)
    old = client.create_experiment("made-elsewhere")  # without the tag, as MLflow makes it
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    for name in ("made-elsewhere", "made-here"):
        exp_id = MlflowTracker(uri, name).experiment_id()
        assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == \
            "custom_model_development"


def test_system_metrics_are_logged_and_continue_their_steps(uri):
    tracker = MlflowTracker(uri, "system")
    run_id = tracker.start_run({})
    client = MlflowClient(uri)
    for _ in range(2):  # a short block still logs its closing sample; a second one goes on
        with tracker.system_metrics(run_id, sampling_interval_s=60.0):
            pass
    history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == [0, 1]
    keys = set(client.get_run(run_id).data.metrics)
    assert "system/system_memory_usage_megabytes" in keys


def test_run_name_from_config_and_start_run_uses_it(uri):
    cfg = PipelineConfig.model_validate({"name": "my corpus/v2", "train": {"max_steps": 300},
                                         "model": {"preset": "bert"}})
    assert records.run_name(cfg, "abc123") == "my-corpus-v2-bert-300-abc123"
    assert re.fullmatch(r"my-corpus-v2-bert-300-[0-9a-f]{6}", records.run_name(cfg))
    assert records.run_name(cfg) != records.run_name(cfg)
    assert re.fullmatch(r"mlm-pretraining-[0-9a-f]{6}", records.run_name(None))
    no_preset = PipelineConfig.model_validate({"name": "c", "train": {"max_steps": 500}})
    assert records.run_name(no_preset, "ff") == "c-500-ff"
    tracker = MlflowTracker(uri, "names", run_name="tracker-default")
    named = tracker.start_run({}, run_name=records.run_name(cfg, "abc123"))
    default = tracker.start_run({})
    client = MlflowClient(uri)
    assert client.get_run(named).info.run_name == "my-corpus-v2-bert-300-abc123"
    assert client.get_run(default).info.run_name == "tracker-default"


def test_run_tags_name_the_user_and_the_source():
    import getpass

    tags = records.run_tags({"x": "1"}, "flows/pretraining.py:mlm_pretraining", "JOB")
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["mlflow.source.name"] == "flows/pretraining.py:mlm_pretraining"
    assert tags["mlflow.source.type"] == "JOB" and tags["x"] == "1"
