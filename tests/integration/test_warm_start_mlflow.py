"""Warm start from an MLflow SOURCE (`models:/NAME@ALIAS`, run id) and the config-level
wiring the flows use (`app.parents`, over `tracking.fetch`): the parent's checkpoint where its run's train
manifest says, else the checkpoint the run uploaded, downloaded with its tokenizer;
`tokenizer.from_init` adopting that tokenizer; the run's parent tags."""

import json
import shutil

import pytest

from mlm_pipeline.app.parents import (
    init_checkpoint,
    parent_of,
    prepare_tokenizer,
    tokenizer_digest_for,
)
from mlm_pipeline.config import MaskingConfig, PipelineConfig, TrainConfig
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking.fetch import parent_tags
from mlm_pipeline.train import train

mlflow = pytest.importorskip("mlflow")

NAME = "warm-parent"


def _train_cfg(**kw) -> TrainConfig:
    base = {"micro_batch_size": 4, "max_steps": 2, "warmup_steps": 1, "log_every": 1,
            "seed": 11, "precision": "fp32", "compile": "off", "checkpoint_interval_s": None}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def published(tmp_path_factory, fresh_mlflow_db, tiny_model_config, tiny_shard_manifest,
              tiny_tokenizer_manifest):
    """A parent trained in its own work directory, recorded on an MLflow run as a pipeline
    run records it (train manifest, tokenizer files, the checkpoint uploaded) and
    registered as `NAME@champion` (the version's files are not needed here)."""
    base = tmp_path_factory.mktemp("published")
    work = base / "parent-work"
    tok = tiny_tokenizer_manifest
    shutil.copytree(tok.output_dir, work / "tokenizer" / tok.digest[:16])
    parent = train(_train_cfg(), tiny_model_config, MaskingConfig(), tiny_shard_manifest, tok,
                   work / "train" / "parent")
    uri = fresh_mlflow_db(base / "mlflow" / "mlflow.db")
    tracker = MlflowTracker(uri, "warm-start")
    run_id = tracker.start_run({"train.max_steps": 2})
    tracker.log_artifacts(run_id, parent.path, "manifests/train")
    for f in (tok.file(tok.model.path), tok.file(tok.vocab.path), tok.path):
        tracker.log_artifacts(run_id, f, "tokenizer")
    ckpt = parent.file(parent.checkpoint_dir)
    tracker.log_artifacts(run_id, ckpt, f"checkpoints/{ckpt.name}")
    tracker.end_run(run_id)
    client = tracker.client
    client.create_registered_model(NAME)
    version = client.create_model_version(NAME, f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias(NAME, "champion", version.version)
    state = json.loads((ckpt / "state.json").read_text())
    return {"uri": uri, "run_id": run_id, "parent": parent, "state": state, "base": base}


def _cfg(published, work, **over) -> PipelineConfig:
    data = {"work_dir": str(work), "tracking": {"tracking_uri": published["uri"]},
            "train": {"init_from": f"models:/{NAME}@champion"}}
    for key, value in over.items():
        section, field = key.split(".")
        data.setdefault(section, {})[field] = value
    return PipelineConfig.model_validate(data)


@pytest.mark.full
@pytest.mark.slow  # an MLflow store and a registered model: about a minute on two cores
def test_alias_resolves_to_the_local_checkpoint_then_the_uploaded_one(
        published, tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest,
        tiny_corpus_manifest):
    cfg = _cfg(published, tmp_path / "work", **{"tokenizer.from_init": True})
    parent = published["parent"]
    here = parent_of(cfg)
    assert here.checkpoint == parent.file(parent.checkpoint_dir)
    assert here.digest == published["state"]["state_sha256"]
    # The parent's work directory is gone: its uploaded checkpoint and tokenizer are used.
    moved = published["base"] / "moved"
    shutil.move(str(published["base"] / "parent-work"), moved)
    try:
        fetched = parent_of(cfg)
        assert fetched.checkpoint.is_relative_to((tmp_path / "work" / "parents").resolve())
        assert (fetched.digest, fetched.step) == (here.digest, 2)
        assert tokenizer_digest_for(cfg, tiny_corpus_manifest) == tiny_tokenizer_manifest.digest
        tok = prepare_tokenizer(cfg, tiny_corpus_manifest)
        assert tok.model.sha256 == tiny_tokenizer_manifest.model.sha256
        assert tok.output_dir.startswith(str((tmp_path / "work" / "tokenizer").resolve()))
        out = tmp_path / "work" / "train" / "child"
        child = train(cfg.train.model_copy(update={"max_steps": 1, "precision": "fp32",
                                                   "compile": "off"}),
                      tiny_model_config, MaskingConfig(), tiny_shard_manifest, tok,
                      out, init_checkpoint=init_checkpoint(cfg, out))
    finally:
        shutil.move(str(moved), published["base"] / "parent-work")
    assert child.init["source"] == f"models:/{NAME}@champion"
    assert child.init["digest"] == published["state"]["state_sha256"]
    assert parent_tags(child.init) == {
        "mlm.init_from": f"models:/{NAME}@champion",
        "mlm.init_digest": published["state"]["state_sha256"], "mlm.init_step": "2",
        "mlm.init_checkpoint": str(fetched.checkpoint)}


@pytest.mark.full
@pytest.mark.slow
def test_run_id_source_and_unknown_alias(published, tmp_path):
    cfg = _cfg(published, tmp_path, **{"train.init_from": published["run_id"]})
    assert parent_of(cfg).digest == published["state"]["state_sha256"]
    with pytest.raises(ValueError, match="models:/warm-parent@nope.*not found"):
        parent_of(_cfg(published, tmp_path, **{"train.init_from": f"models:/{NAME}@nope"}))


def test_config_refuses_tokenizer_reuse_without_a_parent():
    with pytest.raises(ValueError, match="tokenizer.from_init needs train.init_from"):
        PipelineConfig.model_validate({"tokenizer": {"from_init": True}})
