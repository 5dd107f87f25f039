"""The dropped remainder of a split counts content tokens and [SEP] separators apart, so
content tokens in rows + dropped content tokens = the pieces of every document, exactly.

Expected values come from the documents' own encodings and their positions in the
`doc [SEP] doc [SEP] ...` stream (not from the token values in the shards)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import ShardConfig
from mlm_pipeline.shards.format import open_shard
from mlm_pipeline.shards.stage import write_shards

SEP = 3


def _lengths(corpus, tokenizer, split: str) -> list[int]:
    """len(encode(doc)) of every document of the split, in order, with a fresh processor."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.file(tokenizer.model.path)))
    return [len(sp.encode(text)) for e in getattr(corpus, split)
            for text in pq.read_table(corpus.file(e.path)).column("text").to_pylist()]


def _expected(lengths: list[int], seq_len: int) -> dict[str, int]:
    """Content tokens and separators inside and after the rows, from document positions."""
    body = seq_len - 1
    covered = (sum(lengths) + len(lengths)) // body * body  # stream tokens in rows
    content_in_rows = separators_in_rows = start = 0
    for n in lengths:  # document at [start, start + n), its [SEP] at start + n
        content_in_rows += max(0, min(n, covered - start))
        separators_in_rows += start + n < covered
        start += n + 1
    return {"content_in_rows": content_in_rows,
            "dropped_content": sum(lengths) - content_in_rows,
            "dropped_separators": len(lengths) - separators_in_rows}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory, make_corpus_manifest, tiny_paragraphs):
    """Many short documents (first words of each paragraph), so that a remainder holds
    several separators."""
    docs = [" ".join(p.split()[:k]) for p in tiny_paragraphs for k in (1, 2, 3)]
    return make_corpus_manifest(tmp_path_factory.mktemp("short"), docs)


@pytest.mark.parametrize("seq_len", [16, 23, 64])
@pytest.mark.parametrize("corpus_name", ["tiny", "short"])
def test_content_in_rows_plus_dropped_content_is_every_piece(
        seq_len, corpus_name, tiny_corpus_manifest, short_documents, tiny_tokenizer_manifest,
        tmp_path):
    corpus = {"tiny": tiny_corpus_manifest, "short": short_documents}[corpus_name]
    m = write_shards(ShardConfig(seq_len=seq_len, rows_per_shard=32), corpus,
                     tiny_tokenizer_manifest, tmp_path)
    for split in ("train", "validation"):
        lengths = _lengths(corpus, tiny_tokenizer_manifest, split)
        want = _expected(lengths, seq_len)
        s = getattr(m, split)
        assert s.remainder_content_tokens == want["dropped_content"]
        assert s.remainder_separators == want["dropped_separators"]
        assert s.remainder_tokens == want["dropped_content"] + want["dropped_separators"]
        rows = [open_shard(m.file(e.path)) for e in s.shards]
        body = np.concatenate(rows)[:, 1:] if rows else np.empty((0, seq_len - 1))
        # The identity, with the rows' content counted in the shards themselves.
        content_in_rows = int(np.count_nonzero(body != SEP))
        assert content_in_rows == want["content_in_rows"]
        assert content_in_rows + s.remainder_content_tokens == sum(lengths)


def test_short_documents_leave_several_separators_in_a_remainder(
        short_documents, tiny_tokenizer_manifest, tmp_path):
    m = write_shards(ShardConfig(seq_len=64, rows_per_shard=32), short_documents,
                     tiny_tokenizer_manifest, tmp_path)
    assert max(m.train.remainder_separators, m.validation.remainder_separators) >= 2
