"""Retraining through the flow: a child run on a grown corpus starts from a parent run's
checkpoint (`train.init_from`) and reuses its tokenizer (`tokenizer.from_init`): no
tokenizer is trained, the shards use the parent's tokenizer, and the MLflow run holds the
parent as a param and tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
from tests.flows.test_pretraining_flow import ASSETS, NO_MODEL, _overrides


@pytest.mark.full
@pytest.mark.slow  # two tiny pipeline runs through Prefect: about two minutes on two cores
def test_child_run_starts_from_the_parent_and_reuses_its_tokenizer(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "train.warmup_steps=1",
                                        "eval.probes=[]", NO_MODEL]
    parent = mlm_pretraining(PretrainParams(config="tiny", overrides=base))
    checkpoint = Path(parent["checkpoint"])
    parent_state = json.loads((checkpoint / "state.json").read_text())
    grown = tmp_path / "grown.txt"
    grown.write_text((ASSETS / "tiny_fr.txt").read_text(encoding="utf-8")
                     + "\n\nLe chat dort près de la fenêtre ouverte, au soleil.\n",
                     encoding="utf-8")
    child = mlm_pretraining(PretrainParams(config="tiny", overrides=base + [
        f"ingest.sources=[{grown}]", f"train.init_from={checkpoint}",
        "tokenizer.from_init=true"]))
    client = MlflowClient(tracking_uri=uri)
    before = client.get_run(parent["mlflow_run_id"]).data
    after = client.get_run(child["mlflow_run_id"]).data
    assert after.params["train.init_from"] == str(checkpoint)
    assert after.params["tokenizer.from_init"] == "True"
    assert after.tags["mlm.init_digest"] == parent_state["state_sha256"]
    assert after.tags["mlm.init_step"] == "2"
    # The corpus grew (other corpus and shards) but the tokenizer is the parent's.
    assert after.tags["digest.corpus"] != before.tags["digest.corpus"]
    assert after.tags["digest.tokenizer"] == before.tags["digest.tokenizer"]
    assert after.tags["tokenizer.model_sha256"] == before.tags["tokenizer.model_sha256"]
    assert after.tags["digest.shards"] != before.tags["digest.shards"]
    # Only the parent's tokenizer directory exists: none was trained for the new corpus.
    assert len(list((tmp_path / "work" / "tokenizer").glob("*/manifest.json"))) == 1
