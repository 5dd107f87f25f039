"""The ingest Parquet writer: row groups of bounded size, bytes equal to writing the same
documents from Python lists with pyarrow (the layout before the writer buffered UTF-8)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import writer as ingest_writer
from mlm_pipeline.ingest.stage import ingest

# Texts of 1-, 2- and 4-byte UTF-8 characters (Latin-1, CJK, emoji), of uneven lengths.
TEXTS = [f"Document {i} : {'é' * i}{'漢字' * (i % 3)}{'🙂' * (i % 2)} fin." for i in range(11)]
SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string())])


def write_corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                    encoding="utf-8")
    return path


def reference_file(path, docs, batch):
    """What pyarrow writes for `docs` in tables of `batch` rows built from Python lists."""
    with pq.ParquetWriter(path, SCHEMA, compression="zstd") as w:
        for i in range(0, len(docs), batch):
            part = docs[i:i + batch]
            w.write_table(pa.table({"id": [d[0] for d in part], "text": [d[1] for d in part],
                                    "source": [d[2] for d in part]}, schema=SCHEMA))


def run(tmp_path, corpus):
    return ingest(IngestConfig(sources=[str(corpus)], validation_fraction=0.0, min_chars=1),
                  tmp_path / "work")


def test_row_groups_hold_batch_docs_and_bytes_match_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_writer, "BATCH_DOCS", 3)
    monkeypatch.setattr(ingest_writer, "DOCS_PER_FILE", 7)
    m = run(tmp_path, write_corpus(tmp_path))
    docs = [(f"docs.jsonl:{i + 1}", t, "docs.jsonl") for i, t in enumerate(TEXTS)]
    # 11 documents, 7 per file, 3 per row group: files of 7 and 4, row groups 3+3+1, 3+1.
    expected_groups = [[3, 3, 1], [3, 1]]
    assert [e.rows for e in m.train] == [7, 4]
    for k, (e, groups) in enumerate(zip(m.train, expected_groups)):
        meta = pq.ParquetFile(m.file(e.path)).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == groups
        ref = tmp_path / f"ref-{k}.parquet"
        reference_file(ref, docs[7 * k:7 * k + e.rows], 3)
        assert m.file(e.path).read_bytes() == ref.read_bytes()


def test_text_buffer_sealed_before_offset_overflow(tmp_path, monkeypatch):
    # A batch whose texts exceed what int32 offsets address is written as several Arrow
    # chunks of one row group; a 40-byte limit stands in for 2 GiB.
    monkeypatch.setattr(ingest_writer, "_MAX_OFFSET", 40)
    monkeypatch.setattr(ingest_writer, "BATCH_DOCS", 4)
    m = run(tmp_path, write_corpus(tmp_path))
    f = pq.ParquetFile(m.file(m.train[0].path))
    assert [f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)] == [4, 4, 3]
    table = f.read()
    assert table.column("text").to_pylist() == TEXTS
    assert table.column("id").to_pylist() == [f"docs.jsonl:{i + 1}" for i in range(len(TEXTS))]
