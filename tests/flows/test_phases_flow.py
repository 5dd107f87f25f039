"""The mlm-phases flow with a real Prefect API and MLflow: two tiny phases (seq_len 64, then
128 from the first one's weights) on the tiny corpus. The second phase's MLflow run names
the first as its parent, and it started from the first phase's final weights, its learned
position table extended by repetition (row i = parent row i mod 64), checked against the
parent's checkpoint file read here with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from mlm_pipeline_flows.phases import chain_params, mlm_phases
from mlm_pipeline_flows.pretraining import PretrainParams
from tests.flows.test_pretraining_flow import NO_MODEL, _overrides

#: The child's peak LR: its few AdamW updates then move a weight by at most ~1e-12 each
#: (AdamW's step is about lr in size, its weight decay lr x 0.01 x w), so its final weights
#: are its step-0 weights within `ATOL`, and step 0 is what the test is about.
CHILD_LR = 1e-12
ATOL = 1e-9


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Two phases of a tiny `bert` (learned positions) through `mlm_phases`: 3 steps at
    seq_len 64, then 2 at 128."""
    tmp = tmp_path_factory.mktemp("phases")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    base = [o for o in _overrides(tmp, uri) if not o.startswith(("shards.seq_len",
                                                                 "train.max_steps"))]
    base += ["model.preset=bert", "model.dropout=0.0", "eval.probes=[]", NO_MODEL,
             "train.warmup_steps=1"]
    first = PretrainParams(config="tiny", overrides=[*base, "shards.seq_len=64",
                                                     "train.max_steps=3"])
    second = PretrainParams(config="tiny", overrides=[
        *base, "shards.seq_len=128", "train.max_steps=2", f"train.lr={CHILD_LR:.1e}",
        "tracking.run_name=second-phase"])
    result = mlm_phases(phases=[first, second])
    return {"result": result, "client": MlflowClient(tracking_uri=uri)}


@pytest.mark.slow  # two tiny pipeline runs through Prefect: about a minute on two cores
def test_the_second_phase_records_the_first_as_its_parent(chain):
    parent, child = chain["result"]["phases"]
    assert chain["result"]["mlflow_run_ids"] == [parent["mlflow_run_id"], child["mlflow_run_id"]]
    state = json.loads((Path(parent["checkpoint"]) / "state.json").read_text())
    run = chain["client"].get_run(child["mlflow_run_id"])
    tags, params = run.data.tags, run.data.params
    assert params["train.init_from"] == parent["mlflow_run_id"]
    assert tags["mlm.init_from"] == parent["mlflow_run_id"]
    assert tags["mlm.init_digest"] == state["state_sha256"]
    assert tags["mlm.init_step"] == "3"
    assert json.loads(tags["mlm.init_changes"]) == {
        "seq_len": [64, 128], "positions": "extended: row i = parent row i mod 64 (Longformer)"}
    assert run.info.run_name == "second-phase"
    # the first phase is a run of its own, with no parent
    first = chain["client"].get_run(parent["mlflow_run_id"]).data.tags
    assert "mlm.init_from" not in first


@pytest.mark.slow
def test_the_second_phase_starts_from_the_first_phases_final_weights(chain):
    parent, child = chain["result"]["phases"]
    before = load_file(Path(parent["checkpoint"]) / "model.safetensors")
    after = load_file(Path(child["checkpoint"]) / "model.safetensors")
    assert before.keys() == after.keys()
    key = "embeddings.position_embeddings.weight"
    assert before[key].shape[0] == 64 and after[key].shape[0] == 128
    extended = torch.cat([before[key], before[key]])  # row i = row i mod 64
    torch.testing.assert_close(after[key], extended, rtol=0, atol=ATOL)
    for name in before.keys() - {key}:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=ATOL, msg=name)


def test_the_chain_of_a_phase_config_runs_its_parent_first_with_the_same_overrides():
    params = PretrainParams(config="bert-base-512", overrides=["train.device=cuda"],
                            max_steps=10)
    chain = chain_params(params)
    assert [p.config for p in chain] == ["bert-base", "bert-base-512"]
    assert chain[-1] is params
    assert all(p.overrides == ["train.device=cuda"] and p.max_steps == 10 for p in chain)
