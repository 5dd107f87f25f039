"""Packing of the shards stage: encoded documents -> fixed-length rows -> Arrow shards.

`write_split` encodes one split's documents (on worker threads, `parallel`), packs the
doc[SEP] token stream into rows of `[CLS]` + `seq_len - 1` tokens (the remainder dropped;
see `stage`'s module docstring) and writes them with `ShardWriter`, `rows_per_shard` rows
per Arrow shard, holding only the rows of one chunk in memory.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from mlm_pipeline.config import SENTENCEPIECE_SPECIAL_IDS, ShardConfig, SpecialIds
from mlm_pipeline.locks import temp_path
from mlm_pipeline.manifest import FileEntry, ShardSplit, Stopwatch
from mlm_pipeline.progress import Progress
from mlm_pipeline.shards.format import write_arrow_from_body
from mlm_pipeline.shards.parallel import available_cores, encoded_on_threads
from mlm_pipeline.tokenizer.base import BatchEncoder

logger = logging.getLogger(__name__)

_DTYPES = {"uint16": (np.uint16, pa.uint16()), "uint32": (np.uint32, pa.uint32())}
#: `encode(paths, dtype)`: `(documents, doc[SEP] stream)` of the files, in order (`_build`).
Encoder = Callable[[list[Path], type], Iterator[tuple[int, np.ndarray]]]


def write_split(name: str, paths: list[Path], encoder: BatchEncoder, cfg: ShardConfig,
                dtype: str, out_dir: Path, progress: Progress, encode: Encoder | None = None,
                special_ids: SpecialIds | None = None) -> ShardSplit:
    """Encode, pack and write one split; see the module docstring for the packing.

    `special_ids` gives the [CLS] that begins every row and the [SEP] after every
    document (the tokenizer's; None: `SENTENCEPIECE_SPECIAL_IDS`).

    Encoding runs on `cfg.num_threads` worker threads (0 = one per available core), one
    record batch per task, each with one call of the tokenizer's encoder (a
    single-threaded SentencePiece call, or `tokenizers`' batch encoding): both release
    the GIL while they encode, so the workers use every core, batches of uneven
    length balance across them, and Parquet decoding, packing and writing in this thread
    overlap with encoding. Results are consumed in submission order, so the rows do not
    depend on the thread count.
    """
    watch = Stopwatch()
    special_ids = special_ids or SENTENCEPIECE_SPECIAL_IDS
    np_dtype = _DTYPES[dtype][0]
    workers = cfg.num_threads or available_cores()
    writer = ShardWriter(out_dir, name, cfg.seq_len, cfg.rows_per_shard, dtype,
                         special_ids.cls_id)
    carry = np.empty(0, np_dtype)  # stream tokens not yet in a row; always < body
    documents = tokens_in = rows = 0
    chunks = (encode(paths, np_dtype) if encode is not None
              else encoded_on_threads(paths, encoder, cfg, np_dtype, workers,
                                      special_ids.sep_id))
    try:
        for n, chunk in chunks:
            documents, tokens_in = documents + n, tokens_in + len(chunk)
            stream = np.concatenate([carry, chunk]) if len(carry) else chunk
            packed = writer.pack(stream)
            carry = stream[packed:].copy()
            rows += packed // (cfg.seq_len - 1)
            progress.update(f"shards {name}", float(documents), rows=rows)
    except BaseException:
        writer.abort()
        raise
    finally:
        getattr(chunks, "close", lambda: None)()  # stops the encoders (a generator)
    shards = writer.close()
    rows_total = sum(e.rows or 0 for e in shards)
    # The encoders never emit [SEP] for text (no `add_eos`, special names encoded as
    # text): every [SEP] left over is a separator.
    separators = int(np.count_nonzero(carry == special_ids.sep_id))
    logger.info("shards: %s: %d documents, %d tokens -> %d rows in %d shards, %d remainder "
                "tokens (%d [SEP]) (%.0f tokens/s, %d encode threads)", name, documents,
                tokens_in, rows_total, len(shards), len(carry), separators,
                tokens_in / max(watch.elapsed, 1e-9), workers)
    return ShardSplit(shards=shards, rows=rows_total, documents=documents, tokens_in=tokens_in,
                      remainder_tokens=len(carry), remainder_separators=separators,
                      remainder_content_tokens=len(carry) - separators)


class ShardWriter:
    """Cuts rows of one split and appends them to the current shard's body file (a
    temporary file beside the shards); when `rows_per_shard` rows are in, the shard is
    written around that body (`shard_io.write_arrow_from_body`, byte-identical to writing
    the rows from memory) and the body file removed. Memory is the rows of one `pack`
    call, whatever the shard size or the corpus: a `(rows_per_shard, seq_len)` buffer
    (16 MiB at the defaults, 128 MiB at seq_len 512 with uint32 ids) is never held.
    """

    def __init__(self, out_dir: Path, split: str, seq_len: int, rows_per_shard: int, dtype: str,
                 cls_id: int = SENTENCEPIECE_SPECIAL_IDS.cls_id) -> None:
        self.out_dir, self.split, self.seq_len, self.cls_id = out_dir, split, seq_len, cls_id
        self.rows_per_shard, self.dtype, self.filled = rows_per_shard, _DTYPES[dtype][0], 0
        self.body: BinaryIO | None = None
        self._body: Path | None = None  # the body file's temporary name
        self.entries: list[FileEntry] = []

    def _path(self) -> Path:
        return self.out_dir / f"{self.split}-{len(self.entries):05d}.arrow"

    def _body_path(self) -> Path:  # a temporary name: removed as stale by a rerun
        if self._body is None:
            self._body = temp_path(self._path().with_suffix(".arrow.body"))
        return self._body

    def pack(self, stream: np.ndarray) -> int:
        """Cut the full rows out of `stream` (each [CLS] + `seq_len - 1` stream tokens)
        and append them to the shard being written; writes each shard that fills.

        Returns:
            Stream tokens consumed (a multiple of `seq_len - 1`); the rest is left over.
        """
        body = self.seq_len - 1
        n, done = len(stream) // body, 0
        while done < n:
            take = min(n - done, self.rows_per_shard - self.filled)
            rows = np.empty((take, self.seq_len), self.dtype)
            rows[:, 0] = self.cls_id
            rows[:, 1:] = stream[done * body : (done + take) * body].reshape(take, body)
            if self.body is None:
                self.body = open(self._body_path(), "wb")  # noqa: SIM115 (closed in _flush)
            self.body.write(rows)
            self.filled += take
            done += take
            if self.filled == self.rows_per_shard:
                self._flush()
        return n * body

    def close(self) -> list[FileEntry]:
        """Write the last, partial shard; returns every shard written, in order."""
        if self.filled:
            self._flush()
        return self.entries

    def abort(self) -> None:
        """Close and remove the body file of an unfinished shard (after an error)."""
        if self.body is not None:
            self.body.close()
            self.body = None
            self._body_path().unlink(missing_ok=True)

    def _flush(self) -> None:
        """Write the current shard around its body file and start the next one."""
        body_path = self._body_path()
        self.body.close()
        self.body = None
        self.entries.append(write_arrow_from_body(
            self.out_dir, self._path(), "input_ids", body_path, self.dtype, self.seq_len))
        body_path.unlink()
        self._body, self.filled = None, 0
