"""`write_shards` gives byte-identical shards whatever its thread count and batching, and
names the file and row of bad Parquet input."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import ShardConfig
from mlm_pipeline.shards.format import open_shard
from mlm_pipeline.shards.stage import write_shards

CLS, SEP, SEQ_LEN = 2, 3, 16


def file_hashes(manifest) -> dict[str, str]:
    """sha256 of every shard's bytes, read here (not taken from the manifest)."""
    return {e.path: hashlib.sha256(manifest.file(e.path).read_bytes()).hexdigest()
            for split in (manifest.train, manifest.validation) for e in split.shards}


def reference_stream(corpus, tokenizer, split: str) -> list[int]:
    """The split's `doc [SEP] doc [SEP] ...` stream, encoded one document at a time."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.file(tokenizer.model.path)))
    stream: list[int] = []
    for entry in getattr(corpus, split):
        for text in pq.read_table(corpus.file(entry.path)).column("text").to_pylist():
            stream += sp.encode(text) + [SEP]
    return stream


@pytest.fixture(scope="module")
def by_threads(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest):
    """Manifests written with 1, 2 and 3 encode threads; one document per batch, so many
    batches are in flight at once and finish out of order."""
    out = {}
    for threads in (1, 2, 3):
        cfg = ShardConfig(seq_len=SEQ_LEN, rows_per_shard=50, encode_batch_size=1,
                          num_threads=threads)
        out[threads] = write_shards(cfg, tiny_corpus_manifest, tiny_tokenizer_manifest,
                                    tmp_path_factory.mktemp(f"threads{threads}"))
    return out


def test_shards_are_byte_identical_for_any_thread_count(by_threads):
    hashes = {t: file_hashes(m) for t, m in by_threads.items()}
    assert len(hashes[1]) > 2  # several train shards and a validation shard
    assert hashes[1] == hashes[2] == hashes[3]
    for m in by_threads.values():
        recorded = {e.path: e.sha256 for s in (m.train, m.validation) for e in s.shards}
        assert recorded == hashes[1]
        for e in m.train.shards + m.validation.shards:
            assert e.bytes == m.file(e.path).stat().st_size


def test_rows_equal_the_reference_stream_with_many_batches(
    by_threads, tiny_corpus_manifest, tiny_tokenizer_manifest
):
    body = SEQ_LEN - 1
    for split in ("train", "validation"):
        stream = reference_stream(tiny_corpus_manifest, tiny_tokenizer_manifest, split)
        n = len(stream) // body
        want = np.array(stream[: n * body], np.int64).reshape(n, body)
        m = by_threads[3]
        rows = np.concatenate([open_shard(m.file(e.path))
                               for e in getattr(m, split).shards]).astype(np.int64)
        assert (rows[:, 0] == CLS).all()
        np.testing.assert_array_equal(rows[:, 1:], want)
        s = getattr(m, split)
        assert s.tokens_in == len(stream) and s.remainder_tokens == len(stream) - n * body
        assert s.documents == getattr(tiny_corpus_manifest, f"documents_{split}")
        assert [e.rows for e in s.shards[:-1]] == [50] * (len(s.shards) - 1)


def test_default_thread_count_matches_one_thread(
    by_threads, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path
):
    cfg = ShardConfig(seq_len=SEQ_LEN, rows_per_shard=50, encode_batch_size=1)  # 0 = all cores
    m = write_shards(cfg, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path)
    assert file_hashes(m) == file_hashes(by_threads[1])


def test_arrow_memory_pool_is_restored(tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path):
    before = pa.default_memory_pool().backend_name
    write_shards(ShardConfig(seq_len=SEQ_LEN), tiny_corpus_manifest, tiny_tokenizer_manifest,
                 tmp_path)
    assert pa.default_memory_pool().backend_name == before


def _overwrite_train(corpus, table) -> str:
    path = corpus.file(corpus.train[0].path)
    pq.write_table(table, path)
    return corpus.train[0].path


def test_null_text_names_file_and_row(
    make_corpus_manifest, tiny_paragraphs, tiny_tokenizer_manifest, tmp_path
):
    corpus = make_corpus_manifest(tmp_path / "corpus", list(tiny_paragraphs))
    texts = list(tiny_paragraphs[:9]) * 3
    texts[13] = None
    name = _overwrite_train(corpus, pa.table({"text": pa.array(texts, pa.string())}))
    cfg = ShardConfig(seq_len=SEQ_LEN, encode_batch_size=5, num_threads=2)
    with pytest.raises(ValueError, match=rf"{name}: row 13: 'text' is null"):
        write_shards(cfg, corpus, tiny_tokenizer_manifest, tmp_path)


def test_missing_text_column_and_non_parquet_name_the_file(
    make_corpus_manifest, tiny_paragraphs, tiny_tokenizer_manifest, tmp_path
):
    corpus = make_corpus_manifest(tmp_path / "corpus", list(tiny_paragraphs))
    name = _overwrite_train(corpus, pa.table({"body": list(tiny_paragraphs[:3])}))
    with pytest.raises(ValueError, match=rf"{name}: expected a string column 'text'"):
        write_shards(ShardConfig(seq_len=SEQ_LEN), corpus, tiny_tokenizer_manifest, tmp_path)
    corpus.file(name).write_text("not parquet")
    with pytest.raises(ValueError, match=rf"{name}: cannot read Parquet documents"):
        write_shards(ShardConfig(seq_len=SEQ_LEN), corpus, tiny_tokenizer_manifest, tmp_path)


def test_byte_capped_batches_give_the_same_shards(
    by_threads, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path
):
    """A byte cap below most documents' length (one document per task) and one that
    groups a few documents give the shards of one document per task."""
    for cap in (1, 600):
        cfg = ShardConfig(seq_len=SEQ_LEN, rows_per_shard=50, encode_batch_size=1000,
                          encode_batch_bytes=cap, num_threads=2)
        m = write_shards(cfg, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path / str(cap))
        assert file_hashes(m) == file_hashes(by_threads[1])


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_byte_slices_bound_bytes_and_keep_every_document(kind):
    from mlm_pipeline.ingest.documents import byte_slices

    rng = np.random.default_rng(0)
    texts = ["é" * int(n) for n in rng.integers(0, 400, size=300)] + ["x" * 5000, ""]
    column = pa.array(texts, kind).slice(3)  # a non-zero array offset
    slices = list(byte_slices(column, 1000))
    assert [t for s in slices for t in s.to_pylist()] == texts[3:]
    for s in slices:
        size = sum(len(t.encode()) for t in s.to_pylist())
        assert len(s) >= 1 and (size <= 1000 or len(s) == 1)
    # Greedy: adding the next document to any slice would pass the cap.
    for s, nxt in itertools.pairwise(slices):
        size = sum(len(t.encode()) for t in s.to_pylist())
        assert size + len(nxt.to_pylist()[0].encode()) > 1000
    assert list(byte_slices(pa.array([], kind), 1000)) == []


def test_text_tasks_are_bounded_and_keep_order(tmp_path):
    from mlm_pipeline.ingest.documents import text_tasks

    rng = np.random.default_rng(1)
    files, texts = [], []
    for f in range(2):
        part = ["x" * int(n) for n in rng.integers(0, 700, size=300)] + ["y" * 3000]
        pq.write_table(pa.table({"text": part}), tmp_path / f"d{f}.parquet", row_group_size=50)
        files.append(tmp_path / f"d{f}.parquet")
        texts += part
    for docs, cap in ((1000, 2000), (7, 10_000), (1, 1)):
        tasks = list(text_tasks(files, docs, cap))
        assert [t for task in tasks for c in task for t in c.to_pylist()] == texts
        for task in tasks:
            got = [t for c in task for t in c.to_pylist()]
            size = sum(len(t) for t in got)
            assert 1 <= len(got) <= docs and (size <= cap or len(got) == 1)
