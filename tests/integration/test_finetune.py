"""Fine-tuning evaluation: a real tiny encoder and SentencePiece tokenizer, and a labelled
CSV of a few dozen rows written here (the real set is fetched only by the probe's slow
test)."""

from __future__ import annotations

import csv
import logging

import pytest
import torch

from mlm_pipeline.config import (
    EvalConfig,
    FinetuneConfig,
    LinearProbeConfig,
    MaskingConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate, finetune_metrics
from mlm_pipeline.evaluate.finetune import (
    build_classifiers,
    classifier_accuracy,
    train_classifier,
)
from mlm_pipeline.evaluate.probe_data import read_polarity_csv
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import BertMLM, train

SEQ_LEN = 24
#: A quick recipe: a large learning rate so that one epoch visibly moves the weights.
RECIPE = FinetuneConfig(enabled=True, epochs=1, lr=1e-3, batch_size=8, seq_len=SEQ_LEN,
                        warmup_ratio=0.1, seed=3)


@pytest.fixture(scope="module")
def csv_path(tiny_paragraphs, tmp_path_factory):
    """40 unique rows, 24 positive and 16 negative, then 4 exact repeats."""
    sentences = [s.strip() for p in tiny_paragraphs for s in p.split(".") if s.strip()]
    rows = []
    for i in range(40):
        good = i % 5 < 3
        rows.append((f"{sentences[i % len(sentences)]}. "
                     f"{'Magnifique, je recommande' if good else 'Ennuyeux et décevant'} ({i})",
                     "1" if good else "-1"))
    path = tmp_path_factory.mktemp("finetune") / "reviews.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows + rows[:4])
    return path


@pytest.fixture(scope="module")
def data(csv_path) -> LinearProbeConfig:
    return LinearProbeConfig(data_path=str(csv_path), test_fraction=0.25)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_manifest) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_manifest)


@pytest.fixture(scope="module")
def model(tiny_model_config, tok) -> BertMLM:
    """The 'pretrained' encoder: weights of its own seed (the global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        encoder = BertMLM(tiny_model_config, tok.vocab_size, SEQ_LEN)
    return encoder.eval()


def encoder_state(clf) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in clf.encoder.state_dict().items()}


def test_pretrained_and_scratch_share_the_head_not_the_encoder(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pretrained, scratch = build_classifiers(model, RECIPE)
    for name, value in pretrained.classifier.state_dict().items():
        assert torch.equal(value, scratch.classifier.state_dict()[name]), name
    assert pretrained.classifier.weight.abs().sum() > 0  # drawn, not zeros
    for name, value in before.items():
        assert torch.equal(pretrained.encoder.state_dict()[name], value), name  # a copy
    differ = [name for name, value in before.items()
              if value.is_floating_point() and value.std() > 0
              and not torch.equal(scratch.encoder.state_dict()[name], value)]
    assert "embeddings.word_embeddings.weight" in differ
    assert any(name.startswith("layers.") for name in differ)
    # Same architecture: the same parameter names and shapes.
    assert {k: v.shape for k, v in scratch.encoder.state_dict().items()} == \
        {k: v.shape for k, v in before.items()}
    # The head does not depend on the encoder's weights: another model, the same head.
    torch.manual_seed(99)
    other = BertMLM(model.cfg, model.vocab_size, SEQ_LEN)
    assert torch.equal(build_classifiers(other, RECIPE)[0].classifier.weight,
                       pretrained.classifier.weight)


def test_one_epoch_changes_the_encoder_and_leaves_the_model_alone(model, tok, data):
    split_rows = read_polarity_csv(data.data_path)
    texts = tuple(t for t, _ in split_rows[:16])
    labels = tuple(c for _, c in split_rows[:16])
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    clf, _ = build_classifiers(model, RECIPE)
    start = encoder_state(clf)
    train_classifier(clf, tok, texts, labels, RECIPE)
    after = encoder_state(clf)
    changed = [k for k in start if not torch.equal(start[k], after[k])]
    for layer in range(model.cfg.num_layers):
        assert any(k.startswith(f"layers.{layer}.") for k in changed), layer
    assert "embeddings.word_embeddings.weight" in changed
    for name, value in before_model.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_same_seed_gives_the_same_weights_and_figures(model, tok, data):
    first = finetune_metrics(RECIPE, data, model, tok)
    second = finetune_metrics(RECIPE, data, model, tok)
    assert first is not None and second is not None
    first.pop("finetune/wall_time_s"), second.pop("finetune/wall_time_s")
    assert first == second
    rows = read_polarity_csv(data.data_path)
    texts, labels = tuple(t for t, _ in rows[:24]), tuple(c for _, c in rows[:24])
    states = []
    for seed in (RECIPE.seed, RECIPE.seed, RECIPE.seed + 1):
        recipe = RECIPE.model_copy(update={"seed": seed})
        clf, _ = build_classifiers(model, recipe)
        train_classifier(clf, tok, texts, labels, recipe)
        states.append({k: v.clone() for k, v in clf.state_dict().items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_metrics_on_the_probe_split(model, tok, data):
    got = finetune_metrics(RECIPE, data, model, tok)
    assert got is not None
    # The probe's split, written out again: 40 unique rows (24 / 16 per class), a quarter of
    # each class in test: round(6.0) + round(4.0) = 10 test rows, 30 train rows.
    assert got["finetune/test_rows"] == 10 and got["finetune/train_rows"] == 30
    # Majority class of train is positive (18 of 30); positives in test: 6 of 10.
    assert got["finetune/majority_accuracy"] == pytest.approx(0.6)
    assert got["finetune/epochs"] == 1
    for key in ("finetune/accuracy", "finetune/scratch_accuracy", "finetune/tfidf_accuracy"):
        assert got[key] * 10 == pytest.approx(round(got[key] * 10)), key  # k of 10 rows
    assert got["finetune/wall_time_s"] > 0



def test_accuracy_counts_rows_one_by_one(model, tok, data):
    """Batching and padding do not change a prediction: each row is scored alone, unpadded,
    and the bias set between two margins so that both classes are predicted."""
    rows = read_polarity_csv(data.data_path)[:12]
    texts, labels = tuple(t for t, _ in rows), tuple(c for _, c in rows)
    clf, _ = build_classifiers(model, RECIPE)
    clf.eval()
    margins = []
    with torch.no_grad():
        for text in texts:
            x = torch.tensor([[tok.cls_id, *tok.encode([text])[0][: SEQ_LEN - 2], tok.sep_id]])
            logits = clf(x, torch.ones_like(x, dtype=torch.bool))[0] - clf.classifier.bias
            margins.append(float(logits[1] - logits[0]))
        ordered = sorted(margins)
        threshold = (ordered[5] + ordered[6]) / 2
        clf.classifier.bias.copy_(torch.tensor([0.0, -threshold]))
    expected = sum((m > threshold) == bool(c) for m, c in zip(margins, labels, strict=True))
    assert classifier_accuracy(clf, tok, texts, labels, RECIPE) == pytest.approx(expected / 12)


def test_a_missing_dataset_warns_and_skips(tmp_path, model, tok, caplog):
    data = LinearProbeConfig(data_path=str(tmp_path / "absent.csv"))
    with caplog.at_level(logging.WARNING):
        assert finetune_metrics(RECIPE, data, model, tok) is None
    assert "absent.csv" in caplog.text and "fine-tuning evaluation skipped" in caplog.text


def test_evaluate_stage_adds_the_finetune_metrics(tmp_path, data, tiny_model_config,
                                                  tiny_shard_manifest, tiny_tokenizer_manifest):
    """The final evaluation runs it when enabled, on the `linear_probe` section's data,
    with the linear probe off; disabled, no `finetune/*` key."""
    trained = train(TrainConfig(micro_batch_size=4, max_steps=2, warmup_steps=0,
                                precision="fp32"),
                    tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                    tiny_tokenizer_manifest, tmp_path / "run")
    probe_off = data.model_copy(update={"enabled": False})
    cfg = EvalConfig(batch_size=8, max_rows=8, probes=[])
    on = evaluate(cfg, trained, tiny_shard_manifest, tiny_tokenizer_manifest,
                  tmp_path / "work", probe_off, finetune=RECIPE)
    assert on.metrics["finetune/train_rows"] == 30 and on.metrics["finetune/test_rows"] == 10
    assert 0.0 <= on.metrics["finetune/accuracy"] <= 1.0
    assert not any(k.startswith("probe/") for k in on.metrics)
    off = evaluate(cfg, trained, tiny_shard_manifest, tiny_tokenizer_manifest,
                   tmp_path / "work", probe_off, finetune=FinetuneConfig())
    assert not any(k.startswith("finetune/") for k in off.metrics)
    assert off.digest != on.digest
