"""Encoding documents to token streams for the shard stage: on threads, or on partitions.

The shard stage (`mlm_pipeline.shards.stage`) reads each split as one stream
`doc1 [SEP] doc2 [SEP] ...` and packs it into rows. Encoding a document needs no other
document, so the stream is the concatenation, in document order, of the streams of any
consecutive runs of documents: encoding is the parallel part, packing and writing stay
sequential in the calling process, and the shards are byte-identical however the
documents are grouped (test: tests/integration/test_partitioned_prep.py).

* `encoded_on_threads` (the default, one process): `text_tasks` batches encoded on worker
  threads, one call of the tokenizer's `BatchEncoder` each (a single-threaded
  SentencePiece call, or `tokenizers`' batch encoding; both release the GIL).
* `partitioned_encoder`: `plan_documents` cuts a split's Parquet files into row ranges
  (`DocPartition`), a `Mapper` (builtin `map`, or Prefect tasks on a Dask cluster in
  `flows/dask_prep.py`) runs `encode_partition` over them (the worker reads its rows
  itself and gets the tokenizer's model as bytes, `Tokenizer.encoder_spec`), and the
  streams come back in order.

Every document is followed by the tokenizer's [SEP] id (`SpecialIds.sep_id`: 3 for our
SentencePiece tokenizers, 102 for a BERT vocabulary).
  The Parquet files must be readable at the same path by every worker (a shared file
  system, or the local cluster of one machine).

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mlm_pipeline.config import ShardConfig
from mlm_pipeline.ingest.documents import byte_slices, open_documents, text_tasks
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.tokenizer.base import BatchEncoder, EncoderSpec, batch_encoder_from_spec

#: `mapper(fn, items)` -> `fn(item)` for every item, in the items' order (builtin `map`).
Mapper = Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]]


def available_cores() -> int:
    """Cores this process may run on (affinity: containers, taskset), else `os.cpu_count()`."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def encode_stream(encoder: BatchEncoder, columns: list[pa.Array], dtype: type,
                  sep_id: int) -> np.ndarray:
    """`doc1 [SEP] doc2 [SEP] ...` of one batch of texts, as a flat `dtype` array.

    Texts go to the encoder as UTF-8 bytes (Arrow's own buffers) and come back as int32
    arrays, never as Python int lists.

    Args:
        encoder: the tokenizer's `BatchEncoder` (`Tokenizer.batch_encoder`).
        columns: Arrow (large) string arrays of document texts, in order.
        dtype: storage dtype of the ids (`np.uint16` or `np.uint32`).
        sep_id: the tokenizer's [SEP] id.

    Returns:
        1-D `dtype` array: each document's ids followed by `sep_id`.
    """
    texts = [t for column in columns for t in column.cast(pa.large_binary()).to_pylist()]
    if not texts:
        return np.empty(0, dtype)
    pieces = encoder(texts)
    sep = np.array([sep_id], np.int32)
    # One pass: [pieces0, SEP, pieces1, SEP, ...] cast to the storage dtype while copying.
    return np.concatenate([a for p in pieces for a in (p, sep)], dtype=dtype, casting="unsafe")


def encoded_on_threads(paths: list[Path], encoder: BatchEncoder, cfg: ShardConfig,
                       dtype: type, workers: int, sep_id: int
                       ) -> Iterator[tuple[int, np.ndarray]]:
    """`(documents, their doc[SEP] stream)` of each `text_tasks` batch of `paths`, in
    order, encoded on `workers` threads with `workers + 1` batches in flight (every worker
    busy, one queued); closing the generator cancels the queued ones.

    Raises:
        ValueError: a Parquet file is malformed (`text_tasks`; the file is named).
    """
    pending: deque[tuple[int, Future[np.ndarray]]] = deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="shards-encode") as pool:
        try:
            batches = text_tasks(paths, cfg.encode_batch_size, cfg.encode_batch_bytes)
            while True:
                while len(pending) <= workers and (task := next(batches, None)) is not None:
                    n = sum(len(column) for column in task)
                    pending.append((n, pool.submit(encode_stream, encoder, task, dtype,
                                                   sep_id)))
                if not pending:
                    return
                n, future = pending.popleft()
                yield n, future.result()
        finally:
            for _, future in pending:  # the pool waits for running ones
                future.cancel()


@dataclass(frozen=True)
class DocPartition:
    """Rows `[start, stop)` (documents, from 0) of one ingested Parquet file."""

    path: str
    start: int
    stop: int


def plan_documents(paths: list[Path], partitions: int) -> list[DocPartition]:
    """Cut the documents of `paths` into runs of at most `ceil(total / partitions)`
    consecutive rows, never across files, in file and row order (an empty file: none).

    Raises:
        ValueError: `partitions` < 1, or a file is not Parquet with a string `text` column.
    """
    if partitions < 1:
        raise ValueError(f"plan_documents: partitions={partitions} must be >= 1")
    rows = [open_documents(p).metadata.num_rows for p in paths]
    size = max(1, math.ceil(sum(rows) / partitions))
    return [DocPartition(str(p), a, min(a + size, n))
            for p, n in zip(paths, rows) for a in range(0, n, size)]


def encode_partition(model: EncoderSpec, sep_id: int, batch_bytes: int, dtype: type,
                     part: DocPartition) -> tuple[int, np.ndarray]:
    """The documents of `part` and their `doc[SEP]` stream (`encode_stream`), encoded in
    batches of at most `batch_bytes` UTF-8 bytes (a longer document alone).

    Args:
        model: the tokenizer's `encoder_spec()` (its model file's bytes: the worker needs
            no copy of it).
        sep_id: the tokenizer's [SEP] id.
        batch_bytes: most bytes of text per encoder call.
        dtype: storage dtype of the ids.
        part: the rows to encode.

    Returns:
        (documents, 1-D `dtype` stream).

    Raises:
        ValueError: the file is not Parquet with a string `text` column, or a text in the
            range is null (the file and row are named).
    """
    pf = open_documents(part.path)
    groups, first, at = [], 0, 0
    for g in range(pf.metadata.num_row_groups):  # the row groups that hold the range
        n = pf.metadata.row_group(g).num_rows
        if at + n > part.start and at < part.stop:
            first = at if not groups else first
            groups.append(g)
        at += n
    table = pf.read_row_groups(groups, columns=["text"], use_threads=False)
    column = table.column(0).slice(part.start - first, part.stop - part.start).combine_chunks()
    if column.null_count:
        row = part.start + int(np.flatnonzero(column.is_null().to_numpy(False))[0])
        raise ValueError(f"{part.path}: row {row}: 'text' is null")
    encoder = batch_encoder_from_spec(model)
    streams = [encode_stream(encoder, [s], dtype, sep_id)
               for s in byte_slices(column, batch_bytes)]
    return len(column), np.concatenate(streams) if streams else np.empty(0, dtype)


def partitioned_encoder(tokenizer: Tokenizer | str | os.PathLike[str], cfg: ShardConfig,
                        mapper: Mapper, partitions: int
                        ) -> Callable[[list[Path], type], Iterator[tuple[int, np.ndarray]]]:
    """The `encode` argument of `write_shards` that encodes each split on about
    `partitions` row ranges through `mapper` (module docstring).

    Args:
        tokenizer: the tokenizer, or its model file in its stage directory (what
            `Tokenizer.load` opens); its model is read once and sent as bytes.
        cfg: the shard config (`encode_batch_bytes`: bytes per encoder call).
        mapper: runs `encode_partition` over the partitions, results in order.
        partitions: row ranges to aim at per split.

    Raises:
        OSError: the model file cannot be read.
        ValueError: it is not a tokenizer (`Tokenizer.load`).
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    model, sep_id = tok.encoder_spec(), tok.sep_id

    def encode(paths: list[Path], dtype: type) -> Iterator[tuple[int, np.ndarray]]:
        plan = plan_documents(paths, partitions)
        yield from mapper(functools.partial(encode_partition, model, sep_id,
                                            cfg.encode_batch_bytes, dtype), plan)

    return encode
