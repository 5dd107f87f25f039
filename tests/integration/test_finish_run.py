"""Finishing a run that failed after training is idempotent, against a real MLflow SQLite
store and a real tiny trained model:

- its training is not run again (`train_task` returns the finished training's manifest);
- the end stages done again (`record_results`, `publish`) after the registration
  failed between creating the version and moving the aliases leave one final point per
  eval key, one logged model and one model version, with the aliases the first attempt
  would have set.
"""

from __future__ import annotations

import math

import pytest

from mlm_pipeline.app.publish import publish, record_results
from mlm_pipeline.app.training_run import finished_training, train_dir
from mlm_pipeline.config import (
    EvalConfig,
    MaskingConfig,
    PipelineConfig,
    TrackingConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking.version_lineage import record_lineage
from mlm_pipeline.train import train
from tests.mlflow_history import assert_one_point_per_step

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("transformers")
from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE  # noqa: E402

NAME = "mlm-finish-test"
STEPS = 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_shard_manifest, tiny_tokenizer_manifest,
             tiny_model_config):
    """A run's config, MLflow run id and what its training and evaluation made."""
    tmp = tmp_path_factory.mktemp("finish")
    cfg = PipelineConfig(
        work_dir=str(tmp / "work"), model=tiny_model_config,
        train=TrainConfig(micro_batch_size=4, max_steps=STEPS, warmup_steps=1,
                          checkpoint_every=STEPS, precision="fp32", seed=3),
        tracking=TrackingConfig(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
                                experiment_name=NAME))
    tracker = MlflowTracker.from_config(cfg.tracking)
    run_id = tracker.start_run({"train.max_steps": STEPS})
    trained = train(cfg.train, cfg.model, MaskingConfig(), tiny_shard_manifest,
                    tiny_tokenizer_manifest, tmp / "work" / "train" / run_id)
    evaluated = evaluate(EvalConfig(), trained, tiny_shard_manifest,
                         tiny_tokenizer_manifest, cfg.work_dir)
    return cfg, tracker, run_id, trained, evaluated


def test_a_finished_training_is_not_run_again(finished, tiny_shard_manifest,
                                              tiny_tokenizer_manifest):
    from mlm_pipeline_flows.train_evaluate import train_task

    cfg, _, run_id, trained, _ = finished
    out = train_dir(cfg, run_id)
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    again = train_task.fn(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, run_id)
    assert again.digest == trained.digest and again.steps == STEPS
    assert {p: (p.stat().st_mtime_ns, p.read_bytes())
            for p in out.rglob("*") if p.is_file()} == files  # nothing written
    # another budget is not a finished training: it would train
    assert finished_training(out, STEPS + 1, tiny_shard_manifest.digest) is None
    assert finished_training(out, STEPS, "0" * 64) is None


def test_the_end_stages_done_again_log_and_register_once(finished, monkeypatch,
                                                         tiny_tokenizer_manifest,
                                                         tiny_shard_manifest):
    cfg, tracker, run_id, trained, evaluated = finished
    record_results(tracker, run_id, cfg, trained, evaluated)
    # The server goes away after the version is created, before an alias moves.
    real = MlflowClient.set_registered_model_alias
    failures = []

    def fails_once(self, *args, **kwargs):
        if not failures:
            failures.append(args)
            raise MlflowException("server unavailable", error_code=TEMPORARILY_UNAVAILABLE)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", fails_once)
    args = (tracker, run_id, NAME, trained, evaluated, tiny_tokenizer_manifest.output_dir,
            "Le [MASK] du chat.")
    with pytest.raises(MlflowException, match="server unavailable"):
        publish(*args)
    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    assert [int(v.version) for v in client.search_model_versions(f"name = '{NAME}'")] == [1]

    # The rerun finishes the run: the same end stages again.
    record_results(tracker, run_id, cfg, trained, evaluated)
    result = publish(*args)

    assert [int(v.version) for v in client.search_model_versions(f"name = '{NAME}'")] == [1]
    assert (result["version"], result["decision"], result["champion_version"]) == (1, "first", 1)
    assert int(client.get_model_version_by_alias(NAME, "champion").version) == 1
    assert int(client.get_model_version_by_alias(NAME, "challenger").version) == 1
    experiment = tracker.get_run(run_id).info.experiment_id
    models = client.search_logged_models([experiment],
                                         filter_string=f"source_run_id = '{run_id}'")
    assert len(models) == 1 and result["model_uri"] == f"models:/{models[0].model_id}"
    for key in evaluated.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == [STEPS], key
    assert len(client.get_metric_history(run_id, "registry/eval_loss")) == 1
    assert client.get_run(run_id).data.tags["registry.decision"] == "first"
    # The publish step's last part (the version's lineage and the final metrics linked to
    # the logged model), then the whole publish step retried: the run's history keeps one
    # point per metric and step, and the model lists the final points.
    for _ in range(2):
        record_lineage(tracker, result, trained, evaluated, tiny_shard_manifest,
                       tiny_tokenizer_manifest.digest)
        assert assert_one_point_per_step(client, run_id) > len(evaluated.metrics)
        record_results(tracker, run_id, cfg, trained, evaluated)
        result = publish(*args)
        assert result["version"] == 1
    assert assert_one_point_per_step(client, run_id) > len(evaluated.metrics)
    linked = client.get_logged_model(result["model_uri"].removeprefix("models:/")).metrics
    finite = {k: v for k, v in evaluated.metrics.items() if math.isfinite(v)}
    assert {m.key: m.step for m in linked if m.key in finite} == dict.fromkeys(finite, STEPS)
    # Each link is the run's own point (its timestamp), not a copy.
    own = {k: client.get_metric_history(run_id, k)[0].timestamp for k in finite}
    assert {m.key: m.timestamp for m in linked if m.key in finite} == own
