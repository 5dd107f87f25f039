"""The ingest stage's document writer: each split of a corpus as Parquet files.

`SplitWriter` streams one split (`train` or `validation`) into `<split>-NNNNN.parquet`
files (string columns `id`, `text`, `source`; zstd; a new file every `DOCS_PER_FILE`
documents, one row group per `BATCH_DOCS`), each written under a temporary name and
renamed when complete; `move_to_validation` moves one training document into the
validation split after the fact, and `rewrite_split` replaces a split's files by new
documents (the validation split after its lines found in training were removed).
`stage.read_documents` reads the files back.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline.locks import temp_path
from mlm_pipeline.manifest import FileEntry, file_entry

#: Documents per Parquet file before rolling over to the next one.
DOCS_PER_FILE = 50_000
#: Documents buffered per Parquet write (one row group each).
BATCH_DOCS = 1_000
_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string())])
_MAX_OFFSET = 2**31 - 1  # bytes one Arrow `string` array can hold (int32 offsets)


class SplitWriter:
    """Streams one split into Parquet files of at most `DOCS_PER_FILE` documents, one
    row group per `BATCH_DOCS` documents.

    Memory per batch: the texts' UTF-8 once, in one buffer that the Arrow array wraps
    without a copy. Python `str` lists held each text three times (the `str`, 2 bytes per
    character once a text has one beyond Latin-1 such as ’; the UTF-8 copy CPython caches
    in it when pyarrow converts it; the Arrow array). The bytes written are the same.
    Peak RSS of the stage on the corpora of benchmarks/bench_data.py at 1x / 4x / 16x:
    162 / 178 / 182 MiB before, 157 / 169 / 173 with this buffer, 150 / 158 / 164 with it
    and the pool release in `_flush`.
    """

    def __init__(self, out_dir: Path, split: str) -> None:
        self.out_dir, self.split = out_dir, split
        self.entries: list[FileEntry] = []
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.rows_in_file = 0
        self._new_batch()

    def _new_batch(self) -> None:
        self.ids: list[str] = []
        self.sources: list[str] = []
        self.text = bytearray()  # UTF-8 of the buffered texts, back to back
        self.offsets = array("i", [0])  # int32, as Arrow `string` offsets
        self.chunks: list[pa.Array] = []  # text arrays sealed before 2 GiB (int32 offsets)

    def add(self, doc_id: str, data: bytes, source: str) -> None:
        """Buffer one document (`data`: its text, UTF-8); flush a batch and roll files
        over as needed."""
        if self.writer is None:
            self.tmp = temp_path(self.out_dir / f"{self.split}-{len(self.entries):05d}.parquet")
            self.writer = pq.ParquetWriter(self.tmp, _SCHEMA, compression="zstd")
        if len(self.text) + len(data) > _MAX_OFFSET and len(self.offsets) > 1:
            self.chunks.append(self._seal())
        self.text += data
        self.offsets.append(len(self.text))  # OverflowError for one text over 2 GiB
        self.ids.append(doc_id)
        self.sources.append(source)
        self.rows_in_file += 1
        if len(self.ids) >= BATCH_DOCS:
            self._flush()
        if self.rows_in_file >= DOCS_PER_FILE:
            self._finish_file()

    def _seal(self) -> pa.Array:
        """The buffered texts as one Arrow `string` array (wrapping the buffers, no copy);
        starts a new buffer."""
        texts = pa.StringArray.from_buffers(len(self.offsets) - 1, pa.py_buffer(self.offsets),
                                            pa.py_buffer(self.text))
        self.text, self.offsets = bytearray(), array("i", [0])
        return texts

    def _flush(self) -> None:
        if self.ids and self.writer is not None:
            texts = [*self.chunks, self._seal()]
            columns = [pa.array(self.ids, pa.string()), pa.chunked_array(texts, pa.string()),
                       pa.array(self.sources, pa.string())]
            if len(texts) == 1:  # the common case: the same table as from Python lists
                columns[1] = texts[0]
            self.writer.write_table(pa.Table.from_arrays(columns, schema=_SCHEMA))
            del texts, columns
            self._new_batch()
            # Arrow's default pool (mimalloc) keeps the pages the encoder freed: RSS crept
            # up batch after batch, ~35 MiB above use at the end of the 16x corpus. Hand
            # them back once per row group; jemalloc with decay 0 (as in shards.py) kept
            # more here (https://arrow.apache.org/docs/python/memory.html#memory-pools).
            pa.default_memory_pool().release_unused()

    def _finish_file(self) -> None:
        self._flush()
        assert self.writer is not None and self.tmp is not None
        self.writer.close()
        final = self.out_dir / f"{self.split}-{len(self.entries):05d}.parquet"
        os.replace(self.tmp, final)
        self.entries.append(file_entry(self.out_dir, final, rows=self.rows_in_file))
        self.writer, self.tmp, self.rows_in_file = None, None, 0

    def close(self) -> list[FileEntry]:
        """Finish the open file; returns every file written (none for an empty split)."""
        if self.writer is not None:
            self._finish_file()
        return self.entries

    def abort(self) -> None:
        """Close and delete the open temporary file after a failure."""
        if self.writer is not None:
            self.writer.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        self.writer = self.tmp = None


def move_to_validation(out_dir: Path, train: list[FileEntry], file_index: int,
                       row: int) -> tuple[list[FileEntry], list[FileEntry]]:
    """Move row `row` of train file `file_index` into `validation-00000.parquet`.

    Rewrites that one train file (at most `DOCS_PER_FILE` documents in memory); a file
    left empty is deleted (only the last file can hold a single document).
    """
    path = out_dir / train[file_index].path
    table = pq.read_table(path, schema=_SCHEMA)
    val = out_dir / "validation-00000.parquet"
    _write_table(val, table.slice(row, 1))
    rest = pa.concat_tables([table.slice(0, row), table.slice(row + 1)])
    train = list(train)
    if rest.num_rows:
        _write_table(path, rest)
        train[file_index] = file_entry(out_dir, path, rows=rest.num_rows)
    else:
        path.unlink()
        del train[file_index]
    return train, [file_entry(out_dir, val, rows=1)]


def _write_table(path: Path, table: pa.Table) -> None:
    """Write `table` to `path` as zstd Parquet, through a temporary file replaced atomically."""
    tmp = temp_path(path)
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def read_split(out_dir: Path, entries: list[FileEntry]) -> list[tuple[str, str, str]]:
    """Every `(id, text, source)` of a split's files, in order (the whole split in memory:
    for the validation split)."""
    docs: list[tuple[str, str, str]] = []
    for e in entries:
        table = pq.read_table(out_dir / e.path, schema=_SCHEMA)
        docs += zip(*(table.column(c).to_pylist() for c in ("id", "text", "source")))
    return docs


def rewrite_split(out_dir: Path, split: str, entries: list[FileEntry],
                  documents: list[tuple[str, str, str]]) -> list[FileEntry]:
    """Replace the files `entries` of `split` by `documents` (`(id, text, source)`, in
    order), written as `SplitWriter` writes a split; returns the new entries."""
    out = SplitWriter(out_dir, split)
    try:
        for doc_id, text, source in documents:
            out.add(doc_id, text.encode("utf-8"), source)
        new = out.close()
    except BaseException:
        out.abort()
        raise
    for e in entries:  # files the new split no longer has (each new file replaced its own)
        if e.path not in {n.path for n in new}:
            (out_dir / e.path).unlink(missing_ok=True)
    return new
