"""The retraining mode of the flow parameters (`retrain: continue`), resolved against a
real MLflow SQLite registry: no champion yet -> from scratch; a registered champion alias
-> warm start from `models:/<name>@champion` with its tokenizer."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline_flows.pretrain_params import PretrainParams


EXPERIMENT = "retrain-exp"


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    """One SQLite registry (created once: its migrations take seconds) holding three
    models of one version each: `with-champion` (alias champion), `challenger-only` (alias
    challenger), and one named as the experiment (alias champion); returns its URI."""
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(EXPERIMENT, artifact_location=str(root / "art"))
    run = client.create_run(exp)
    for name, alias in (("with-champion", "champion"), ("challenger-only", "challenger"),
                        (EXPERIMENT, "champion")):
        client.create_registered_model(name)
        version = client.create_model_version(name, str(root / "art" / name),
                                              run_id=run.info.run_id)
        client.set_registered_model_alias(name, alias, version.version)
    return uri


def _params(uri: str, model: str | None, *extra: str, **fields) -> PretrainParams:
    named = [f"tracking.registered_model_name={model}"] if model else []
    return PretrainParams(config="tiny", overrides=[
        f"tracking.tracking_uri={uri}", f"tracking.experiment_name={EXPERIMENT}", *named,
        *extra], **fields)


def test_no_registry_yet_trains_from_scratch(tmp_path):
    params = _params(f"sqlite:///{tmp_path / 'mlflow.db'}", "with-champion",
                     retrain="continue", retrain_steps=7)
    resolved, tags = params.resolve_retrain()
    assert tags == {"mlm.retrain": "scratch_no_champion"}
    cfg = resolved.load()
    assert cfg.train.init_from is None and cfg.tokenizer.from_init is False
    assert cfg.train.max_steps == params.load().train.max_steps  # retrain_steps unused
    assert not (tmp_path / "mlflow.db").exists()  # looking created no database


@pytest.mark.parametrize("model", ["not-registered", "challenger-only"])
def test_no_champion_alias_trains_from_scratch(registry, model):
    resolved, tags = _params(registry, model, retrain="continue").resolve_retrain()
    assert tags == {"mlm.retrain": "scratch_no_champion"}
    assert resolved.load().train.init_from is None


def test_champion_alias_is_the_warm_start_with_its_tokenizer(registry):
    params = _params(registry, "with-champion", retrain="continue", retrain_steps=7)
    resolved, tags = params.resolve_retrain()
    assert tags == {"mlm.retrain": "continued"}
    cfg = resolved.load()
    assert cfg.train.init_from == "models:/with-champion@champion"
    assert cfg.tokenizer.from_init is True
    assert cfg.train.max_steps == 7
    # resolved once: the children flows load these parameters as they are
    assert resolved.retrain == "scratch"


def test_champion_without_retrain_steps_keeps_the_configs_steps(registry):
    params = _params(registry, "with-champion", "train.max_steps=11", retrain="continue")
    cfg = params.resolve_retrain()[0].load()
    assert cfg.train.init_from == "models:/with-champion@champion"
    assert cfg.train.max_steps == 11


def test_registered_name_defaults_to_the_experiment_name(registry):
    params = _params(registry, None, retrain="continue")
    assert params.resolve_retrain()[0].load().train.init_from == (
        f"models:/{EXPERIMENT}@champion")


def test_scratch_is_unchanged_even_with_a_champion(registry):
    params = _params(registry, "with-champion", retrain_steps=7)  # default: scratch
    assert params.retrain == "scratch"
    assert params.resolve_retrain() == (params, {})


def test_continue_refuses_a_config_with_its_own_init_from(tmp_path):
    params = _params(f"sqlite:///{tmp_path / 'mlflow.db'}", "with-champion",
                     f"train.init_from={tmp_path / 'ckpt'}", retrain="continue")
    with pytest.raises(ValueError, match=r"retrain=continue.*train\.init_from"):
        params.resolve_retrain()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="retrain"):
        PretrainParams(retrain="resume")


@pytest.mark.full
@pytest.mark.slow  # two tiny pipeline runs with export and registry: minutes on two cores
def test_second_continue_run_starts_from_the_first_runs_champion(tmp_path):
    from mlm_pipeline_flows.pretraining import mlm_pretraining
    from tests.flows.test_pretraining_flow import _overrides

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.max_steps=2", "train.warmup_steps=1",
                                        "eval.probes=[]"]
    first = mlm_pretraining(PretrainParams(config="tiny", overrides=base, retrain="continue"))
    second = mlm_pretraining(PretrainParams(config="tiny", overrides=base, retrain="continue",
                                            retrain_steps=3))
    client = MlflowClient(tracking_uri=uri)
    before = client.get_run(first["mlflow_run_id"]).data
    after = client.get_run(second["mlflow_run_id"]).data
    assert before.tags["mlm.retrain"] == "scratch_no_champion"
    assert before.params.get("train.init_from", "None") == "None"  # random weights
    assert after.tags["mlm.retrain"] == "continued"
    # flow-test: the experiment name, the registered name by default
    assert after.params["train.init_from"] == "models:/flow-test@champion"
    assert after.params["tokenizer.from_init"] == "True"
    assert after.params["train.max_steps"] == "3"
    assert after.tags["digest.tokenizer"] == before.tags["digest.tokenizer"]
    # the parent is the first run: its step, and one tokenizer trained in all
    assert after.tags["mlm.init_step"] == "2"
    assert len(list((tmp_path / "work" / "tokenizer").glob("*/manifest.json"))) == 1
