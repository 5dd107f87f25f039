"""`write_shards`, `open_shard` and `verify_shards` on tmp_path, against a reference packer."""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import ShardConfig
from mlm_pipeline.evaluate import check_evaluable
from mlm_pipeline.shards.format import open_shard, verify_shards
from mlm_pipeline.shards.stage import write_shards

CLS, SEP = 2, 3


def reference_rows(corpus, tokenizer, split: str, seq_len: int) -> tuple[np.ndarray, int, int]:
    """Pack a split the simple way: the whole `doc [SEP]` stream in memory, then cut.

    Returns:
        (rows `(n, seq_len)` int64, tokens_in, remainder_tokens).
    """
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.file(tokenizer.model.path)))
    stream: list[int] = []
    for entry in getattr(corpus, split):
        for text in pq.read_table(corpus.file(entry.path)).column("text").to_pylist():
            stream += sp.encode(text) + [SEP]
    body = seq_len - 1
    n = len(stream) // body
    rows = [[CLS] + stream[i * body : (i + 1) * body] for i in range(n)]
    return np.array(rows, dtype=np.int64).reshape(n, seq_len), len(stream), len(stream) - n * body


def read_split(manifest, split: str) -> np.ndarray:
    shards = [open_shard(manifest.file(e.path)) for e in getattr(manifest, split).shards]
    return np.concatenate(shards) if shards else np.empty((0, manifest.seq_len), np.uint16)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_rows_equal_reference_packing(
    split, tiny_shard_manifest, tiny_corpus_manifest, tiny_tokenizer_manifest
):
    m = tiny_shard_manifest
    expected, tokens_in, remainder = reference_rows(
        tiny_corpus_manifest, tiny_tokenizer_manifest, split, 16
    )
    rows = read_split(m, split)
    assert rows.shape == expected.shape and len(rows) > 0
    np.testing.assert_array_equal(rows.astype(np.int64), expected)
    s = getattr(m, split)
    assert s.rows == len(expected)
    assert s.tokens_in == tokens_in and s.remainder_tokens == remainder
    assert s.tokens_in == s.rows * 15 + s.remainder_tokens
    assert 0 <= s.remainder_tokens < 15
    assert s.documents == getattr(tiny_corpus_manifest, f"documents_{split}")


def test_every_row_is_full_and_starts_with_cls(tiny_shard_manifest):
    m = tiny_shard_manifest
    assert m.seq_len == 16 and m.dtype == "uint16" and m.vocab_size == 128
    for split in ("train", "validation"):
        rows = read_split(m, split)
        assert rows.dtype == np.uint16 and rows.shape[1] == 16
        assert (rows[:, 0] == CLS).all()
        assert (rows[:, 1:] != CLS).all() and (rows != 0).all() and (rows != 4).all()
        assert (rows < 128).all()


def test_shard_files_sizes_schema_and_checksums(tiny_shard_manifest):
    m = tiny_shard_manifest
    train = m.train.shards
    assert len(train) > 1  # rows_per_shard=64 in the fixture
    assert [e.path for e in train] == [f"train-{i:05d}.arrow" for i in range(len(train))]
    assert all(e.rows == 64 for e in train[:-1]) and 0 < train[-1].rows <= 64
    for e in train + m.validation.shards:
        path = m.file(e.path)
        assert e.tokens == e.rows * 16
        assert hashlib.sha256(path.read_bytes()).hexdigest() == e.sha256
        with pa.memory_map(str(path)) as source:
            schema = ipc.open_file(source).schema
        assert schema.names == ["input_ids"]
        assert schema.field("input_ids").type == pa.list_(pa.uint16(), 16)
    assert sum(e.rows for e in train) == m.train.rows
    assert not list(m.path.parent.glob(".*.tmp"))


def test_open_shard_is_a_read_only_zero_copy_view(tiny_shard_manifest, tmp_path):
    path = tmp_path / "copy.arrow"
    shutil.copyfile(tiny_shard_manifest.file(tiny_shard_manifest.train.shards[0].path), path)
    rows = open_shard(path)
    assert not rows.flags.writeable
    gc.collect()  # the mapping must outlive the reader objects
    # Change the file in place: a memory-mapped view sees it, a copy would not.
    offset = path.read_bytes().find(rows[:2].tobytes())
    assert offset > 0
    new_value = (int(rows[0, 1]) + 1) % 128
    with open(path, "r+b") as f:
        f.seek(offset + rows.itemsize)  # element [0, 1]
        f.write(np.array([new_value], rows.dtype).tobytes())
    assert rows[0, 1] == new_value


def test_cached_rerun_does_not_rewrite(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest,
    tiny_work_dir,
):
    files = [tiny_shard_manifest.file(e.path) for e in tiny_shard_manifest.train.shards]
    before = [f.stat().st_mtime_ns for f in files]
    again = write_shards(
        tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
    )
    assert again == tiny_shard_manifest
    assert [f.stat().st_mtime_ns for f in files] == before


def test_rows_do_not_depend_on_batch_or_shard_size(
    tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest, tmp_path
):
    cfg = ShardConfig(seq_len=16, rows_per_shard=1000, encode_batch_size=1000)
    m = write_shards(cfg, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path)
    assert m.digest != tiny_shard_manifest.digest and len(m.train.shards) == 1
    np.testing.assert_array_equal(read_split(m, "train"), read_split(tiny_shard_manifest, "train"))


def test_verify_shards_detects_a_flipped_byte(tiny_shard_manifest, tmp_path):
    copy_dir = tmp_path / "copy"
    shutil.copytree(tiny_shard_manifest.output_dir, copy_dir)
    m = tiny_shard_manifest.model_copy(update={"output_dir": str(copy_dir)})
    verify_shards(m)
    target = m.file(m.train.shards[1].path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=m.train.shards[1].path):
        verify_shards(m)
    target.unlink()
    with pytest.raises(ValueError, match="missing"):
        verify_shards(m)


def test_train_split_smaller_than_one_row_fails(
    make_corpus_manifest, tiny_tokenizer_manifest, tmp_path
):
    corpus = make_corpus_manifest(tmp_path / "corpus", ["Bonjour."])
    with pytest.raises(ValueError, match="smaller than one row of seq_len=64"):
        write_shards(ShardConfig(seq_len=64), corpus, tiny_tokenizer_manifest, tmp_path)
    assert not list((tmp_path / "shards").rglob("*.arrow"))


def test_empty_validation_split_writes_no_shard(
    make_corpus_manifest, tiny_paragraphs, tiny_tokenizer_manifest, tiny_shard_manifest,
    tmp_path, caplog
):
    paragraphs = list(tiny_paragraphs[:9]) + ["Oui."]  # index 9 -> validation
    corpus = make_corpus_manifest(tmp_path / "corpus", paragraphs)
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.shards.stage"):
        m = write_shards(ShardConfig(seq_len=32), corpus, tiny_tokenizer_manifest, tmp_path)
    v = m.validation
    assert v.shards == [] and v.rows == 0 and v.documents == 1
    assert v.remainder_tokens == v.tokens_in > 0
    assert "validation split" in caplog.text
    assert m.train.rows > 0
    # the pipeline refuses to train a run it could not evaluate, naming the fix
    with pytest.raises(ValueError, match="validation_fraction"):
        check_evaluable(m)
    check_evaluable(tiny_shard_manifest)


def _write_ipc(path, table_or_batches, schema):
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, schema) as w:
        for batch in table_or_batches:
            w.write_batch(batch)


def test_open_shard_reads_uint32_and_several_batches(tmp_path):
    seq_len = 4
    values = np.arange(6 * seq_len, dtype=np.uint32) + 70000
    column = pa.FixedSizeListArray.from_arrays(pa.array(values), seq_len)
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.uint32(), seq_len))])
    batches = [pa.record_batch([column.slice(0, 2)], schema=schema),
               pa.record_batch([column.slice(2, 4)], schema=schema)]
    path = tmp_path / "x.arrow"
    _write_ipc(path, batches, schema)
    rows = open_shard(path)
    assert rows.dtype == np.uint32
    np.testing.assert_array_equal(rows, values.reshape(6, seq_len))


def test_open_shard_rejects_a_wrong_schema(tmp_path):
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.int64()))])
    batch = pa.record_batch([pa.array([[1, 2], [3]], pa.list_(pa.int64()))], schema=schema)
    path = tmp_path / "bad.arrow"
    _write_ipc(path, [batch], schema)
    with pytest.raises(ValueError, match="bad.arrow"):
        open_shard(path)
    text = tmp_path / "not.arrow"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not.arrow"):
        open_shard(text)
