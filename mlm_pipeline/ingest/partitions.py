"""Ingestion over input partitions: read and clean partitions in parallel, merge in order.

The ingestion stage (`mlm_pipeline.ingest.stage`) splits into per-record work, which needs
no other record, and corpus-wide work, which needs every earlier document:

* per record (parallel, `read_partition`): read, decode, repair, screen, drop bad records
  and texts, normalize, split long documents (`Accounting`'s policy, record by record);
* corpus-wide (sequential, in input order, `PartitionedAccounting.documents` then the
  stage's writer): `max_documents`, `on_bad_file`, the counters and `per_file`, exact and
  near deduplication, the train/validation split, document order and file roll-over.

A partition is one input file, or a byte range of a large local uncompressed `.jsonl` file
(cut at a line start) or `.txt` file read as paragraphs (cut at the start of a line that
follows an empty line, where the single-process reader has just ended a document). A range
knows the number of its first line, so ids (`<basename>:<line>`) and the UTF-8 BOM test
(line 1 only) are those of the single-process reader, and the merged stream of documents,
counts and bad files is the one `Accounting.documents` yields: the stage writes the same
bytes and manifest (test: tests/integration/test_partitioned_prep.py).

Cost: `plan_partitions` reads each file it cuts once, sequentially, to number lines (a
regular expression over 1 MiB chunks); a worker holds its partition's cleaned documents
until the merge takes them (memory: the partition's text, about its bytes).

The map over partitions is a function argument (`Mapper`, e.g. the builtin `map`, or a
Prefect task map on a Dask cluster in `flows/dask_prep.py`): this module imports neither
prefect, dask nor torch.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.accounting import Accounting, confined_records
from mlm_pipeline.ingest.readers import (
    Record, _logged, _screened, jsonl_records, read_records, txt_records,
)
from mlm_pipeline.ingest.sources import (
    _WIDE_BOMS, BadFileError, Source, is_url, raw_lines, source_name,
)

#: `mapper(fn, items)` -> `fn(item)` for every item, in the items' order (builtin `map`).
Mapper = Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]]
_CHUNK = 1 << 20  # bytes read at a time
_EOL = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class Partition:
    """Bytes `[start, end)` of input file `file_index` (`end` None: to the end of the file);
    `first_line` is the number (from 1) of the line that starts at `start`."""

    file_index: int
    path: Source
    start: int = 0
    end: int | None = None
    first_line: int = 1


@dataclass
class PartitionResult:
    """What `read_partition` gives the merge.

    Attributes:
        records: one `(events, documents)` per record read, in order: `events` the counter
            increments (`("repaired" | "dropped", reason)`), `documents` the `(id, text,
            source)` the record gave (none when dropped, several when split).
        error: `(reason, message)` of the `BadFileError` that ended the file, else None.
    """

    records: list[tuple[tuple[tuple[str, str], ...], list[tuple[str, str, str]]]] = field(
        default_factory=list)
    error: tuple[str, str] | None = None


def _splittable(path: Source, cfg: IngestConfig) -> bool:
    """A local uncompressed `.jsonl`, or `.txt` read as paragraphs, not UTF-16/32."""
    if is_url(path):
        return False
    name = source_name(path)
    if not (name.endswith(".jsonl") or (name.endswith(".txt") and cfg.txt_document == "paragraph")):
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return not any(head.startswith(bom) for bom, _ in _WIDE_BOMS)


def plan_partitions(files: list[Source], cfg: IngestConfig, partitions: int) -> list[Partition]:
    """Cut the input files into about `partitions` partitions of similar size, in input order.

    Every file is one partition at least; a splittable file (`_splittable`) larger than
    `total bytes / partitions` is cut into ranges of about that size, at the next cut point
    (module docstring) at or after each multiple of it. Files given as URLs, compressed,
    `.json`, `.csv` and `.parquet` files are never cut.

    Raises:
        ValueError: `partitions` < 1.
        OSError: a local file cannot be read.
    """
    if partitions < 1:
        raise ValueError(f"plan_partitions: partitions={partitions} must be >= 1")
    sizes = [None if is_url(f) else os.path.getsize(f) for f in files]
    target = max(1, sum(s or 0 for s in sizes) // partitions)
    plan: list[Partition] = []
    for i, (path, size) in enumerate(zip(files, sizes)):
        if size is None or size <= target or not _splittable(path, cfg):
            plan.append(Partition(i, path))
            continue
        cuts = _cut_points(path, target, paragraphs=source_name(path).endswith(".txt"))
        for (start, line), (end, _) in zip([(0, 1), *cuts], [*cuts, (None, 0)]):
            plan.append(Partition(i, path, start, end, line))
    return plan


def _cut_points(path: Source, every: int, paragraphs: bool) -> list[tuple[int, int]]:
    """`(byte offset, line number)` of the first cut point at or after each multiple of
    `every` bytes: a line start, or (`paragraphs`) a line start after an empty line."""
    cuts: list[tuple[int, int]] = []
    line, line_start = 1, 0
    base, held = 0, b""  # absolute offset of `buf`; a final b"\r" kept for the next chunk
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            buf = held + chunk
            if chunk and buf.endswith(b"\r"):
                buf, held = buf[:-1], b"\r"
            else:
                held = b""
            for m in _EOL.finditer(buf):
                empty = base + m.start() == line_start
                line, line_start = line + 1, base + m.end()
                next_cut = (len(cuts) + 1) * every
                if line_start >= next_cut and (not paragraphs or empty):
                    cuts.append((line_start, line))
            base += len(buf)
            if not chunk:
                break
    return [(at, n) for at, n in cuts if at < base]


class _Range:
    """A binary stream of bytes `[start, end)` of a local file."""

    def __init__(self, path: Source, start: int, end: int | None) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 (closed by close)
        self.f.seek(start)
        self.left = None if end is None else end - start

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (all that is left of the range when `n` < 0); b"" at its end."""
        if self.left is not None:
            n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        if self.left is not None:
            self.left -= len(data)
        return data

    def close(self) -> None:
        """Close the file."""
        self.f.close()


def _range_records(part: Partition, cfg: IngestConfig) -> Iterator[Record]:
    """The records of a byte-range partition, as `readers.txt_records` /
    `readers.jsonl_records` give them for the same lines of the whole file (ids and
    positions by absolute line)."""
    name, jsonl = source_name(part.path), source_name(part.path).endswith(".jsonl")

    def rows() -> Iterator[tuple[int, Record]]:
        f = _Range(part.path, part.start, part.end)
        try:
            raw = raw_lines(f, _CHUNK)
            yield from (jsonl_records(raw, name, cfg.text_field, part.first_line) if jsonl
                        else txt_records(raw, name, False, part.first_line))
        finally:
            f.close()

    return _logged(part.path, "line", cfg.text_field, _screened(rows()))


class _Tally(dict):
    """A counter dict that also notes every key it is incremented at, in `events`."""

    def __init__(self, kind: str, keys: Iterable[str], events: list[tuple[str, str]]) -> None:
        super().__init__(dict.fromkeys(keys, 0))
        self.kind, self.events = kind, events

    def __setitem__(self, key: str, value: int) -> None:
        self.events.append((self.kind, key))
        super().__setitem__(key, value)


def read_partition(cfg: IngestConfig, part: Partition) -> PartitionResult:
    """Read and clean one partition, record by record, as `Accounting.documents` does
    (repairs, drops, normalization, splitting; no deduplication).

    A file that now resolves outside `cfg.allowed_sources` although it was listed inside
    (`accounting.confined_records`) is a bad file, never opened. Reads at most
    `max_documents` records (no partition can give the merge more), and with
    `on_bad_file: fail` the rest of the file too, without keeping them, so that a bad file
    is found as the single-process run finds it.

    Returns:
        The partition's records and the error that ended its file, if any
        (`PartitionResult`).

    Raises:
        ValueError: the file's type is unsupported (`readers.read_records`).
        OSError: the file cannot be opened.
    """
    events: list[tuple[str, str]] = []
    acc = Accounting(cfg)
    acc.dropped = _Tally("dropped", acc.dropped, events)
    acc.repaired = _Tally("repaired", acc.repaired, events)
    langs = set(cfg.languages) if cfg.languages is not None else None
    whole = part.start == 0 and part.end is None
    records = confined_records(part.path, cfg, read_records(
        part.path, cfg.text_field, cfg.txt_document) if whole else _range_records(part, cfg))
    out = PartitionResult()
    limit = cfg.max_documents
    try:
        while True:
            full = limit is not None and len(out.records) >= limit
            if full and cfg.on_bad_file != "fail":
                break
            try:
                rec = next(records, None)
            except BadFileError as e:
                out.error = (e.reason, str(e))
                break
            if rec is None:
                break
            if full:
                continue  # read through, to find a bad file
            events.clear()
            events += [("repaired", reason) for reason in rec.repairs]
            docs: list[tuple[str, str, str]] = []
            if (drop := acc._drop_reason(rec.drop, rec.lang, langs)) is not None:
                events.append(("dropped", drop))
            else:
                docs = list(acc._cleaned(rec.id, rec.text, rec.source, rec.repairs))
            out.records.append((tuple(events), docs))
    finally:
        records.close()
    return out


class _Rejected(BadFileError):
    """A `BadFileError` of a worker, rebuilt from its reason and message."""

    def __init__(self, path: Source, reason: str, message: str) -> None:
        ValueError.__init__(self, message)
        self.path, self.reason = path, reason


class PartitionedAccounting(Accounting):
    """`Accounting` whose `documents` reads partitions through `mapper` and merges them in
    input order: the same documents, counters, `per_file` and bad files (with their
    warnings) as the single-process `Accounting.documents`.

    Args:
        cfg: the ingestion config.
        mapper: runs `read_partition` over the partitions (`Mapper`; builtin `map` runs
            them in this process, one after the other).
        partitions: partitions to aim at (`plan_partitions`).
    """

    def __init__(self, cfg: IngestConfig, mapper: Mapper, partitions: int) -> None:
        super().__init__(cfg)
        self.mapper, self.partitions = mapper, partitions

    def documents(self, files: list[Source]) -> Iterator[tuple[str, str, str]]:
        """`Accounting.documents` over partitions read by the mapper (see the class)."""
        cfg, limit = self.cfg, self.cfg.max_documents
        plan = plan_partitions(files, cfg, self.partitions)
        results = self.mapper(functools.partial(read_partition, cfg), plan)
        current, checking, ended = -1, False, False
        for part, res in zip(plan, results):
            i = part.file_index
            if i != current:  # a new file
                current, ended = i, False
                checking = bool(self.bad_files) and cfg.on_bad_file == "fail"
            if ended:
                continue  # its file was bad in an earlier range
            for events, docs in res.records:
                if limit is not None and self.read >= limit:
                    return
                if checking:
                    continue
                self.read += 1
                self.per_file[i] = self.per_file.get(i, 0) + 1
                for kind, reason in events:
                    getattr(self, kind)[reason] += 1
                if ("repaired", "split") in events:
                    self.split_parts_extra += len(docs) - 1
                yield from docs
            if res.error is not None and (limit is None or self.read < limit):
                self._reject(part.path, _Rejected(part.path, *res.error),
                             self.per_file.get(i, 0))
                ended = True
            if limit is not None and self.read >= limit:
                return


def partitioned(mapper: Mapper, partitions: int) -> Callable[[IngestConfig], Accounting]:
    """The `accounting` argument of `ingest` that reads through `mapper` over about
    `partitions` partitions (`PartitionedAccounting`)."""
    return functools.partial(PartitionedAccounting, mapper=mapper, partitions=partitions)
