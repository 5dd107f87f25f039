"""An honest validation split: training lines removed from validation documents, and the
validation<->training word 13-gram overlap that remains, recomputed here by brute force."""

from __future__ import annotations

import hashlib
import json
import re

import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.stage import ingest

BOILERPLATE = ("Pour accéder à cette commande, choisissez Format puis Caractères dans le "
               "menu principal de la fenêtre.")


def words(text):
    return re.findall(r"\w+", text.casefold())


def windows(text, n=13):
    w = words(text)
    return [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]


def read(m, split):
    return [t for e in getattr(m, split)
            for t in pq.read_table(m.file(e.path)).column("text").to_pylist()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """120 help pages: a title, a page-specific paragraph and the shared boilerplate line
    (with varying case and spacing), 1 in 4 also quoting the previous page's paragraph."""
    tmp = tmp_path_factory.mktemp("overlap")
    docs = []
    for i in range(120):
        own = " ".join(f"La fonction {i} calcule la valeur {j} de la cellule {i * j}."
                       for j in range(4))
        quoted = (f"\n\n La fonction {i - 1} calcule la valeur 0 de la cellule 0. La fonction "
                  f"{i - 1} calcule la valeur 1 de la cellule {i - 1}." if i % 4 == 0 else "")
        boiler = BOILERPLATE.upper() if i % 3 == 0 else BOILERPLATE.replace(" ", "  ")
        docs.append({"id": f"page{i}", "text": f"Page {i}\n\n{own}{quoted}\n\n{boiler}"})
    path = tmp / "pages.jsonl"
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs),
                    encoding="utf-8")
    base = dict(sources=[str(path)], validation_fraction=0.2, min_chars=20)
    return (ingest(IngestConfig(**base), tmp / "plain"),
            ingest(IngestConfig(**base, validation_dedup="lines"), tmp / "dedup"))


def brute_force_share(m):
    train = {w for t in read(m, "train") for w in windows(t)}
    val = [w for t in read(m, "validation") for w in windows(t)]
    return sum(w in train for w in val), len(val)


def test_the_overlap_figure_equals_a_brute_force_count(corpus):
    for m in corpus:
        hits, total = brute_force_share(m)
        o = m.validation_overlap
        assert (o.validation_windows_in_train, o.validation_windows) == (hits, total)
        assert o.ngram == 13
    plain, dedup = corpus
    assert plain.validation_overlap.share > 0.1  # the boilerplate and the quotes
    # The boilerplate and whole quoted lines are gone; what remains is the part of a page's
    # paragraph that the next page quotes (not a whole line: line dedup keeps it).
    assert dedup.validation_overlap.share < 0.75 * plain.validation_overlap.share


def test_no_validation_line_is_a_training_line_and_training_is_unchanged(corpus):
    plain, dedup = corpus

    def key(line):
        return " ".join(line.casefold().split())

    train_lines = {key(line) for t in read(dedup, "train") for line in t.splitlines()}
    for text in read(dedup, "validation"):
        for line in text.splitlines():
            assert not key(line) or key(line) not in train_lines, line
    assert read(plain, "train") == read(dedup, "train")
    assert dedup.validation_overlap.lines_removed > 0
    # Every record accounted for: changed documents are repairs, emptied ones drops.
    assert dedup.documents_read + dedup.split_parts_extra == (
        dedup.documents_kept + sum(dedup.dropped.values()))
    assert dedup.documents_validation == len(read(dedup, "validation"))
    assert dedup.repaired["validation_lines"] > 0
    assert dedup.characters == sum(map(len, read(dedup, "train") + read(dedup, "validation")))
    for entry in dedup.validation:  # the rewritten files are what the manifest records
        data = dedup.file(entry.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry.sha256


def test_the_default_corpus_digest_is_unchanged_by_the_new_keys(corpus, tmp_path):
    """Keys left at their defaults do not enter the digest; set, they do."""
    plain, dedup = corpus
    assert plain.digest != dedup.digest
    off = ingest(IngestConfig(sources=plain.config["sources"], validation_fraction=0.2,
                              min_chars=20, overlap_ngram=None), tmp_path / "off")
    assert off.validation_overlap is None and off.digest != plain.digest
