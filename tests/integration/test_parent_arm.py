"""An adapted run is evaluated against the model it started from (`evaluate.parent`).

A tiny parent run is trained, a child warm-started from its checkpoint trains a few more
steps at a high learning rate (so the two differ), and the child's final evaluation must
report the parent's figures computed from the parent's own weights: the held-out loss on
the same rows and fixed masks (recomputed here with full logits), the linear probe
(recomputed from features extracted here from the parent checkpoint loaded on its own)
and fine-tuning's parent arm (its classifiers hold the parent's weights, its paired
difference follows from the per-seed test accuracies). A parent that cannot be read is a
tag per figure, never a failed evaluation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlm_pipeline.config import EvalConfig, FinetuneConfig, MaskingConfig, TrainConfig
from mlm_pipeline.evaluate import evaluate, ours
from mlm_pipeline.evaluate.finetune import build_classifiers
from mlm_pipeline.masking.maskers import keyed_masking
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import train
from mlm_pipeline.train.data import ShardDataset
from mlm_pipeline.train.model import document_ids_from_sep
from mlm_pipeline.train.verified import load_model
from tests.integration.test_linear_probe import (
    SEQ_LEN,
    reference_features,
    reference_split,
    sklearn_probe,
)
from tests.integration.test_linear_probe import csv_path, reviews  # noqa: F401 (fixtures)

#: t(0.975, 1), Student's t quantile for a 95 % interval over 2 seeds (statistical tables).
T_975_1 = 12.706204736174705
#: A quick protocol: one rate, two seeds, one epoch.
QUICK = FinetuneConfig(enabled=True, epochs=1, lr=[3e-3], seeds=2, batch_size=8,
                       seq_len=SEQ_LEN, seed=5)
EVAL = EvalConfig(batch_size=8, max_rows=24, probes=[])
#: The probe as `test_linear_probe` sets it up (its split is recomputed there).
PROBE = dict(max_rows=120, test_fraction=0.3, dev_fraction=0.2, tfidf_C=3.0,
             random_init_seeds=2)


def _train(cfg: TrainConfig, model_cfg, shards, tokenizer, out):
    return train(cfg, model_cfg, MaskingConfig(), shards, tokenizer, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """(parent, child): the child warm-started from the parent's final checkpoint."""
    root = tmp_path_factory.mktemp("parent-arm")
    base = dict(micro_batch_size=4, warmup_steps=0, precision="fp32", seed=1)
    parent = _train(TrainConfig(max_steps=3, lr=1e-3, **base), tiny_model_config,
                    tiny_shard_manifest, tiny_tokenizer_manifest, root / "parent")
    child = _train(TrainConfig(max_steps=4, lr=3e-2, init_from=str(
        parent.file(parent.checkpoint_dir)), **base), tiny_model_config,
        tiny_shard_manifest, tiny_tokenizer_manifest, root / "child")
    return parent, child


@pytest.fixture(scope="module")
def evaluated(runs, csv_path, tiny_shard_manifest, tiny_tokenizer_manifest,  # noqa: F811
              tmp_path_factory):
    from mlm_pipeline.config import LinearProbeConfig

    _, child = runs
    probe = LinearProbeConfig(data_path=str(csv_path), **PROBE)
    return evaluate(EVAL, child, tiny_shard_manifest, tiny_tokenizer_manifest,
                    tmp_path_factory.mktemp("work"), probe, finetune=QUICK)


def test_the_child_records_its_parent_and_differs_from_it(runs):
    parent, child = runs
    assert child.init["digest"] and child.init["step"] == 3
    a = load_model(parent.file(parent.checkpoint_dir)).state_dict()
    b = load_model(child.file(child.checkpoint_dir)).state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def _reference_mlm(model, shards, tok, rows):
    """Loss and accuracy over the first `rows` validation rows with the evaluation's fixed
    masks (BERT's 15 %, keyed by `EvalConfig.seed`), from the full (rows, L, V) logits."""
    cfg = MaskingConfig().model_copy(update={"mlm_probability": 0.15})
    masking = keyed_masking(cfg, tok, seed=EVAL.seed)
    data = ShardDataset(shards, "validation")
    index = torch.arange(min(rows, len(data)))
    original = data.get(index.numpy())
    input_ids, labels = masking(original, index, 0)
    logits = model(input_ids, document_ids=document_ids_from_sep(original)).logits
    picked = labels != -100
    targets = labels[picked]
    chosen = logits[picked].float()
    return (float(F.cross_entropy(chosen, targets, reduction="sum")) / targets.numel(),
            float((chosen.argmax(-1) == targets).float().mean()))


def test_the_parent_loss_is_the_parent_checkpoint_on_the_same_rows_and_masks(
        runs, evaluated, tiny_shard_manifest, tiny_tokenizer_manifest):
    parent, child = runs
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    assert EVAL.mlm_probability == 0.15  # the rate the reference masks at
    loss, accuracy = _reference_mlm(load_model(parent.file(parent.checkpoint_dir)),
                                    tiny_shard_manifest, tok, EVAL.max_rows)
    m = evaluated.metrics
    assert m["eval/parent_loss"] == pytest.approx(loss, rel=1e-5)
    assert m["eval/parent_mlm_accuracy"] == pytest.approx(accuracy)
    trained_loss, _ = _reference_mlm(load_model(child.file(child.checkpoint_dir)),
                                     tiny_shard_manifest, tok, EVAL.max_rows)
    assert m["eval/loss"] == pytest.approx(trained_loss, rel=1e-5)
    assert not math.isclose(m["eval/parent_loss"], m["eval/loss"], rel_tol=1e-4)


def test_the_parent_probe_is_the_parent_checkpoint_probed_independently(
        runs, evaluated, reviews, tiny_tokenizer_manifest):  # noqa: F811
    parent, child = runs
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    ref, _ = reference_split(reviews, 0.3, 0.2, 120)
    texts = {s: [t for t, _ in ref[s]] for s in ("train", "test")}
    labels = {s: [c for _, c in ref[s]] for s in ("train", "test")}
    features = {}
    for name, run in (("parent", parent), ("child", child)):
        module = load_model(run.file(run.checkpoint_dir))
        features[name] = {s: reference_features(module, tok, texts[s]) for s in texts}
    assert not np.allclose(features["parent"]["train"], features["child"]["train"])
    want = sklearn_probe(features["parent"]["train"], labels["train"],
                         features["parent"]["test"], labels["test"], 1.0)
    assert evaluated.metrics["probe/accuracy_parent"] == pytest.approx(want, abs=1e-9)
    assert evaluated.metrics["probe/accuracy"] == pytest.approx(sklearn_probe(
        features["child"]["train"], labels["train"], features["child"]["test"],
        labels["test"], 1.0), abs=1e-9)


def test_the_finetune_parent_arm_starts_from_the_parent_weights(runs, tiny_tokenizer_manifest):
    parent, child = runs
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    parent_module = load_model(parent.file(parent.checkpoint_dir))
    before = {k: v.clone() for k, v in parent_module.state_dict().items()}
    encoder = ours(load_model(child.file(child.checkpoint_dir)), tok)
    adapted, scratch, from_parent = build_classifiers(encoder, QUICK, 5, 2, parent_module)
    got = from_parent.encoder.state_dict()
    assert all(torch.equal(got[k], before[k]) for k in before)
    assert any(not torch.equal(got[k], scratch.encoder.state_dict()[k]) for k in before)
    assert any(not torch.equal(got[k], adapted.encoder.state_dict()[k]) for k in before)
    assert torch.equal(from_parent.classifier.weight, scratch.classifier.weight)
    assert got["embeddings.word_embeddings.weight"].data_ptr() != before[
        "embeddings.word_embeddings.weight"].data_ptr()  # a copy: the parent stays as it was


def test_the_adapted_minus_parent_difference_is_paired_by_seed(evaluated):
    m = {k.removeprefix("finetune/"): v for k, v in evaluated.metrics.items()
         if k.startswith("finetune/")}
    record = evaluated.config["downstream"][0]["finetune"]
    acc = record["test_accuracy"]
    assert set(acc) == {"pretrained", "scratch", "parent"} and record["seeds"] == [5, 6]
    diffs = [a - p for a, p in zip(acc["pretrained"], acc["parent"])]
    mean, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    assert m["diff_parent"] == pytest.approx(mean)
    assert m["diff_parent_sd"] == pytest.approx(sd)
    half = T_975_1 * sd / math.sqrt(2)
    assert m["diff_parent_ci95_low"] == pytest.approx(mean - half)
    assert m["diff_parent_ci95_high"] == pytest.approx(mean + half)
    assert m["parent_accuracy"] == pytest.approx(np.mean(acc["parent"]))
    assert m["parent_accuracy_sd"] == pytest.approx(np.std(acc["parent"], ddof=1))
    scratch = [a - s for a, s in zip(acc["pretrained"], acc["scratch"])]
    assert m["diff"] == pytest.approx(np.mean(scratch))  # the existing figure, unchanged
    assert record["lr"]["parent"] == m["parent_lr"] == 3e-3


def test_an_unreadable_parent_is_a_tag_per_figure(runs, csv_path, tmp_path,  # noqa: F811
                                                  tiny_shard_manifest, tiny_tokenizer_manifest):
    from mlm_pipeline.config import LinearProbeConfig

    _, child = runs
    gone = child.model_copy(update={"init": {**child.init,
                                             "checkpoint": str(tmp_path / "moved")}})
    probe = LinearProbeConfig(data_path=str(csv_path), **PROBE)
    result = evaluate(EVAL, gone, tiny_shard_manifest, tiny_tokenizer_manifest,
                      tmp_path / "work", probe)
    assert not any("parent" in k for k in result.metrics)
    for figure in ("eval/parent_loss", "probe/accuracy_parent"):
        assert "no such directory" in result.tags[f"unavailable.{figure}"]
    assert "unavailable.finetune/parent_accuracy" not in result.tags  # fine-tuning is off
    assert result.metrics["probe/accuracy"] > 0


def test_a_run_without_a_parent_has_no_parent_figures_or_tags(
        runs, tmp_path, tiny_shard_manifest, tiny_tokenizer_manifest):
    parent, _ = runs
    result = evaluate(EVAL, parent, tiny_shard_manifest, tiny_tokenizer_manifest,
                      tmp_path / "work")
    assert not any("parent" in k for k in [*result.metrics, *result.tags])
