"""Lineage end to end: a first run registers version 1, a `retrain: continue` run starts
from the champion and registers version 2; the registry alone tells the chain, the
logged model holds the eval metrics with the validation dataset, and the Prefect model
asset of version 2 depends on version 1's."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline import cli
from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
from tests.flows.test_assets import _inputs, _key, _materialized
from tests.flows.test_pretraining_flow import _overrides

MODEL = "flow-test"  # the experiment name: the registered name by default


@pytest.mark.full
@pytest.mark.slow  # two tiny pipeline runs with export and registry: minutes on two cores
def test_retrained_version_knows_its_parent_data_and_steps(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "train.warmup_steps=1",
                                        "eval.probes=[]"]
    since = dt.datetime.now(dt.timezone.utc)
    first = mlm_pretraining(PretrainParams(config="tiny", overrides=base, retrain="continue"))
    second = mlm_pretraining(PretrainParams(config="tiny", overrides=base, retrain="continue",
                                            retrain_steps=3))
    client = MlflowClient(tracking_uri=uri)
    runs = [client.get_run(s["mlflow_run_id"]) for s in (first, second)]
    v1, v2 = (dict(client.get_model_version(MODEL, str(n)).tags) for n in (1, 2))
    assert v1["lineage.parent"] == "none" and v1["lineage.steps_added"] == "2"
    assert v2["lineage.parent_source"] == f"models:/{MODEL}@champion"
    assert v2["lineage.parent"] == f"models:/{MODEL}/1"
    assert v2["lineage.parent_digest"] == v1["lineage.model_digest"]
    assert v2["lineage.parent_step"] == "2" and v2["lineage.steps_added"] == "3"
    for tags, run in zip((v1, v2), runs):
        assert tags["lineage.corpus_digest"] == run.data.tags["digest.corpus"]
        assert tags["lineage.tokenizer_digest"] == run.data.tags["digest.tokenizer"]
        assert tags["lineage.decision"] == run.data.tags["registry.decision"]

    # The eval metrics on version 2's logged model: the run's own final point (MLflow's
    # `log_model(step=...)` linked it, without a dataset; no second point in the run's
    # history), and the validation shards as the run's dataset input.
    model_id = runs[1].data.tags["mlm.model_uri"].removeprefix("models:/")
    validation = [i.dataset for i in runs[1].inputs.dataset_inputs
                  if i.dataset.name == "shards-validation"]
    linked = {m.key: m for m in client.get_logged_model(model_id).metrics if m.step == 3}
    assert linked["eval/loss"].value == runs[1].data.metrics["eval/loss"]
    assert [m.step for m in client.get_metric_history(runs[1].info.run_id, "eval/loss")
            ].count(3) == 1
    assert len(validation) == 1 and validation[0].digest

    # The history from the registry alone.
    assert cli.main(["models", MODEL, "--tracking-uri", uri, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["parent"], r["steps added"]) for r in rows] == [
        (2, "v1", 3), (1, "-", 2)]

    # Prefect: version 2's model asset depends on its shards, tokenizer and version 1's.
    keys = {n: _key("model", tags["lineage.model_digest"]) for n, tags in (("v1", v1),
                                                                            ("v2", v2))}
    events = _materialized(set(keys.values()), since)
    assert _inputs(events[keys["v2"]][-1]) == {
        keys["v1"], _key("shards", runs[1].data.tags["digest.shards"]),
        _key("tokenizer", runs[1].data.tags["digest.tokenizer"])}
