"""Ingested Parquet document files as text: open, stream, and write as bounded lines.

Ingestion writes each split of a corpus as Parquet files with a string column `text`, one
document per row. This module reads them back for the later stages: `open_documents` opens
and checks one file (shared by the tokenizer and shard stages), `iter_text_batches` streams
the texts in batches, `write_training_text` turns the training split into the line file
that the SentencePiece trainer reads (each non-blank line of a document on a line of its
own, a line longer than the trainer's limit cut by `split_long_line`, so no text is
dropped; a seeded uniform sample when there are more lines than the trainer takes), and
`text_tasks` cuts the texts into encode tasks bounded in documents and bytes (zero-copy
Arrow slices) for the shard stage.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline.manifest import CorpusManifest

#: Documents per Parquet read (`text_tasks`, `write_training_text`): Arrow grows a read's
#: output buffers by reallocation, to 10 MiB extents at 1,024 rows of a large file.
_PARQUET_BATCH_ROWS = 128


def open_documents(path: str | os.PathLike[str]) -> pq.ParquetFile:
    """Open an ingested Parquet document file after checking its `text` column.

    Read-ahead of whole column chunks (`pre_buffer`, pyarrow's default) is off: it holds
    tens of MiB for a large file, and readers here stream batch by batch.

    Raises:
        ValueError: the file has no string (or large string) column `text` (named).
        pyarrow.ArrowException, OSError: the file is not readable Parquet.
    """
    pf = pq.ParquetFile(path, pre_buffer=False)
    schema = pf.schema_arrow
    kind = schema.field("text").type if "text" in schema.names else None
    if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: expected a string column 'text', schema is {schema}")
    return pf


def iter_text_batches(
    paths: list[str | os.PathLike[str]], batch_size: int
) -> Iterator[list[str]]:
    """Stream the `text` column of ingested Parquet document files, in order.

    Memory stays at about two batches: files are read with `ParquetFile.iter_batches`.

    Args:
        paths: Parquet files with a string column `text` (ingestion's document shards).
        batch_size: documents per yielded list (the last list may be shorter).

    Yields:
        Lists of document texts, in file and row order.

    Raises:
        ValueError: a file lacks a string `text` column, or a `text` value is null (the file
            and row are named).
    """
    pending: list[str] = []
    for path in paths:
        pf = open_documents(path)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_size, columns=["text"]):
            texts = batch.column(0).to_pylist()
            if batch.column(0).null_count:
                raise ValueError(f"{path}: row {row + texts.index(None)}: 'text' is null")
            row += len(texts)
            pending.extend(texts)
            while len(pending) >= batch_size:
                yield pending[:batch_size]
                pending = pending[batch_size:]
    if pending:
        yield pending


def write_training_text(
    corpus: CorpusManifest, path: Path, max_bytes: int, max_lines: int, seed: int
) -> tuple[int, int, str]:
    """Write the trainer's sentences, one per line (UTF-8, "\\n" after each).

    The candidate sentences are the non-blank lines of the documents of the corpus's
    training split, in file and row order, a line longer than `max_bytes` cut by
    `split_long_line`. When there are at most `max_lines` of them all are written;
    otherwise a uniform sample of `max_lines` is drawn in one pass by reservoir sampling
    (Algorithm R: Vitter 1985, "Random sampling with a reservoir", ACM TOMS 11(1)) with
    `random.Random(seed)` and written in corpus order, so the same corpus and seed give
    the same file on every run and machine. Memory holds at most `max_lines` sentences.

    Args:
        corpus: the ingested corpus; only its `train` Parquet files are read.
        path: the text file to write (created or truncated).
        max_bytes: longest line written, in UTF-8 bytes (newline excluded).
        max_lines: most sentences written (>= 1).
        seed: seed of the sampling generator.

    Returns:
        (sentences written, candidate sentences, hex sha256 of the file's bytes).

    Raises:
        ValueError: `max_lines` < 1, a training file lacks a string `text` column, or a
            `text` value is null (the file and row are named).
    """
    if max_lines < 1:
        raise ValueError(f"write_training_text: max_lines={max_lines} must be >= 1")
    rng = random.Random(seed)
    kept: list[bytes] = []
    order: list[int] = []  # candidate index of each kept sentence
    total = 0
    paths = [corpus.file(e.path) for e in corpus.train]
    for text in (t for batch in iter_text_batches(paths, _PARQUET_BATCH_ROWS) for t in batch):
        for line in text.split("\n"):
            if not line.strip():
                continue
            for piece in split_long_line(line, max_bytes):
                if total < max_lines:
                    kept.append(piece.encode("utf-8"))
                    order.append(total)
                else:
                    slot = rng.randrange(total + 1)
                    if slot < max_lines:
                        kept[slot] = piece.encode("utf-8")
                        order[slot] = total
                total += 1
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for i in sorted(range(len(kept)), key=order.__getitem__):
            data = kept[i] + b"\n"
            f.write(data)
            sha.update(data)
    return len(kept), total, sha.hexdigest()


def split_long_line(line: str, max_bytes: int) -> Iterator[str]:
    """Split `line` into pieces of at most `max_bytes` UTF-8 bytes, never dropping text.

    Pieces break at whitespace (runs of whitespace become the break); a single word longer
    than `max_bytes` is cut at character boundaries. A line that fits is yielded unchanged.

    Args:
        line: one line of text (no newline).
        max_bytes: largest piece in UTF-8 bytes (SentencePiece skips longer training lines).

    Yields:
        Non-empty pieces, in order.
    """
    if len(line.encode("utf-8")) <= max_bytes:
        yield line
        return
    current, size = [], 0
    for word in line.split():
        n = len(word.encode("utf-8"))
        if n > max_bytes:
            if current:
                yield " ".join(current)
                current, size = [], 0
            yield from _cut_word(word, max_bytes)
            continue
        extra = n + (1 if current else 0)
        if size + extra > max_bytes:
            yield " ".join(current)
            current, size = [word], n
        else:
            current.append(word)
            size += extra
    if current:
        yield " ".join(current)


def _cut_word(word: str, max_bytes: int) -> Iterator[str]:
    start, size = 0, 0
    for i, ch in enumerate(word):
        n = len(ch.encode("utf-8"))
        if size + n > max_bytes:
            yield word[start:i]
            start, size = i, 0
        size += n
    yield word[start:]




def text_tasks(
    paths: list[Path], batch_size: int, batch_bytes: int
) -> Iterator[list[pa.Array]]:
    """The `text` column of ingested Parquet files as encode tasks: lists of consecutive
    Arrow string arrays (zero-copy slices) holding at most `batch_size` documents and
    `batch_bytes` UTF-8 bytes (a longer document alone), in file and row order.

    Parquet is decoded `_PARQUET_BATCH_ROWS` documents at a time, in this thread: Arrow's
    reader grows its output buffers by reallocation, and 1,024-document reads of the 16x
    benchmark corpus (benchmarks/bench_data.py) held three 10 MiB jemalloc extents at
    their peak against 3-4 MiB ones at 1x (memray, native traces): peak RSS of reading alone
    was 89 / 112 MiB at 1x / 16x with 1,024 rows, 86 / 95 MiB with 256. Arrow's thread pool
    (`use_threads`) gains nothing on one text column and its threads' heaps add memory.

    Args:
        paths: ingested Parquet document files (string column `text`), in order.
        batch_size: most documents per task.
        batch_bytes: most UTF-8 bytes of text per task (a longer document is a task alone).

    Yields:
        Lists of `pa.StringArray` / `pa.LargeStringArray` slices, one list per task.

    Raises:
        ValueError: a file is not Parquet, lacks a string `text` column, or holds a null
            text (the file, and the row, are named).
    """
    pending: list[pa.Array] = []
    docs = size = 0
    for path in paths:
        try:
            pf = open_documents(path)
            row = 0
            for batch in pf.iter_batches(batch_size=min(batch_size, _PARQUET_BATCH_ROWS),
                                         columns=["text"], use_threads=False):
                column = batch.column(0)
                if column.null_count:
                    first = int(np.flatnonzero(column.is_null().to_numpy(False))[0])
                    raise ValueError(f"{path}: row {row + first}: 'text' is null")
                row += len(column)
                for part in byte_slices(column, batch_bytes):
                    nbytes = _text_bytes(part)
                    if pending and (docs + len(part) > batch_size
                                    or size + nbytes > batch_bytes):
                        yield pending
                        pending, docs, size = [], 0, 0
                    pending.append(part)
                    docs += len(part)
                    size += nbytes
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: cannot read Parquet documents: {exc}") from exc
    if pending:
        yield pending


def _offsets(column: pa.Array) -> np.ndarray:
    """The `len + 1` value offsets of a (large) string array, its array offset applied."""
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    return np.frombuffer(column.buffers()[1], width)[column.offset :][: len(column) + 1]


def _text_bytes(column: pa.Array) -> int:
    """UTF-8 bytes of text in a (large) string array."""
    offsets = _offsets(column)
    return int(offsets[-1] - offsets[0]) if len(column) else 0


def byte_slices(column: pa.Array, batch_bytes: int) -> Iterator[pa.Array]:
    """Consecutive zero-copy slices of a (large) string array, each of at most
    `batch_bytes` UTF-8 bytes of text or one longer document; nothing for an empty array."""
    offsets = _offsets(column)
    start, n = 0, len(column)
    while start < n:
        # Largest end with offsets[end] - offsets[start] <= batch_bytes, at least start + 1.
        end = int(np.searchsorted(offsets, offsets[start] + batch_bytes, side="right")) - 1
        end = min(max(end, start + 1), n)
        yield column.slice(start, end - start)
        start = end
