"""`documents.write_training_text`: candidate sentences and their seeded sample, over
several Parquet batches, against a line-by-line reference written here."""

from __future__ import annotations

import hashlib
import random

import pyarrow.parquet as pq
import pytest

from mlm_pipeline.ingest.documents import split_long_line, write_training_text

MAX_BYTES = 40


def _documents(n: int) -> list[str]:
    rng = random.Random(7)
    words = ["chat", "dort", "été", "naïve", "ﬁn", "漢字", "x" * 55, "le", "un"]
    docs = []
    for i in range(n):
        lines = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.15:
                lines.append(rng.choice(["", "   ", "\u3000\t", "\u00a0"]))  # blank lines
            else:
                lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
        docs.append(f"doc {i} " + "\n".join(lines))
    return docs


def _reference_candidates(corpus) -> list[str]:
    out = []
    for e in corpus.train:
        for text in pq.read_table(corpus.file(e.path)).column("text").to_pylist():
            for line in text.split("\n"):
                if line.strip():
                    out += list(split_long_line(line, MAX_BYTES))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, make_corpus_manifest):
    # 600 documents (540 for training), long lines in most Parquet reads.
    return make_corpus_manifest(tmp_path_factory.mktemp("tt"), _documents(600))


@pytest.fixture(autouse=True)
def _small_reads(monkeypatch):
    # 64 documents per Parquet read: the 540 training documents come in 9 batches.
    monkeypatch.setattr("mlm_pipeline.ingest.documents._TRAINING_TEXT_ROWS", 64)


@pytest.mark.parametrize("k", ["all", "exact", "half", 1, 7])
def test_sample_matches_the_reference(corpus, tmp_path, k, reservoir_sample):
    cands = _reference_candidates(corpus)
    assert any(len(c.encode()) == MAX_BYTES for c in cands)  # long lines were cut
    k = {"all": 10 * len(cands), "exact": len(cands), "half": len(cands) // 2}.get(k, k)
    out = tmp_path / "train.txt"
    written, total, digest = write_training_text(corpus, out, MAX_BYTES, k, seed=3)
    want = "".join(x + "\n" for x in reservoir_sample(cands, k, seed=3)).encode()
    assert out.read_bytes() == want
    assert (written, total, digest) == (min(k, len(cands)), len(cands),
                                        hashlib.sha256(want).hexdigest())


def test_other_seed_other_sample(corpus, tmp_path):
    n = len(_reference_candidates(corpus)) // 2
    a = write_training_text(corpus, tmp_path / "a.txt", MAX_BYTES, n, seed=1)[2]
    b = write_training_text(corpus, tmp_path / "b.txt", MAX_BYTES, n, seed=2)[2]
    assert a != b
