"""Warm start (`train.init_from`) and reusing the parent's tokenizer (`tokenizer.from_init`):
refusals naming every differing field, the parent's weights really loaded (first-step loss
equals the parent's loss on the same batch and masks), the parent in the run's identity,
resume from the run's own checkpoint, and a new corpus encoded with the parent's pieces."""

import json
import shutil

import pytest
import sentencepiece as spm
import torch

from mlm_pipeline.config import (
    MaskingConfig,
    ModelConfig,
    PipelineConfig,
    ShardConfig,
    TokenizerConfig,
    TrainConfig,
)
from mlm_pipeline.masking.maskers import build_masker
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer, adopt_tokenizer, train_tokenizer
from mlm_pipeline.train import BertMLM, train
from mlm_pipeline.train.checkpoint import load_model_state
from mlm_pipeline.train.data import RowCursor, ShardDataset
from mlm_pipeline.train.model import document_ids_from_sep
from mlm_pipeline.train.warm_start import parent_tokenizer, resolve_init


def _train_cfg(**kw) -> TrainConfig:
    base = {"micro_batch_size": 4, "max_steps": 3, "warmup_steps": 1, "log_every": 1,
            "lr": 1e-3, "seed": 11, "precision": "fp32", "compile": "off",
            "checkpoint_interval_s": None}
    return TrainConfig(**{**base, **kw})


def _records(manifest):
    return [json.loads(line) for line in
            manifest.file(manifest.metrics_log).read_text().splitlines()]


@pytest.fixture(scope="module")
def parents(tmp_path_factory, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """Two parents trained in a work directory of their own (holding their tokenizer, as a
    pipeline run's does): 6 steps with seed 11, and 2 with seed 12 (LR 1e-2)."""
    work = tmp_path_factory.mktemp("parent-work")
    tok = tiny_tokenizer_manifest
    shutil.copytree(tok.output_dir, work / "tokenizer" / tok.digest[:16])
    return [train(_train_cfg(seed=seed, max_steps=steps, lr=1e-2), tiny_model_config,
                  MaskingConfig(), tiny_shard_manifest, tok, work / "train" / f"parent-{seed}")
            for seed, steps in ((11, 6), (12, 2))]


def test_refuses_other_architecture_naming_each_field(tmp_path, parents, tiny_model_config,
                                                      tiny_shard_manifest,
                                                      tiny_tokenizer_manifest):
    wider = tiny_model_config.model_copy(update={"hidden_size": 64, "num_layers": 3})
    with pytest.raises(ValueError) as err:
        train(_train_cfg(init_from=parents[0].output_dir), wider, MaskingConfig(),
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "child")
    message = str(err.value)
    assert "model.hidden_size: 32 in the source, 64 in the config" in message
    assert "model.num_layers: 2 in the source, 3 in the config" in message
    assert "intermediate_size" not in message  # equal fields are not named
    assert not (tmp_path / "child" / "checkpoints").exists()


@pytest.mark.full
@pytest.mark.slow  # the export imports transformers: about 10 s
def test_an_exported_model_needs_its_own_tokenizer_naming_its_checkpoint(
        tmp_path, parents, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """An export is a Hugging Face parent (`train.hf_import`); with the run's SentencePiece
    tokenizer instead of the export's `tokenizer.json` it is refused, the message naming
    the fix and the checkpoint it was exported from."""
    from mlm_pipeline.train.export import export_checkpoint

    exported = export_checkpoint(parents[0].file(parents[0].checkpoint_dir), tmp_path / "hf")
    with pytest.raises(ValueError, match=r"tokenizer: the source's files .* set "
                                         r"tokenizer.adopt_from=.*checkpoint step-00000006 of "
                                         r"run parent-11"):
        train(_train_cfg(init_from=str(exported)), tiny_model_config, MaskingConfig(),
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "child")


def test_refuses_other_vocabulary_naming_each_field(tmp_path, parents, tiny_model_config,
                                                    tiny_corpus_manifest, tiny_shard_manifest,
                                                    tiny_tokenizer_manifest):
    tok = train_tokenizer(TokenizerConfig(vocab_size=100), tiny_corpus_manifest, tmp_path)
    shards = write_shards(ShardConfig(seq_len=16, rows_per_shard=64), tiny_corpus_manifest,
                          tok, tmp_path)
    with pytest.raises(ValueError) as err:
        train(_train_cfg(init_from=parents[0].output_dir), tiny_model_config, MaskingConfig(),
              shards, tok, tmp_path / "child")
    message = str(err.value)
    assert "vocab_size: 128 in the source, 100 in the config's shards" in message
    assert (f"tokenizer: digest {tiny_tokenizer_manifest.digest[:16]} in the source, "
            f"{tok.digest[:16]} in the config") in message
    assert "model." not in message and "seq_len" not in message


def _parent_loss_on_first_batch(parent, shards, train_cfg) -> float:
    """The loss of the parent's final weights on the batch and masks a fresh run with
    `train_cfg` trains first: the weights read from the checkpoint file directly, the
    batch from the run's first row indices, the masks from the masking function."""
    ckpt = parent.file(parent.checkpoint_dir)
    state = json.loads((ckpt / "state.json").read_text())
    model = BertMLM(ModelConfig.model_validate(state["config"]["model"]), state["vocab_size"],
                    state["seq_len"])
    model.load_state_dict(load_model_state(ckpt))
    dataset = ShardDataset(shards, "train")
    rows, epoch = RowCursor(len(dataset), train_cfg.micro_batch_size, train_cfg.seed).next_batch()
    masker = build_masker(MaskingConfig(), shards.vocab_size)
    original = dataset.get(rows)
    input_ids, labels = masker(original, torch.from_numpy(rows), epoch)
    documents = document_ids_from_sep(original) if train_cfg.document_attention else None
    with torch.no_grad():
        return float(model(input_ids, labels=labels, document_ids=documents).loss)


def test_first_step_loss_is_the_parents(tmp_path, parents, tiny_model_config,
                                        tiny_shard_manifest, tiny_tokenizer_manifest):
    parent = parents[0]
    cfg = _train_cfg(init_from=parent.output_dir, seed=5, max_steps=2, lr=5e-4)
    child = train(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                  tiny_tokenizer_manifest, tmp_path / "child")
    cold = train(_train_cfg(seed=5, max_steps=2, lr=5e-4), tiny_model_config, MaskingConfig(),
                 tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "cold")
    want = _parent_loss_on_first_batch(parent, tiny_shard_manifest, cfg)
    first = _records(child)[0]
    print(f"parent loss on the batch {want:.6f}, warm first step {first['train/loss']:.6f}, "
          f"cold first step {_records(cold)[0]['train/loss']:.6f}")
    assert first["step"] == 1
    assert first["train/loss"] == pytest.approx(want, rel=1e-5)
    assert _records(cold)[0]["train/loss"] != pytest.approx(want, rel=1e-3)
    # a fresh optimizer and schedule: the step-1 LR is the warm-up's, not the parent's
    assert first["train/lr"] == pytest.approx(5e-4)
    assert child.steps == 2  # the step count starts afresh
    parent_state = json.loads((parent.file(parent.checkpoint_dir) / "state.json").read_text())
    assert child.init == {"source": parent.output_dir,
                          "checkpoint": str(parent.file(parent.checkpoint_dir)),
                          "digest": parent_state["state_sha256"], "step": 6}
    assert child.inputs["init"] == parent_state["state_sha256"]


def test_digest_differs_between_parents_and_resume_ignores_the_parent(
        tmp_path, parents, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    # The same run directory name and config text (one source path) under both parents.
    moved = tmp_path / "parent"
    children = []
    for i, parent in enumerate(parents):
        shutil.copytree(parent.output_dir, moved)
        cfg = _train_cfg(init_from=str(moved), max_steps=1)
        children.append(train(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                              tiny_tokenizer_manifest, tmp_path / str(i) / "run"))
        shutil.rmtree(moved)
    assert children[0].init["digest"] != children[1].init["digest"]
    assert (children[0].init["step"], children[1].init["step"]) == (6, 2)
    assert children[0].digest != children[1].digest
    # The parent is gone: a rerun resumes from the run's own checkpoint, parent unread.
    again = train(_train_cfg(init_from=str(moved), max_steps=2), tiny_model_config,
                  MaskingConfig(), tiny_shard_manifest, tiny_tokenizer_manifest,
                  tmp_path / "1" / "run")
    assert again.steps == 2
    assert again.init == children[1].init


def test_reused_tokenizer_encodes_a_new_corpus_with_the_parents_ids(
        tmp_path, monkeypatch, parents, tiny_model_config, tiny_paragraphs,
        make_corpus_manifest, tiny_tokenizer_manifest):
    import mlm_pipeline.tokenizer.stage as tokenizer_stage

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained")

    monkeypatch.setattr(tokenizer_stage, "_run_trainer", no_training)
    grown = tiny_paragraphs[::-1] + ["Le chat dort près de la fenêtre ouverte."]
    corpus = make_corpus_manifest(tmp_path / "corpus", grown)
    init = resolve_init(parents[0].output_dir)
    work = tmp_path / "work"
    tok = adopt_tokenizer(parent_tokenizer(init), work)
    assert tok.digest == tiny_tokenizer_manifest.digest
    assert tok.output_dir == str((work / "tokenizer" / tok.digest[:16]).resolve())
    assert tok.model.sha256 == tiny_tokenizer_manifest.model.sha256
    sample = "Le chat dort près de la fenêtre."
    parent_sp = spm.SentencePieceProcessor(
        model_file=str(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path)))
    assert Tokenizer.load(tok).encode([sample])[0] == parent_sp.encode(sample)
    assert adopt_tokenizer(parent_tokenizer(init), work) == tok  # reused, not copied again
    shards = write_shards(ShardConfig(seq_len=16, rows_per_shard=64), corpus, tok, work)
    assert shards.inputs["tokenizer"] == tiny_tokenizer_manifest.digest
    child = train(_train_cfg(init_from=parents[0].output_dir, max_steps=1), tiny_model_config,
                  MaskingConfig(), shards, tok, work / "train" / "child")
    assert child.steps == 1 and child.init["step"] == 6


def test_config_level_tokenizer_reuse_is_what_the_flows_run(
        tmp_path, monkeypatch, parents, tiny_corpus_manifest, tiny_tokenizer_manifest):
    import mlm_pipeline.tokenizer.stage as tokenizer_stage
    from mlm_pipeline.app.parents import prepare_tokenizer, tokenizer_digest_for

    monkeypatch.setattr(tokenizer_stage, "_run_trainer", None)  # a call would fail
    cfg = PipelineConfig.model_validate({
        "work_dir": str(tmp_path / "work"), "tokenizer": {"from_init": True, "vocab_size": 99},
        "train": {"init_from": parents[0].output_dir}})
    assert tokenizer_digest_for(cfg, tiny_corpus_manifest) == tiny_tokenizer_manifest.digest
    tok = prepare_tokenizer(cfg, tiny_corpus_manifest)
    assert (tok.digest, tok.vocab_size) == (tiny_tokenizer_manifest.digest, 128)
    assert tok.output_dir == str((tmp_path / "work" / "tokenizer" / tok.digest[:16]).resolve())


@pytest.mark.full
@pytest.mark.slow  # torchrun starts two processes: about half a minute on two cores
def test_two_ranks_start_from_the_checkpoint_the_launcher_fetched(
        tmp_path, monkeypatch, parents, tiny_model_config, tiny_shard_manifest,
        tiny_tokenizer_manifest):
    from mlm_pipeline.config import DistributedConfig
    from mlm_pipeline.train.launch import run_torchrun

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parent = parents[0]
    checkpoint = parent.file(parent.checkpoint_dir)
    # What `parents.launch_init` hands the ranks for an MLflow source.
    cfg = _train_cfg(init_from="models:/warm-parent@champion", max_steps=1,
                     micro_batch_size=2, distributed=DistributedConfig(nproc_per_node=2))
    two = run_torchrun(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                       tiny_tokenizer_manifest, tmp_path / "two",
                       extra={"init_checkpoint": str(checkpoint)})
    state = json.loads((checkpoint / "state.json").read_text())
    assert two.init == {"source": "models:/warm-parent@champion",
                        "checkpoint": str(checkpoint), "digest": state["state_sha256"],
                        "step": 6}
    # both ranks began from the parent: their first global batch's loss is the parent's
    want = _parent_loss_on_first_batch(
        parent, tiny_shard_manifest, cfg.model_copy(update={"micro_batch_size": 4}))
    assert _records(two)[0]["train/loss"] == pytest.approx(want, rel=1e-5)
