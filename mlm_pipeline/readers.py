"""Input readers of the ingestion stage: one file (any supported format) -> `Record`s.

Each reader turns one input file into `Record`s, streaming (memory holds a chunk of about
1 MiB plus the current record), except where noted. Formats, chosen by file name:

* `.txt`: records end at `\\n`, `\\r\\n` or `\\r` only; U+2028, U+2029, U+0085 and form
  feed never split a record (unlike `str.splitlines`). A document is a run of non-blank
  lines (`txt_document="paragraph"`) or the whole file (`"file"`), its lines joined with
  `\\n`; id `<basename>:<first line number>`.
* `.jsonl`: one JSON object per `\\n`-terminated line (a trailing `\\r` is tolerated,
  blank lines are skipped); id `<basename>:<line number>` unless an `id` field is present.
* `.json`: a top-level array of objects, parsed incrementally element by element (memory:
  the largest element, not the file); id `<basename>:<element number, from 1>`. A file
  that is not an array is a `ValueError`; a syntax error inside the array drops the rest
  of the file as one `bad_json` record.
* `.csv`: a header row, then one record per row (RFC 4180 quoting, quoted fields may span
  lines); id `<basename>:<data row number, from 1>`.
* `.parquet`: one record per row, read in batches; id `<basename>:<row number, from 1>`.

JSON objects, CSV rows and Parquet rows take the text from `text_field` and use the
optional `id`, `source` and `lang` fields/columns. A CSV header or Parquet schema without
`text_field` is a `ValueError`; a JSON object without it is a `missing_text` record.

Compression, UTF-16/32 transcoding and the UTF-8 repairs (`bom`, `invalid_utf8`, `nul`)
are `mlm_pipeline.sources`'s; a repair is counted once per record.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import NamedTuple

import pyarrow.parquet as pq

from mlm_pipeline.sources import (
    COMPRESSIONS,
    SUPPORTED_SUFFIXES,
    Source,
    decode,
    open_raw,
    open_utf8,
    raw_lines,
    source_name,
)

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # characters read at a time (JSON arrays)
_SURROGATE = re.compile("[\ud800-\udfff]")
_WARN_FIRST = 5  # bad records named individually per reason and file, then only counted


class Record(NamedTuple):
    """One record read from an input file.

    Attributes:
        id: document id (from the record's `id` field, else `<basename>:<position>`).
        text: raw text, decoded but not normalized ("" for a bad record).
        source: the record's `source` field, else the file's basename.
        repairs: repair reasons applied to this record (`bom`, `invalid_utf8`, `nul`).
        drop: drop reason of a bad record (`bad_json`, `missing_text`), else None.
        lang: the record's `lang` field, None when absent.
    """

    id: str
    text: str
    source: str
    repairs: set[str]
    drop: str | None = None
    lang: str | None = None


def read_records(path: Source, text_field: str, txt_document: str) -> Iterator[Record]:
    """Stream the records of one input file (format chosen by its name).

    Args:
        path: the file (a local path or an fsspec URL).
        text_field: JSON field / CSV or Parquet column holding the text.
        txt_document: `.txt` documents: `"paragraph"` or `"file"`.

    Yields:
        Every record, bad ones (with `drop` set) included, in file order.

    Raises:
        ValueError: unsupported name; a `.json` file that is not an array; a CSV header
            or Parquet schema without `text_field` (the file is named).
    """
    name = source_name(path)
    base = name
    for c in COMPRESSIONS:
        base = base.removesuffix(c)
    if base.endswith(".parquet"):
        return _parquet(path, text_field)
    readers = {".txt": lambda: _txt(path, txt_document == "file"),
               ".jsonl": lambda: _jsonl(path, text_field), ".json": lambda: _json(path, text_field),
               ".csv": lambda: _csv(path, text_field)}
    for suffix, make in readers.items():
        if base.endswith(suffix):
            return make()
    raise ValueError(f"{path}: unsupported file type; expected one of "
                     f"{', '.join(SUPPORTED_SUFFIXES)}")


def _clean(value: str, fixes: set[str]) -> str:
    """Replace lone surrogates (JSON escapes, undecodable CSV bytes) by U+FFFD."""
    if _SURROGATE.search(value):
        fixes.add("invalid_utf8")
        return _SURROGATE.sub("\ufffd", value)
    return value


def _meta(obj, name: str, pos: int) -> tuple[str, str, str | None]:
    """(id, source, lang) of a JSON object / CSV row / Parquet row, with fallbacks."""
    doc_id = obj.get("id")
    doc_id = str(doc_id) if isinstance(doc_id, (str, int)) and doc_id != "" else f"{name}:{pos}"
    source = obj.get("source")
    lang = obj.get("lang")
    dummy: set[str] = set()  # surrogates in metadata are replaced, not counted
    return (_clean(doc_id, dummy), _clean(source, dummy) if isinstance(source, str) and source
            else name, lang if isinstance(lang, str) else None)


class _BadCounter:
    """Counts bad records of one file; names the first few, summarizes at the end."""

    def __init__(self, path: Source, field: str) -> None:
        self.path, self.field, self.n = path, field, {"bad_json": 0, "missing_text": 0}

    def __call__(self, reason: str, where: int) -> None:
        self.n[reason] += 1
        if self.n[reason] <= _WARN_FIRST:
            what = ("not valid JSON / not an object" if reason == "bad_json"
                    else f"field {self.field!r} missing or not a string")
            logger.warning("%s:%d: %s; dropped", self.path, where, what)

    def summary(self) -> None:
        """Log one warning per drop reason with the file's total (after the first few)."""
        for reason, n in self.n.items():
            if n:
                logger.warning("%s: %d records dropped as %s", self.path, n, reason)


def _object_record(obj, field: str, name: str, pos: int, fixes: set[str],
                   bad: _BadCounter) -> Record:
    if not isinstance(obj, dict):
        bad("bad_json", pos)
        return Record(f"{name}:{pos}", "", name, fixes, "bad_json")
    if not isinstance(obj.get(field), str):
        bad("missing_text", pos)
        return Record(f"{name}:{pos}", "", name, fixes, "missing_text")
    text = _clean(obj[field], fixes)
    doc_id, source, lang = _meta(obj, name, pos)
    return Record(doc_id, text, source, fixes, None, lang)


# --------------------------------------------------------------------------------- formats
def _txt(path: Source, by_file: bool) -> Iterator[Record]:
    name = source_name(path)
    lines: list[str] = []
    start, repairs = 0, set()
    with open_utf8(path) as f:
        for lineno, raw in enumerate(raw_lines(f), 1):
            line, fixes = decode(raw, lineno == 1)
            if not by_file and not line.strip():
                if lines:
                    yield Record(f"{name}:{start}", "\n".join(lines), name, repairs)
                    lines, repairs = [], set()
                else:
                    repairs |= fixes & {"bom"}  # a BOM on a blank line: next document
                continue
            if not lines:
                start = lineno
            lines.append(line)
            repairs |= fixes
    if lines:
        yield Record(f"{name}:{start}", "\n".join(lines), name, repairs)


def _jsonl(path: Source, field: str) -> Iterator[Record]:
    name, bad = source_name(path), _BadCounter(path, field)
    try:
        with open_utf8(path) as f:
            for lineno, raw in enumerate(raw_lines(f, eol=re.compile(rb"\n")), 1):
                line, fixes = decode(raw.removesuffix(b"\r"), lineno == 1)
                if not line.strip():
                    continue  # a blank line is no record
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                yield _object_record(obj, field, name, lineno, fixes, bad)
    finally:  # also when the caller stops early (max_documents)
        bad.summary()


def _reopen_text(path: Source) -> tuple[io.TextIOWrapper, set[str]]:
    """A text stream of a file (undecodable bytes as lone surrogates, for `_clean` to
    count) past a UTF-8 BOM, and the repairs of its first record (`bom` or none). The
    stream is not seekable, so a file without a BOM is opened again."""
    f = io.TextIOWrapper(open_utf8(path), encoding="utf-8", errors="surrogateescape",
                         newline="")
    head = f.read(1)
    if head == "\ufeff":
        return f, {"bom"}
    f.close()
    return io.TextIOWrapper(open_utf8(path), encoding="utf-8", errors="surrogateescape",
                            newline=""), set()


def _json(path: Source, field: str) -> Iterator[Record]:
    name, bad = source_name(path), _BadCounter(path, field)
    dec = json.JSONDecoder()
    f, pending = _reopen_text(path)
    buf, pos, eof, k = "", 0, False, 0
    want = _CHUNK

    def fill() -> bool:  # append more text; False at end of file
        nonlocal buf, pos, eof
        chunk = f.read(want)
        buf, pos = buf[pos:] + chunk, 0
        eof = not chunk
        return bool(chunk)

    def skip_ws() -> str:  # next non-space character ("" at end of file)
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not fill():
                return buf[pos:pos + 1]

    try:
        if skip_ws() != "[":
            raise ValueError(f"{path}: a .json input must be a top-level array of objects")
        pos += 1
        if skip_ws() == "]":
            return
        while True:
            try:
                obj, end = dec.raw_decode(buf, pos)
                ok = True
            except ValueError:
                ok = False
            # Failing, or ending exactly at the buffer's end (a number cut by the chunk),
            # may be an element cut by the chunk end: read more and parse it again
            # (a malformed element is known only at the end of the file). Reading twice
            # as much per retry keeps the parsing of a large element linear.
            if not (ok and end < len(buf)) and not eof:
                fill()
                want *= 2
                continue
            if not ok:
                bad("bad_json", k + 1)
                yield Record(f"{name}:{k + 1}", "", name, pending, "bad_json")
                return
            pos, want, k = end, _CHUNK, k + 1
            fixes, pending = pending, set()
            yield _object_record(obj, field, name, k, fixes, bad)
            sep = skip_ws()
            if sep == "]":
                return
            if sep != ",":
                bad("bad_json", k + 1)
                yield Record(f"{name}:{k + 1}", "", name, set(), "bad_json")
                return
            pos += 1
            skip_ws()  # raw_decode does not skip leading whitespace
    finally:
        f.close()
        bad.summary()


def _csv(path: Source, field: str) -> Iterator[Record]:
    name = source_name(path)
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a document may be one huge field
    f, fixes = _reopen_text(path)
    try:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or field not in header:
            raise ValueError(f"{path}: CSV header {header} has no column {field!r}")
        for k, row in enumerate(rows, 1):
            if not row:
                continue
            obj = dict(zip(header, row))
            text = obj.get(field)
            if "\x00" in (text or ""):
                text = text.replace("\x00", "")
                fixes.add("nul")
            if text is None:  # a short row
                yield Record(f"{name}:{k}", "", name, fixes, "missing_text")
            else:
                doc_id, source, lang = _meta(obj, name, k)
                yield Record(doc_id, _clean(text, fixes), source, fixes, None, lang or None)
            fixes = set()
    finally:
        f.close()


def _parquet(path: Source, field: str) -> Iterator[Record]:
    name = source_name(path)
    with open_raw(path) as raw:
        yield from _parquet_rows(path, pq.ParquetFile(raw), name, field)


def _parquet_rows(path: Source, pf: pq.ParquetFile, name: str, field: str) -> Iterator[Record]:
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: Parquet columns {names} have no column {field!r}")
    cols = [field] + [c for c in ("id", "source", "lang") if c in names and c != field]
    k = 0
    for batch in pf.iter_batches(batch_size=1024, columns=cols):
        data = {c: batch.column(c).to_pylist() for c in cols}
        for i in range(batch.num_rows):
            k += 1
            obj = {c: data[c][i] for c in cols}
            text = obj[field]
            if not isinstance(text, str):
                yield Record(f"{name}:{k}", "", name, set(), "missing_text")
                continue
            fixes: set[str] = set()
            if "\x00" in text:
                text = text.replace("\x00", "")
                fixes.add("nul")
            doc_id, source, lang = _meta(obj, name, k)
            yield Record(doc_id, text, source, fixes, None, lang)
