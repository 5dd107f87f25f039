"""Reuse verifies content: a stage output changed on disk (one byte flipped, size and mtime
kept) is found by its sha256, named in a warning, and the stage is rebuilt, and the
stages after it are built from the correct data; an unchanged rerun reads no file."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig, ShardConfig, TokenizerConfig
from mlm_pipeline.ingest import hashing
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.manifest import sha256_file
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import train_tokenizer

TINY_FR = Path(__file__).parents[1] / "assets" / "tiny_fr.txt"
INGEST = IngestConfig(sources=[str(TINY_FR)], validation_fraction=0.1)
TOKENIZER = TokenizerConfig(vocab_size=128)
SHARDS = ShardConfig(seq_len=16, rows_per_shard=64)


def _pipeline(work: Path):
    corpus = ingest(INGEST, work)
    tok = train_tokenizer(TOKENIZER, corpus, work)
    return corpus, tok, write_shards(SHARDS, corpus, tok, work)


def _hashes(corpus, tok, shards) -> dict[str, str]:
    """sha256 of every output file, read from disk, by stage and relative path."""
    out = {f"ingest/{e.path}": sha256_file(corpus.file(e.path))
           for e in corpus.train + corpus.validation}
    out |= {f"tokenizer/{e.path}": sha256_file(tok.file(e.path)) for e in (tok.model, tok.vocab)}
    out |= {f"shards/{e.path}": sha256_file(shards.file(e.path))
            for e in shards.train.shards + shards.validation.shards}
    return out


def _flip_one_byte(path: Path) -> None:
    """Invert one byte in the middle of `path`, keeping its size, atime and mtime."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """Output hashes of the pipeline run once in a clean work directory."""
    return _hashes(*_pipeline(tmp_path_factory.mktemp("reference")))


@pytest.fixture()
def later(monkeypatch):
    """Hashes count as taken 10 s after the files' last change: memo entries are trusted
    at once (no 2 s wait for the racy window)."""
    monkeypatch.setattr(hashing, "_now_ns", lambda: time.time_ns() + 10 * 10**9)


def test_flipped_document_byte_rebuilds_ingest_then_tokenizer_and_shards_from_correct_data(
        tmp_path, reference, later, caplog):
    work = tmp_path / "work"
    corpus = ingest(INGEST, work)
    assert ingest(INGEST, work).created_at == corpus.created_at  # reused, memo filled
    document = corpus.file(corpus.train[0].path)
    _flip_one_byte(document)
    assert sha256_file(document) != corpus.train[0].sha256

    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.manifest"):
        rebuilt, tok, shards = _pipeline(work)
    assert f"ingest: {document} changed: sha256 " in caplog.text
    assert "the stage is rebuilt" in caplog.text
    assert rebuilt.created_at > corpus.created_at and rebuilt.digest == corpus.digest
    assert _hashes(rebuilt, tok, shards) == reference


@pytest.mark.parametrize("stage", ["tokenizer", "shards"])
def test_flipped_output_byte_rebuilds_its_stage(stage, tmp_path, reference, later, caplog):
    work = tmp_path / "work"
    corpus, tok, shards = _pipeline(work)
    made = {"tokenizer": tok, "shards": shards}[stage]
    entry = tok.vocab if stage == "tokenizer" else shards.train.shards[1]
    _flip_one_byte(made.file(entry.path))
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.manifest"):
        again = _pipeline(work)
    assert f"{stage}: {made.file(entry.path)} changed: sha256 " in caplog.text
    assert again[0].created_at == corpus.created_at  # ingest reused
    assert {"tokenizer": again[1], "shards": again[2]}[stage].created_at > made.created_at
    assert _hashes(*again) == reference


def test_unchanged_rerun_reads_no_file(tmp_path, later, monkeypatch):
    work = tmp_path / "work"
    first = _pipeline(work)
    _pipeline(work)  # fills the memo with the outputs' hashes
    reads: list[int] = []
    real = hashing.hash_stream
    monkeypatch.setattr(hashing, "hash_stream", lambda f: reads.append(1) or real(f))
    again = _pipeline(work)
    assert [m.created_at for m in again] == [m.created_at for m in first]
    assert reads == []
