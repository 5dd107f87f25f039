"""A sweep as one thing in MLflow (`flows/sweep.py`, `app.sweep`): one preparation, a parent
run holding the grid, a nested run per combination, and `runs --parent` / `compare PARENT`
listing the children; a grid over a data section is refused before anything runs."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline import cli
from mlm_pipeline.app.sweep import children, parse_grid
from mlm_pipeline.config_files import ConfigError
from mlm_pipeline_flows.pretraining import PretrainParams
from mlm_pipeline_flows.sweep import mlm_sweep
from tests.flows.test_pretraining_flow import NO_MODEL, _overrides

LRS = ["0.001", "0.002"]


def test_the_grid_is_read_and_expanded_in_order():
    grid = parse_grid(["train.lr=1e-4, 3e-4", 'model.preset=["bert", "modern"]'])
    assert grid == {"train.lr": ["1e-4", "3e-4"], "model.preset": ["bert", "modern"]}
    assert children(grid) == [["train.lr=1e-4", "model.preset=bert"],
                              ["train.lr=1e-4", "model.preset=modern"],
                              ["train.lr=3e-4", "model.preset=bert"],
                              ["train.lr=3e-4", "model.preset=modern"]]
    for bad in (["train.lr"], ["train.lr=1,1"], ["train.lr=1", "train.lr=2"], ["x=1,"]):
        with pytest.raises(ConfigError):
            parse_grid(bad)


def test_a_sweep_is_a_parent_run_with_a_nested_run_per_value(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "train.warmup_steps=1",
                                        "eval.probes=[]", NO_MODEL]
    result = mlm_sweep(PretrainParams(config="tiny", overrides=base), {"train.lr": LRS})
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(result["parent"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["mlm.sweep"] == "parent"
    assert json.loads(parent.data.params["sweep.train.lr"]) == LRS
    kids = [client.get_run(i) for i in result["children"]]
    assert [k.data.params["train.lr"] for k in kids] == LRS
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {parent.info.run_id}
    assert all(k.info.status == "FINISHED" for k in kids)
    assert len({k.data.tags["digest.shards"] for k in kids}) == 1  # one preparation
    losses = {k.info.run_id: k.data.metrics["eval/loss"] for k in kids}
    best = min(losses, key=losses.get)
    assert parent.data.tags["sweep.best_run"] == best
    assert parent.data.metrics["sweep/best_eval_loss"] == losses[best]

    capsys.readouterr()
    assert cli.main(["runs", "--parent", parent.info.run_id[:8], "--tracking-uri", uri,
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["id"] for r in rows) == sorted(losses)
    assert {r["train.lr"] for r in rows} == set(LRS)
    assert cli.main(["compare", parent.info.run_id, "--out", str(tmp_path / "c.png"),
                     "--tracking-uri", uri, "--json"]) == 0
    assert sorted(r["id"] for r in json.loads(capsys.readouterr().out)) == sorted(losses)


def test_a_sweep_over_the_data_is_refused_before_anything_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ConfigError, match="tokenizer.vocab_size"):
        mlm_sweep(PretrainParams(config="tiny", overrides=_overrides(tmp_path, uri)),
                  {"tokenizer.vocab_size": ["128", "256"]})
    assert not (tmp_path / "work").exists()
    assert not (tmp_path / "mlflow.db").exists()
