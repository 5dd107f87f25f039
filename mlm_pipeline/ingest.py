"""Stage 1, ingestion: raw text files -> cleaned, deduplicated Parquet documents per split.

Inputs (`IngestConfig.sources`, in order): `debian:NAME` (a built-in corpus, see
`mlm_pipeline.corpora`), a file, a directory (recursively: `*.txt`, `*.jsonl`, optionally
`.gz`) or a glob. Records are read as bytes and repaired or dropped, and every repair and
drop is counted in the manifest:

* `.txt`: records end at `\\n`, `\\r\\n` or `\\r` only. U+2028, U+2029, U+0085 and form
  feed never split a record (unlike `str.splitlines`). A document is a run of non-blank
  lines (`txt_document="paragraph"`) or the whole file (`"file"`), its lines joined
  with `\\n`. Its id is `<basename>:<first line number>`.
* `.jsonl`: one JSON object per `\\n`-terminated line (a trailing `\\r` is tolerated, blank
  lines are skipped); the text is `cfg.text_field`; `id` and `source` fields are used
  when present.
* Repairs (counted once per document read, kept or dropped): a UTF-8 BOM at the start of
  a file (`bom`), invalid UTF-8 bytes or lone surrogates replaced by U+FFFD
  (`invalid_utf8`), NUL characters removed (`nul`).
* Drops: `bad_json`, `missing_text` (field absent or not a string), `empty`, `too_short`,
  `duplicate` (exact match on the normalized text; memory: one 16-byte digest per kept
  document).

Split: a document goes to validation iff the first 8 bytes of sha256(normalized text),
read as a big-endian integer and divided by 2**64, are below `validation_fraction`. The
result depends on the text only: same on any machine, in any order. When that leaves
validation empty although `validation_fraction > 0` and at least 2 documents are kept,
the kept document with the smallest such hash is moved to validation, so evaluation
always has data.

Output: `train-NNNNN.parquet` and `validation-NNNNN.parquet` (string columns `id`,
`text`, `source`; zstd; a new file every `DOCS_PER_FILE` documents) written streaming in
batches of `BATCH_DOCS`, in reading order.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import functools
import logging
import os
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline import corpora
from mlm_pipeline.config import IngestConfig
from mlm_pipeline.manifest import (
    CorpusManifest,
    FileEntry,
    SourceEntry,
    Stopwatch,
    compute_digest,
    file_entry,
    load_if_complete,
    sha256_file,
    stage_dir,
    write_manifest,
)

logger = logging.getLogger(__name__)

#: Documents per Parquet file before rolling over to the next one.
DOCS_PER_FILE = 50_000
#: Documents buffered per Parquet write (one row group each).
BATCH_DOCS = 1_000
#: Input file name endings read from directories and accepted from globs and paths.
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
DROP_REASONS = ("bad_json", "missing_text", "empty", "too_short", "duplicate")
REPAIR_REASONS = ("bom", "invalid_utf8", "nul")
_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string())])
_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
_WARN_FIRST = 5  # bad lines named individually per reason and file, then only counted
# A record read from an input: id, raw text, source, repairs made, drop reason (bad JSONL).
_Record = tuple[str, str, str, set[str], str | None]


def ingest(cfg: IngestConfig, work_dir: str | Path) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus into Parquet files.

    Args:
        cfg: ingestion config.
        work_dir: root of the stage outputs; this stage writes `<work_dir>/ingest/<digest>`.

    Returns:
        The manifest: sources (path, sha256, bytes, documents read), the Parquet files of
        each split (rows = documents), document and character counts, drops and repairs
        by reason (every reason present, 0 when none).

    Raises:
        FileNotFoundError: a source matches no file.
        ValueError: a file has an unsupported extension; the training split would be
            empty; an unknown `debian:` corpus name.
        RuntimeError: a `debian:` corpus cannot be fetched (see `corpora.fetch_debian_corpus`).
    """
    watch = Stopwatch()
    files = resolve_sources(cfg)
    hashes = [_content_hash(f) for f in files]
    digest = _digest(cfg, files, hashes)
    out_dir = stage_dir(work_dir, "ingest", digest)
    if (cached := load_if_complete(out_dir, CorpusManifest, digest)) is not None:
        logger.info("ingest: cached %s (%d documents)", out_dir, cached.documents_kept)
        return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".*.tmp"):  # left by an interrupted run
        stale.unlink()
    reader = _Reader(cfg)
    writers = {"train": _SplitWriter(out_dir, "train"),
               "validation": _SplitWriter(out_dir, "validation")}
    seen: set[bytes] = set()
    smallest: tuple[bytes, int, int] | None = None  # train doc with the smallest split hash
    kept = characters = 0
    threshold = cfg.validation_fraction
    try:
        for doc_id, text, source in reader.documents(files):
            data = text.encode("utf-8")
            key = hashlib.blake2b(data, digest_size=16).digest()
            if key in seen:
                reader.dropped["duplicate"] += 1
                continue
            seen.add(key)
            kept += 1
            characters += len(text)
            h = hashlib.sha256(data).digest()[:8]
            split = "validation" if int.from_bytes(h, "big") / 2**64 < threshold else "train"
            if split == "train" and (smallest is None or h < smallest[0]):
                smallest = (h, len(writers["train"].entries), writers["train"].rows_in_file)
            writers[split].add(doc_id, text, source)
        train, validation = writers["train"].close(), writers["validation"].close()
        n_val = sum(e.rows or 0 for e in validation)
        if n_val == 0 and threshold > 0 and kept >= 2 and smallest is not None:
            train, validation = _move_to_validation(out_dir, train, smallest[1], smallest[2])
            n_val = 1
            logger.info("ingest: validation split was empty; moved the document with the "
                        "smallest split hash from train to validation")
        if kept - n_val == 0:
            raise ValueError(f"ingest: the training split is empty ({reader.read} records read, "
                             f"{kept} kept, {n_val} in validation); check the sources "
                             f"{cfg.sources} and validation_fraction {threshold}")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    m = CorpusManifest(
        stage="ingest", digest=digest, output_dir=str(out_dir),
        config=cfg.model_dump(mode="json"), inputs=_inputs(files, hashes),
        created_at=watch.created_at, wall_time_s=watch.elapsed,
        sources=[SourceEntry(path=str(f), sha256=h, bytes=f.stat().st_size,
                             documents=reader.per_file.get(i, 0))
                 for i, (f, h) in enumerate(zip(files, hashes))],
        train=train, validation=validation,
        documents_read=reader.read, documents_kept=kept, documents_train=kept - n_val,
        documents_validation=n_val, characters=characters,
        dropped=dict(reader.dropped), repaired=dict(reader.repaired),
    )
    write_manifest(m)
    drops = ", ".join(f"{k} {v}" for k, v in m.dropped.items() if v) or "none"
    repairs = ", ".join(f"{k} {v}" for k, v in m.repaired.items() if v) or "none"
    logger.info("ingest: %d files, %d read, %d kept (train %d, validation %d), %d chars; "
                "dropped: %s; repaired: %s; %.1f s -> %s", len(files), m.documents_read,
                kept, m.documents_train, n_val, characters, drops, repairs, m.wall_time_s,
                out_dir)
    return m


def ingest_digest(cfg: IngestConfig) -> str:
    """The digest `ingest(cfg, ...)` would give its output, without reading documents:
    resolves the sources (fetching `debian:` corpora if needed) and hashes their bytes.

    Raises:
        The errors of `resolve_sources`.
    """
    files = resolve_sources(cfg)
    return _digest(cfg, files, [_content_hash(f) for f in files])


def _content_hash(path: Path) -> str:
    """sha256 of a file's bytes, computed once per process for an unchanged file: the
    orchestrator's cache key (`ingest_digest`) and `ingest` itself both need it, and a
    large corpus should be read once, not twice."""
    st = path.stat()
    return _sha256_memo(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def _sha256_memo(path: str, size: int, mtime_ns: int, inode: int) -> str:
    # (size, mtime, inode) only decide whether to reuse a hash taken in this process; the
    # digest itself is always the content's sha256.
    return sha256_file(path)


def _inputs(files: list[Path], hashes: list[str]) -> dict[str, str]:
    # Content only: the same bytes under another directory give the same digest. The
    # basename stays in the key because document ids contain it.
    return {f"{i:05d}:{f.name}": h for i, (f, h) in enumerate(zip(files, hashes))}


def _digest(cfg: IngestConfig, files: list[Path], hashes: list[str]) -> str:
    return compute_digest(
        "ingest", cfg.model_dump(mode="json", exclude={"cache_dir", "sources"}),
        _inputs(files, hashes),
    )


def resolve_sources(cfg: IngestConfig) -> list[Path]:
    """Expand `cfg.sources` into input files, in order (directories and globs sorted).

    Raises:
        FileNotFoundError: an entry matches no file (the entry is named).
        ValueError: a file has an unsupported extension (the file is named), or an
            unknown `debian:` name.
        RuntimeError: a `debian:` corpus cannot be fetched.
    """
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else corpora.default_cache_dir()
    files: list[Path] = []
    for entry in cfg.sources:
        if entry.startswith("debian:"):
            files += corpora.fetch_debian_corpus(entry.removeprefix("debian:"), cache_dir)
            continue
        p = Path(entry).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _supported(f))
        elif p.is_file():
            found = [p]
        else:
            matches = glob.glob(os.path.expanduser(entry), recursive=True)
            found = sorted(Path(g) for g in matches if Path(g).is_file())
        if not found:
            raise FileNotFoundError(f"ingest.sources: {entry!r} matches no file")
        for f in found:
            if not _supported(f):
                raise ValueError(f"ingest.sources: {f}: unsupported file type; expected "
                                 f"one of {', '.join(SUPPORTED_SUFFIXES)}")
        files += [f.resolve() for f in found]
    return files


def _supported(path: Path) -> bool:
    return path.name.endswith(SUPPORTED_SUFFIXES)


def read_documents(files: list[Path]) -> Iterator[tuple[str, str]]:
    """Stream `(id, text)` from ingest Parquet files, in file order, `BATCH_DOCS` at a time.

    Args:
        files: Parquet files written by `ingest` (e.g. `[m.file(e.path) for e in m.train]`).

    Yields:
        `(id, text)` of every document.
    """
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_DOCS, columns=["id", "text"]):
            yield from zip(batch.column("id").to_pylist(), batch.column("text").to_pylist())


# ---------------------------------------------------------------------------------- reading
class _Reader:
    """Turns input files into cleaned documents and counts reads, drops and repairs."""

    def __init__(self, cfg: IngestConfig) -> None:
        self.cfg = cfg
        self.read = 0
        self.per_file: dict[int, int] = {}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.repaired = dict.fromkeys(REPAIR_REASONS, 0)

    def documents(self, files: list[Path]) -> Iterator[tuple[str, str, str]]:
        """`(id, normalized text, source)` of every document that survives cleaning
        (deduplication is the caller's), stopping after `max_documents` records."""
        limit = self.cfg.max_documents
        for i, path in enumerate(files):
            jsonl = path.name.endswith((".jsonl", ".jsonl.gz"))
            records = self._jsonl(path) if jsonl else self._txt(path)
            while limit is None or self.read < limit:
                # Pull a record only when it will be counted, so that nothing past
                # `max_documents` is read, repaired or dropped.
                if (rec := next(records, None)) is None:
                    break
                doc_id, text, source, repairs, drop = rec
                self.read += 1
                self.per_file[i] = self.per_file.get(i, 0) + 1
                for reason in repairs:
                    self.repaired[reason] += 1
                if drop is not None:
                    self.dropped[drop] += 1  # a bad JSONL record
                    continue
                if "\x00" in text:
                    text = text.replace("\x00", "")
                    if "nul" not in repairs:
                        self.repaired["nul"] += 1
                text = unicodedata.normalize(self.cfg.normalization, text).strip()
                if not text:
                    self.dropped["empty"] += 1
                elif len(text) < self.cfg.min_chars:
                    self.dropped["too_short"] += 1
                else:
                    yield doc_id, text, source
            records.close()
            if limit is not None and self.read >= limit:
                return

    def _txt(self, path: Path) -> Iterator[_Record]:
        name = path.name
        by_file = self.cfg.txt_document == "file"
        lines: list[str] = []
        start, repairs = 0, set()
        with _open(path) as f:
            for lineno, raw in enumerate(_raw_lines(f), 1):
                line, fixes = _decode(raw, lineno == 1)
                if not by_file and not line.strip():
                    if lines:
                        yield f"{name}:{start}", "\n".join(lines), name, repairs, None
                        lines, repairs = [], set()
                    else:
                        repairs |= fixes & {"bom"}  # a BOM on a blank line: next document
                    continue
                if not lines:
                    start = lineno
                lines.append(line)
                repairs |= fixes
        if lines:
            yield f"{name}:{start}", "\n".join(lines), name, repairs, None

    def _jsonl(self, path: Path) -> Iterator[_Record]:
        """Records of a JSONL file; a bad record carries its drop reason."""
        name, field = path.name, self.cfg.text_field
        bad = dict.fromkeys(("bad_json", "missing_text"), 0)
        try:
            with _open(path) as f:
                for lineno, raw in enumerate(f, 1):  # binary files split on b"\n" only
                    line, fixes = _decode(raw.rstrip(b"\n").removesuffix(b"\r"), lineno == 1)
                    if not line.strip():
                        continue  # a blank line is no record
                    try:
                        obj = json.loads(line)
                        reason = None if isinstance(obj, dict) else "bad_json"
                    except ValueError:
                        obj, reason = None, "bad_json"
                    if reason is None and not isinstance(obj.get(field), str):
                        reason = "missing_text"
                    if reason is not None:
                        bad[reason] += 1
                        if bad[reason] <= _WARN_FIRST:
                            what = ("not a JSON object" if reason == "bad_json"
                                    else f"field {field!r} missing or not a string")
                            logger.warning("%s:%d: %s; dropped", path, lineno, what)
                        yield f"{name}:{lineno}", "", name, fixes, reason
                        continue
                    text = obj[field]
                    if _SURROGATE.search(text):  # "\ud800" escapes decode to lone surrogates
                        text = _SURROGATE.sub("\ufffd", text)
                        fixes.add("invalid_utf8")
                    doc_id = obj.get("id")
                    doc_id = str(doc_id) if isinstance(doc_id, (str, int)) else f"{name}:{lineno}"
                    source = obj["source"] if isinstance(obj.get("source"), str) else name
                    yield (_SURROGATE.sub("\ufffd", doc_id), text,
                           _SURROGATE.sub("\ufffd", source), fixes, None)
        finally:  # also when the caller stops early (max_documents)
            for reason, n in bad.items():
                if n:
                    logger.warning("%s: %d lines dropped as %s", path, n, reason)


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _raw_lines(f: IO[bytes], chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a binary stream split on `\\r\\n`, `\\r` or `\\n` only, terminators
    removed; memory holds one chunk plus the current line."""
    buf = b""
    while chunk := f.read(chunk_bytes):
        buf += chunk
        # A final "\r" may be the first half of "\r\n": keep it for the next chunk.
        end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        cut = max(buf.rfind(b"\n", 0, end), buf.rfind(b"\r", 0, end))
        if cut < 0:
            continue
        yield from _EOL.split(buf[:cut + 1])[:-1]
        buf = buf[cut + 1:]
    if buf:
        yield from _EOL.split(buf)[:-1] if _EOL.search(buf[-1:]) else _EOL.split(buf)


def _decode(raw: bytes, first: bool) -> tuple[str, set[str]]:
    """Decode one line; returns the text and the repairs made (BOM, invalid UTF-8, NUL)."""
    fixes = set()
    if first and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
        fixes.add("bom")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        fixes.add("invalid_utf8")
    if "\x00" in text:
        text = text.replace("\x00", "")
        fixes.add("nul")
    return text, fixes


# ---------------------------------------------------------------------------------- writing
class _SplitWriter:
    """Streams one split into Parquet files of at most `DOCS_PER_FILE` documents."""

    def __init__(self, out_dir: Path, split: str) -> None:
        self.out_dir, self.split = out_dir, split
        self.entries: list[FileEntry] = []
        self.batch: dict[str, list[str]] = {"id": [], "text": [], "source": []}
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.rows_in_file = 0

    def add(self, doc_id: str, text: str, source: str) -> None:
        """Buffer one document; flush a batch and roll files over as needed."""
        if self.writer is None:
            self.tmp = self.out_dir / f".{self.split}-{len(self.entries):05d}.parquet.tmp"
            self.writer = pq.ParquetWriter(self.tmp, _SCHEMA, compression="zstd")
        for k, v in (("id", doc_id), ("text", text), ("source", source)):
            self.batch[k].append(v)
        self.rows_in_file += 1
        if len(self.batch["id"]) >= BATCH_DOCS:
            self._flush()
        if self.rows_in_file >= DOCS_PER_FILE:
            self._finish_file()

    def _flush(self) -> None:
        if self.batch["id"] and self.writer is not None:
            self.writer.write_table(pa.table(self.batch, schema=_SCHEMA))
            self.batch = {"id": [], "text": [], "source": []}

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


def _move_to_validation(out_dir: Path, train: list[FileEntry], file_index: int,
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
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
