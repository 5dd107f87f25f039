"""Ingested Parquet document files as text: open, stream, and write as bounded lines.

Ingestion writes each split of a corpus as Parquet files with a string column `text`, one
document per row. This module reads them back for the later stages: `open_documents` opens
and checks one file (shared by the tokenizer and shard stages), `write_training_text`
turns the training split into the line file that the SentencePiece trainer reads (each
non-blank line of a document on a line of its own, a line longer than the trainer's limit
cut by `split_long_line`, so no text is dropped; a seeded uniform sample when there are
more lines than the trainer takes), and `text_tasks` cuts the texts into encode tasks
bounded in documents and bytes (zero-copy Arrow slices) for the shard stage.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlm_pipeline.manifest import CorpusManifest

#: Documents per Parquet read of `text_tasks` (the shard stage): Arrow grows a read's
#: output buffers by reallocation, to 10 MiB extents at 1,024 rows of a large file.
_PARQUET_BATCH_ROWS = 128
#: Documents per Parquet read of `write_training_text`: larger, as each read costs a dozen
#: Arrow compute calls (256x corpus: 12.8 s against 14.9 s at 128); the pool is released
#: before the trainer runs, whose own memory dwarfs these buffers.
_TRAINING_TEXT_ROWS = 1024


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


def write_training_text(corpus: CorpusManifest, path: Path, max_bytes: int, max_lines: int,
                        seed: int) -> tuple[int, int, str]:
    """Write the trainer's sentences, one per line (UTF-8, "\\n" after each).

    The candidate sentences are the non-blank lines of the documents of the corpus's
    training split, in file and row order, numbered from 0, a line longer than `max_bytes`
    cut by `split_long_line` (a line is blank when empty or all `str.isspace`). When there
    are at most `max_lines` of them all are written; otherwise a uniform sample of
    `max_lines`, written in corpus order, chosen by reservoir sampling (Algorithm R:
    Vitter 1985, "Random sampling with a reservoir", ACM TOMS 11(1)): candidates
    0..max_lines-1 fill the reservoir; candidate t >= max_lines takes the next raw 64-bit
    output x of numpy's `PCG64(seed)` bit generator, j = min(floor(u * (t + 1)), t) with
    u = (x >> 11) * 2**-53, and replaces reservoir slot j when j < max_lines. Integer
    streams and IEEE-754 products: the same file on every run and machine.

    Lines are split, filtered and counted with Arrow compute; the reservoir holds candidate
    numbers (8 bytes each), and a second pass writes the chosen sentences, so memory does
    not depend on the corpus or on the sentences' length. A corpus of at most `max_lines`
    candidates is written in one pass.

    Args:
        corpus: the ingested corpus; only its `train` Parquet files are read.
        path: the text file to write (created or truncated).
        max_bytes: longest line written, in UTF-8 bytes (newline excluded).
        max_lines: most sentences written (>= 1).
        seed: seed of the sampling bit generator.

    Returns:
        (sentences written, candidate sentences, hex sha256 of the file's bytes).

    Raises:
        ValueError: `max_lines` < 1, a training file lacks a string `text` column, or a
            `text` value is null (the file and row are named).
    """
    if max_lines < 1:
        raise ValueError(f"write_training_text: max_lines={max_lines} must be >= 1")
    paths = [corpus.file(e.path) for e in corpus.train]
    bitgen = np.random.PCG64(seed)
    chosen = np.empty(max_lines, dtype=np.int64)  # the reservoir: candidate numbers
    total, sha = 0, hashlib.sha256()
    with open(path, "wb") as f:
        for batch in _candidates(paths, max_bytes):
            n, fill = len(batch), max(0, min(max_lines - total, len(batch)))
            chosen[total:total + fill] = np.arange(total, total + fill)
            if total + n <= max_lines:  # no sampling yet: write as we go
                _write(f, sha, batch, None)
            elif n > fill:
                t = np.arange(total + fill, total + n, dtype=np.int64)
                u = (bitgen.random_raw(n - fill) >> np.uint64(11)).astype(np.float64) * 2.0**-53
                j = np.minimum(np.floor(u * (t + 1)).astype(np.int64), t)
                slots, picks = j[j < max_lines], t[j < max_lines]
                # Later candidates replace earlier ones: keep each slot's last pick.
                last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
                chosen[slots[last]] = picks[last]
            total += n
    pa.default_memory_pool().release_unused()  # the trainer runs next, in this process
    if total <= max_lines:
        return total, total, sha.hexdigest()
    picks, start, sha = np.sort(chosen), 0, hashlib.sha256()
    with open(path, "wb") as f:
        for batch in _candidates(paths, max_bytes):
            first, end = np.searchsorted(picks, [start, start + len(batch)])
            _write(f, sha, batch, picks[first:end] - start)
            start += len(batch)
    pa.default_memory_pool().release_unused()
    return max_lines, total, sha.hexdigest()


def _candidates(paths: list[Path], max_bytes: int) -> Iterator[pa.Array | list[str]]:
    """The candidate sentences of `write_training_text`, per Parquet batch: an Arrow string
    array, or a list of str for a batch with a line longer than `max_bytes` (cut here)."""
    for path in paths:
        pf, row = open_documents(path), 0
        for batch in pf.iter_batches(batch_size=_TRAINING_TEXT_ROWS, columns=["text"],
                                     use_threads=False):
            texts = batch.column(0)
            if texts.null_count:
                first = pc.index(pc.is_null(texts), True).as_py()
                raise ValueError(f"{path}: row {row + first}: 'text' is null")
            row += len(texts)
            lines = pc.list_flatten(pc.split_pattern(texts, "\n"))
            blank = pc.or_(pc.equal(pc.utf8_length(lines), 0), pc.utf8_is_space(lines))
            lines = lines.filter(pc.invert(blank))
            if len(lines) and pc.max(pc.binary_length(lines)).as_py() > max_bytes:
                yield [p for line in lines.to_pylist() for p in split_long_line(line, max_bytes)]
            else:
                yield lines


def _write(f, sha, batch: pa.Array | list[str], which: np.ndarray | None) -> None:
    """Write the sentences of `batch` at positions `which` (all when None), each + "\\n".

    An Arrow batch is joined by Arrow and written from its buffer: no Python string per
    sentence."""
    if which is not None:
        batch = [batch[i] for i in which] if isinstance(batch, list) else batch.take(which)
    if not len(batch):
        return
    if isinstance(batch, list):
        chunks = ["".join(t + "\n" for t in batch).encode("utf-8")]
    else:
        whole = pa.ListArray.from_arrays(pa.array([0, len(batch)], pa.int32()), batch)
        joined = pc.binary_join(whole, pa.scalar("\n", batch.type))[0].as_buffer()
        chunks = [memoryview(joined), b"\n"]
    for chunk in chunks:
        f.write(chunk)
        sha.update(chunk)


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


def text_tasks(paths: list[Path], batch_size: int,
               batch_bytes: int) -> Iterator[list[pa.Array]]:
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
                    docs, size = docs + len(part), size + nbytes
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
