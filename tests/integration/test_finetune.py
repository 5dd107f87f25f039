"""The fine-tuning protocol: a real tiny encoder and SentencePiece tokenizer, and a labelled
CSV of a few dozen rows written here (the real set is fetched only by the probe's slow
test). The protocol's guarantees are checked so that they fail when broken: the scratch
arm is a fresh draw, never the trained weights; the learning rate and epoch are chosen on
dev rows alone; the reported spread and interval follow from the per-seed figures."""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mlm_pipeline.config import (
    EvalConfig,
    FinetuneConfig,
    LinearProbeConfig,
    MaskingConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate, finetune_metrics, hugging_face, ours, run_finetune
from mlm_pipeline.evaluate.encoders import encoder_rows
from mlm_pipeline.evaluate.finetune import (
    EpochScores,
    build_classifiers,
    choose_on_dev,
    finetune_run,
    finetune_task,
)
from mlm_pipeline.evaluate.tasks import Rows, load_task
from mlm_pipeline.progress import reporting
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import BertMLM, train
from tests.fakes import RecordedProgress

SEQ_LEN = 24
#: A quick protocol: two rates, three seeds, two epochs.
RECIPE = FinetuneConfig(enabled=True, epochs=2, lr=[1e-3, 3e-3], seeds=3, batch_size=8,
                        seq_len=SEQ_LEN, warmup_ratio=0.1, seed=3)
#: t(0.975, 2), Student's t quantile for a 95 % interval over 3 seeds (statistical tables).
T_975_2 = 4.302652729911275


@pytest.fixture(scope="module")
def csv_path(tiny_paragraphs, tmp_path_factory):
    """48 unique rows, 30 positive and 18 negative, then 4 exact repeats."""
    sentences = [s.strip() for p in tiny_paragraphs for s in p.split(".") if s.strip()]
    rows = []
    for i in range(48):
        good = i % 8 < 5
        rows.append((f"{sentences[i % len(sentences)]}. "
                     f"{'Magnifique, je recommande' if good else 'Ennuyeux et décevant'} ({i})",
                     "1" if good else "-1"))
    path = tmp_path_factory.mktemp("finetune") / "reviews.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows + rows[:4])
    return path


@pytest.fixture(scope="module")
def data(csv_path) -> LinearProbeConfig:
    return LinearProbeConfig(data_path=str(csv_path), test_fraction=0.25, dev_fraction=0.25)


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


@pytest.fixture(scope="module")
def split(data):
    return load_task(data.tasks[0], data)


@pytest.fixture(scope="module")
def recorded():
    return RecordedProgress()


@pytest.fixture(scope="module")
def protocol(data, tok, model, split, recorded):
    with reporting(recorded):
        return finetune_task(RECIPE, data, ours(model, tok), split)


def test_the_protocol_reports_every_epoch_of_every_run(protocol, recorded, split):
    """Stage `finetune <task>` counts epochs: 2 arms x 2 rates x 3 seeds x 2 epochs = 24,
    one update per epoch with the run's arm, rate, seed and dev accuracy, then finish."""
    calls = [c for c in recorded.calls if c[1] == f"finetune {split.name}"]
    assert calls[0][:3] == ("start", f"finetune {split.name}", 24.0)
    updates = [c for c in calls if c[0] == "update"]
    assert [c[2] for c in updates] == [float(i) for i in range(1, 25)]
    runs = {(c[3]["arm"], c[3]["lr"], c[3]["seed"]) for c in updates}
    assert runs == {(arm, lr, seed) for arm in ("pretrained", "scratch")
                    for lr in ("0.001", "0.003") for seed in (3, 4, 5)}
    assert all(0.0 <= c[3]["dev_accuracy"] <= 1.0 for c in updates)
    assert calls[-1][0] == "finish"


def test_the_scratch_arm_is_a_fresh_draw_never_the_trained_weights(model, tok,
                                                                    tiny_model_config):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pretrained, scratch = build_classifiers(ours(model, tok), RECIPE, 7, 2)
    assert torch.equal(pretrained.classifier.weight, scratch.classifier.weight)
    assert torch.equal(pretrained.classifier.bias, scratch.classifier.bias)
    assert pretrained.classifier.weight.abs().sum() > 0  # drawn, not zeros
    trained_storage = {p.data_ptr() for p in model.parameters()}
    for clf in (pretrained, scratch):  # neither shares a tensor with the trained model
        assert not trained_storage & {p.data_ptr() for p in clf.encoder.parameters()}
    for name, value in before.items():
        assert torch.equal(pretrained.encoder.state_dict()[name], value), name  # a copy
    # The scratch encoder is exactly BERT's init drawn by the seed, built here again.
    torch.manual_seed(7)
    expected = BertMLM(tiny_model_config, tok.vocab_size, SEQ_LEN).state_dict()
    for name, value in scratch.encoder.state_dict().items():
        assert torch.equal(value, expected[name]), name
    differ = [n for n, v in before.items() if v.is_floating_point() and v.std() > 0
              and not torch.equal(scratch.encoder.state_dict()[n], v)]
    assert "embeddings.word_embeddings.weight" in differ
    assert any(n.startswith("layers.") for n in differ)


def test_the_split_keeps_dev_out_of_test_and_train(split, csv_path):
    texts = {name: set(rows.texts) for name, rows in
             (("train", split.train), ("dev", split.dev), ("test", split.test))}
    assert not texts["dev"] & texts["test"] and not texts["dev"] & texts["train"]
    assert not texts["train"] & texts["test"]
    # 48 unique rows (30 / 18): test round(7.5) + round(4.5) = 8 + 5 (half up), dev a
    # quarter of the rest: round(5.5) + round(3.25) = 6 + 3, train 16 + 10.
    assert (len(split.test), len(split.dev), len(split.train)) == (13, 9, 26)
    assert split.duplicates_dropped == 4


def test_the_choice_reads_dev_only(data, tok, model, split, protocol):
    """Test labels flipped: the same learning rate, epoch and dev accuracy are chosen,
    and every test accuracy becomes its complement."""
    flipped = replace(split, test=Rows(split.test.texts, None,
                                       tuple(1 - y for y in split.test.labels)))
    got, record = protocol
    again, record_again = finetune_task(RECIPE, data, ours(model, tok), flipped)
    for key in ("lr", "epoch", "dev_accuracy", "scratch_lr", "scratch_epoch",
                "scratch_dev_accuracy"):
        assert again[key] == got[key], key
    for arm in ("pretrained", "scratch"):
        assert record_again["test_accuracy"][arm] == pytest.approx(
            [1 - a for a in record["test_accuracy"][arm]])


def test_choose_on_dev_follows_dev_whatever_the_test_predictions():
    def run(dev_acc, dev_loss, test):
        return EpochScores(list(dev_acc), list(dev_loss), [list(t) for t in test])

    perfect, wrong = [1, 1], [0, 0]
    runs = {1e-3: [run((0.5, 0.7), (1.0, 0.9), (perfect, wrong)),
                   run((0.6, 0.7), (1.0, 0.8), (perfect, wrong))],
            3e-4: [run((0.6, 0.6), (0.7, 0.7), (perfect, perfect)),
                   run((0.6, 0.6), (0.7, 0.7), (perfect, perfect))]}
    choice = choose_on_dev(runs)
    assert (choice.lr, choice.epoch) == (1e-3, 2)  # mean dev 0.7, although test is worst
    assert choice.dev_accuracy == pytest.approx(0.7)
    tie = {1e-3: [run((0.7,), (0.5,), (wrong,))], 3e-4: [run((0.7,), (0.4,), (perfect,))]}
    assert choose_on_dev(tie).lr == 3e-4  # equal accuracy: the lower dev loss


def test_reported_figures_follow_from_the_per_seed_results(protocol, split):
    got, record = protocol
    pre = np.array(record["test_accuracy"]["pretrained"])
    scr = np.array(record["test_accuracy"]["scratch"])
    assert record["seeds"] == [3, 4, 5] and len(pre) == len(scr) == 3
    for value in (*pre, *scr):  # k of 13 test rows
        assert value * 13 == pytest.approx(round(value * 13))
    assert got["accuracy"] == pytest.approx(pre.mean())
    assert got["accuracy_sd"] == pytest.approx(pre.std(ddof=1))
    assert got["scratch_accuracy"] == pytest.approx(scr.mean())
    d = pre - scr
    half = T_975_2 * d.std(ddof=1) / math.sqrt(3)
    assert got["diff"] == pytest.approx(d.mean())
    assert (got["diff_ci95_low"], got["diff_ci95_high"]) == pytest.approx(
        (d.mean() - half, d.mean() + half))
    assert got["lr"] in (1e-3, 3e-3) and 1 <= got["epoch"] <= 2
    assert (got["train_rows"], got["dev_rows"], got["test_rows"]) == (26, 9, 13)
    assert got["majority_accuracy"] == pytest.approx(8 / 13)  # positives in test


def test_one_run_trains_the_encoder_and_leaves_the_model_alone(model, tok, split):
    encoder = ours(model, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    encoded = {n: encoder_rows(encoder, r.texts, input="head_tail", seq_len=SEQ_LEN)
               for n, r in (("train", split.train), ("dev", split.dev), ("test", split.test))}
    labels = {"train": split.train.labels, "dev": split.dev.labels, "test": split.test.labels}
    clf, _ = build_classifiers(encoder, RECIPE, 3, 2)
    start = {k: v.detach().clone() for k, v in clf.encoder.state_dict().items()}
    scores = finetune_run(clf, encoded, labels, RECIPE, 1e-3, 3)
    changed = [k for k, v in clf.encoder.state_dict().items() if not torch.equal(start[k], v)]
    assert "embeddings.word_embeddings.weight" in changed
    for layer in range(model.cfg.num_layers):
        assert any(k.startswith(f"layers.{layer}.") for k in changed), layer
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert len(scores.dev_accuracy) == len(scores.test_predictions) == RECIPE.epochs
    again, _ = build_classifiers(encoder, RECIPE, 3, 2)  # the same seed, the same run
    assert finetune_run(again, encoded, labels, RECIPE, 1e-3, 3) == scores


def test_a_hugging_face_encoder_goes_through_the_same_protocol(data, tok):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(123)  # the 'trained' peer: not a seed the scratch arm draws
    peer = BertForMaskedLM(BertConfig(vocab_size=tok.vocab_size, hidden_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=SEQ_LEN))
    encoder = hugging_face(peer, tok)
    fresh = encoder.random_init(0).module
    assert type(fresh) is BertForMaskedLM
    assert not torch.equal(fresh.bert.embeddings.word_embeddings.weight,
                           peer.bert.embeddings.word_embeddings.weight)
    quick = RECIPE.model_copy(update={"lr": [1e-3], "seeds": 2, "epochs": 1})
    result = run_finetune(quick, data, encoder)
    assert 0.0 <= result.metrics["finetune/accuracy"] <= 1.0
    assert result.metrics["finetune/seeds"] == 2
    assert result.tags["digest.task.polarity-fr"] == result.tasks[0]["digest"]


def test_one_seed_has_no_interval_and_says_so(data, tok, model):
    quick = RECIPE.model_copy(update={"lr": [1e-3], "seeds": 1, "epochs": 1})
    result = run_finetune(quick, data, ours(model, tok))
    assert "finetune/diff_ci95_low" not in result.metrics
    assert result.tags["unavailable.finetune/diff_ci95"].startswith("one seed")


def test_a_missing_dataset_warns_and_skips(tmp_path, model, tok, caplog):
    missing = LinearProbeConfig(data_path=str(tmp_path / "absent.csv"))
    with caplog.at_level(logging.WARNING):
        assert finetune_metrics(RECIPE, missing, model, tok) is None
    assert "absent.csv" in caplog.text and "fine-tuning evaluation skipped" in caplog.text
    assert "absent.csv" in run_finetune(RECIPE, missing, ours(model, tok)).tags[
        "unavailable.finetune"]


def test_the_lr_grid_fits_the_model_size():
    assert FinetuneConfig().lr_grid(256) == (1e-4, 3e-4, 1e-3)
    assert FinetuneConfig().lr_grid(768) == (2e-5, 3e-5, 5e-5)
    assert FinetuneConfig(lr=5e-5).lr_grid(256) == (5e-5,)
    with pytest.raises(ValueError, match="positive"):
        FinetuneConfig(lr=[1e-3, 0.0])


def test_evaluate_stage_adds_the_finetune_metrics_and_tags(
        tmp_path, data, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """The final evaluation runs it when enabled, on the `linear_probe` section's tasks,
    with the linear probe off (a tag says so); disabled, a tag instead of metrics."""
    trained = train(TrainConfig(micro_batch_size=4, max_steps=2, warmup_steps=0,
                                precision="fp32"),
                    tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                    tiny_tokenizer_manifest, tmp_path / "run")
    probe_off = data.model_copy(update={"enabled": False})
    quick = RECIPE.model_copy(update={"lr": [1e-3], "seeds": 2, "epochs": 1})
    cfg = EvalConfig(batch_size=8, max_rows=8, probes=[])
    on = evaluate(cfg, trained, tiny_shard_manifest, tiny_tokenizer_manifest,
                  tmp_path / "work", probe_off, finetune=quick)
    assert on.metrics["finetune/train_rows"] == 26 and on.metrics["finetune/test_rows"] == 13
    assert not any(k.startswith("probe/") for k in on.metrics)
    assert on.tags["unavailable.probe"].startswith("disabled")
    assert on.config["downstream"][0]["finetune"]["seeds"] == [3, 4]
    off = evaluate(cfg, trained, tiny_shard_manifest, tiny_tokenizer_manifest,
                   tmp_path / "work", probe_off, finetune=FinetuneConfig())
    assert not any(k.startswith("finetune/") for k in off.metrics)
    assert off.tags["unavailable.finetune"].startswith("disabled")
    assert off.digest != on.digest
