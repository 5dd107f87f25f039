"""Input readers of the ingestion stage: one file (any supported format) -> `Record`s.

Each reader turns one input file into `Record`s, streaming (memory holds a chunk of about
1 MiB plus the current record), except where noted. Formats, chosen by file name:

* `.txt`: records end at `\\n`, `\\r\\n` or `\\r` only; U+2028, U+2029, U+0085 and form
  feed never split a record (unlike `str.splitlines`). A document is a run of non-blank
  lines (`txt_document="paragraph"`) or the whole file (`"file"`), its lines joined with
  `\\n`; id `<basename>:<first line number>`.
* `.jsonl`: one JSON object per line, lines ending at `\\n`, `\\r\\n` or `\\r` (a JSON
  string cannot hold a raw line end; blank lines are skipped); id `<basename>:<line
  number>` unless an `id` field is present.
* `.json`: a top-level array of objects, parsed incrementally element by element (memory:
  the largest element, not the file; `mlm_pipeline.ingest.json_array`); id
  `<basename>:<element number, from 1>`. A file that is not an array, or has anything
  but whitespace after its closing `]`, is a `BadFileError` (naming the character
  offset); a syntax error inside the array drops the damaged element(s) as `bad_json`
  records, one per element counted in the damaged span, and parsing resumes at the next
  element (logged with the character offsets).
* `.csv`: a header row, then one record per row (RFC 4180 quoting, quoted fields may span
  lines); id `<basename>:<data row number, from 1>`. A row with more fields than the
  header keeps the header's fields (repair `extra_fields`). A quoted field open at the end
  of the file is a `BadFileError` naming the line where it opens (Python's `csv` would
  otherwise return the rest of the file as that one field).
* `.parquet`: one record per row, read in batches; id `<basename>:<row number, from 1>`.
  Invalid UTF-8 in a string column (writers need not validate it) is replaced by U+FFFD
  and counted (`invalid_utf8`).

JSON objects, CSV rows and Parquet rows take the text from `text_field` and use the
optional `id`, `source` and `lang` fields/columns. A CSV header or Parquet schema without
`text_field`, or a Parquet `text_field` column that is not of a string type, is a
`BadFileError`; a JSON object without it (or with a non-string value), a short CSV row and
a null Parquet value are `missing_text` records.

Compression, UTF-16/32 transcoding and the UTF-8 repairs (`bom`, `invalid_utf8`, `nul`)
are `mlm_pipeline.ingest.sources`'s; a repair is counted once per record. A truncated or
corrupt compressed or Parquet file is a `BadFileError` naming it (`ingest.on_bad_file`
decides whether the run goes on). Every record's text is then screened
(`cleaning.screen`): binary content (a share of U+FFFD and C0 control characters above
`cleaning.BINARY_SHARE`) is dropped as `binary`; a run of C0 separators (vertical tab,
form feed, U+001C-U+001F) becomes one space (repair `control_space`), other C0 control
characters than tab, line feed and carriage return are removed (repair `control`). Drops
and repairs are logged at WARNING once per file and reason, with the count and the first
positions (line, element or row, as in the ids).

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import re
import secrets
import sys
from collections.abc import Generator, Iterable, Iterator
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline.ingest.cleaning import screen
from mlm_pipeline.ingest.json_array import Damage, array_items
from mlm_pipeline.ingest.listing import COMPRESSIONS, SUPPORTED_SUFFIXES
from mlm_pipeline.ingest.sources import (
    DAMAGED_DATA_ERRORS, BadFileError, Source, decode, is_damaged_data, open_raw, open_utf8,
    raw_lines, source_name,
)

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # characters read at a time (JSON arrays)
_SURROGATE = re.compile("[\ud800-\udfff]")
_WARN_FIRST = 5  # positions named per file and reason in the warning, then "..."
_EOL = re.compile(r"\r\n|\r|\n")  # line ends, as a text stream with newline="" splits
# Appended to a CSV stream as one more line: alone it is one row of two fields; inside a
# quoted field left open (the comma quoted) it ends that field. Noncharacters (The Unicode
# Standard 15.0, section 23.7) around 128 random bits drawn per process: real data,
# where noncharacters are allowed (Corrigendum #9), never holds this exact pair.
_CSV_END = ("\ufdd0" + secrets.token_hex(8), secrets.token_hex(8) + "\ufdd1")
_DROPS = ("bad_json", "missing_text", "binary")
_WHY = {"bad_json": "not valid JSON / not an object",
        "missing_text": "field {field!r} missing or not a string",
        "binary": "binary content: too many U+FFFD / control characters",
        "control": "C0 control characters removed",
        "control_space": "C0 separators (vertical tab, form feed, U+001C-U+001F) made spaces",
        "bom": "UTF-8 byte-order mark removed",
        "invalid_utf8": "invalid UTF-8 replaced by U+FFFD",
        "nul": "NUL characters removed",
        "extra_fields": "more fields than the CSV header; the extra fields are ignored"}


class Record(NamedTuple):
    """One record read from an input file.

    Attributes:
        id: document id (from the record's `id` field, else `<basename>:<position>`).
        text: raw text, decoded but not normalized ("" for a bad record).
        source: the record's `source` field, else the file's basename.
        repairs: repair reasons applied to this record (`bom`, `invalid_utf8`, `nul`,
            `extra_fields`, `control`, `control_space`).
        drop: drop reason of a bad record (`bad_json`, `missing_text`, `binary`), else None.
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

    Drops and repairs are logged at WARNING once per reason when the file is done (or
    the caller closes the iterator): the file, the count and the first positions.

    Args:
        path: the file (a local path or an fsspec URL).
        text_field: JSON field / CSV or Parquet column holding the text.
        txt_document: `.txt` documents: `"paragraph"` or `"file"`.

    Yields:
        Every record, bad ones (with `drop` set) included, in file order.

    Raises:
        ValueError: unsupported name (the message starts with the file's path or URL).
        BadFileError: (a `ValueError`, possibly after some records were yielded) a `.json`
            file that is not an array or has data after it; a CSV header or Parquet
            schema without `text_field`; a Parquet `text_field` column of a non-string
            type; a CSV quoted field left open at the end of the file; a truncated or
            corrupt compressed or Parquet file. The message starts with the file's path
            or URL; `reason` is a short code for the manifest.
    """
    name = source_name(path)
    base = name
    for c in COMPRESSIONS:
        base = base.removesuffix(c)
    if base.endswith(".parquet"):
        return _logged(path, "row", text_field, _screened(_parquet(path, text_field)))
    readers = {".txt": ("line", lambda: _lines(path, txt_records, txt_document == "file")),
               ".jsonl": ("line", lambda: _lines(path, jsonl_records, text_field)),
               ".json": ("element", lambda: _json(path, text_field)),
               ".csv": ("data row", lambda: _csv(path, text_field))}
    for suffix, (unit, make) in readers.items():
        if base.endswith(suffix):
            return _logged(path, unit, text_field, _screened(make()))
    raise ValueError(f"{path}: unsupported file type; expected one of "
                     f"{', '.join(SUPPORTED_SUFFIXES)}")


def _logged(path: Source, unit: str, field: str,
            rows: Generator[tuple[int, Record], None, None]) -> Iterator[Record]:
    """The records of `rows` (`(position, record)` pairs); logs every drop and repair
    reason once, with its count and first positions, when the file is done."""
    seen: dict[str, list[int]] = {}  # reason -> [count, first positions...]
    try:
        for where, rec in rows:
            if rec.drop is not None or rec.repairs:
                for reason in (rec.drop, *sorted(rec.repairs)):
                    if reason is not None:
                        tally = seen.setdefault(reason, [0])
                        tally[0] += 1
                        if len(tally) <= _WARN_FIRST:
                            tally.append(where)
            yield rec
    finally:  # also when the caller stops early (max_documents) or an error ends the file
        rows.close()
        for reason, (n, *first) in seen.items():
            action = "dropped as" if reason in _DROPS else "repaired:"
            at = ", ".join(map(str, first)) + (", ..." if n > len(first) else "")
            logger.warning("%s: %d record(s) %s %s (%s), at %s %s", path, n, action, reason,
                           _WHY[reason].format(field=field), unit, at)


def _screened(rows: Generator[tuple[int, Record], None, None]
              ) -> Generator[tuple[int, Record], None, None]:
    """`rows` with every good record's text screened (`cleaning.screen`): binary content
    dropped as `binary`, C0 separators made one space (repair `control_space`), other C0
    control characters removed (repair `control`)."""
    try:
        for where, rec in rows:
            if rec.drop is None and rec.text:
                text, verdict = screen(rec.text)
                if verdict == "binary":
                    rec = rec._replace(text="", drop="binary")
                elif verdict:
                    rec = rec._replace(text=text, repairs=rec.repairs | set(verdict))
            yield where, rec
    finally:
        rows.close()


def _clean(value: str, fixes: set[str]) -> str:
    """Replace lone surrogates (JSON escapes, undecodable CSV bytes) by U+FFFD."""
    if _SURROGATE.search(value):
        fixes.add("invalid_utf8")
        return _SURROGATE.sub("\ufffd", value)
    return value


def _no_nul(text: str, fixes: set[str]) -> str:
    """`text` without NUL characters (a `\\u0000` escape, a NUL byte), counted as `nul`."""
    if "\x00" in text:
        fixes.add("nul")
        return text.replace("\x00", "")
    return text


def _meta(obj, name: str, pos: int) -> tuple[str, str, str | None]:
    """(id, source, lang) of a JSON object / CSV row / Parquet row, with fallbacks."""
    doc_id = obj.get("id")
    doc_id = str(doc_id) if isinstance(doc_id, (str, int)) and doc_id != "" else f"{name}:{pos}"
    source = obj.get("source")
    lang = obj.get("lang")
    dummy: set[str] = set()  # surrogates in metadata are replaced, not counted
    return (_clean(doc_id, dummy), _clean(source, dummy) if isinstance(source, str) and source
            else name, lang if isinstance(lang, str) else None)


def _object_record(obj, field: str, name: str, pos: int, fixes: set[str]) -> Record:
    if not isinstance(obj, dict):
        return Record(f"{name}:{pos}", "", name, fixes, "bad_json")
    if not isinstance(obj.get(field), str):
        return Record(f"{name}:{pos}", "", name, fixes, "missing_text")
    text = _no_nul(_clean(obj[field], fixes), fixes)
    doc_id, source, lang = _meta(obj, name, pos)
    return Record(doc_id, text, source, fixes, None, lang)


# --------------------------------------------------------------------------------- formats
# Each reader yields (position, record): the position (line, element or row, from 1) is
# the one its ids use, for the warnings of `_logged`.
def txt_records(raw: Iterable[bytes], name: str, by_file: bool = False,
                first_line: int = 1) -> Iterator[tuple[int, Record]]:
    """`.txt` records from raw lines (bytes, terminators removed): one per blank-line
    separated paragraph, or one for all lines (`by_file`).

    Args:
        raw: the lines, e.g. `sources.raw_lines` of the file or of a byte range of it.
        name: the source's name (ids are `<name>:<first line of the document>`).
        by_file: one document for all lines instead of one per paragraph.
        first_line: the number of the first line in the whole file (a byte range starts
            later; only line 1 may carry a BOM).

    Yields:
        (first line of the document, its `Record`), in order.
    """
    lines: list[str] = []
    start, repairs = 0, set()
    for lineno, line_bytes in enumerate(raw, first_line):
        line, fixes = decode(line_bytes, lineno == 1)
        if not by_file and not line.strip():
            if lines:
                yield start, Record(f"{name}:{start}", "\n".join(lines), name, repairs)
                lines, repairs = [], set()
            else:
                repairs |= fixes & {"bom"}  # a BOM on a blank line: next document
            continue
        if not lines:
            start = lineno
        lines.append(line)
        repairs |= fixes
    if lines:
        yield start, Record(f"{name}:{start}", "\n".join(lines), name, repairs)


def jsonl_records(raw: Iterable[bytes], name: str, field: str,
                  first_line: int = 1) -> Iterator[tuple[int, Record]]:
    """`.jsonl` records from raw lines (as `txt_records`): one per non-blank line, the text
    in `field` (a line that is not a JSON object holding it gives a record that
    `_screened` drops and counts, as `_object_record` says).

    Yields:
        (line number in the whole file, its `Record`), in order.
    """
    for lineno, line_bytes in enumerate(raw, first_line):
        line, fixes = decode(line_bytes, lineno == 1)
        if not line.strip():
            continue  # a blank line is no record
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            obj = None
        yield lineno, _object_record(obj, field, name, lineno, fixes)


def _lines(path: Source, records, arg) -> Iterator[tuple[int, Record]]:
    """`records(lines, name, arg)` (`txt_records` or `jsonl_records`) of a whole file."""
    with open_utf8(path) as f:
        yield from records(raw_lines(f), source_name(path), arg)


def _reopen_text(path: Source) -> tuple[io.TextIOWrapper, set[str]]:
    """A text stream of a file (undecodable bytes as lone surrogates, for `_clean` to
    count) past a UTF-8 BOM, and the repairs of its first record (`bom` or none). The
    stream is not seekable, so a file without a BOM is opened again."""
    def text() -> io.TextIOWrapper:
        return io.TextIOWrapper(open_utf8(path), encoding="utf-8", errors="surrogateescape",
                                newline="")

    f = text()
    if f.read(1) == "\ufeff":
        return f, {"bom"}
    f.close()
    return text(), set()


def _json(path: Source, field: str) -> Iterator[tuple[int, Record]]:
    name = source_name(path)
    f, pending = _reopen_text(path)
    k = 0
    try:
        for item in array_items(f, path, _CHUNK):
            if isinstance(item, Damage):
                last = item.first + item.elements - 1
                logger.warning("%s: char %d: %s; element(s) %d-%d dropped as bad_json, %s",
                               path, item.at, item.why, item.first, last,
                               "the file ends inside the array" if item.resumed is None
                               else f"parsing resumed at char {item.resumed}")
                for k in range(item.first, last + 1):
                    yield k, Record(f"{name}:{k}", "", name, pending, "bad_json")
                    pending = set()
                continue
            k += 1
            fixes, pending = pending, set()
            yield k, _object_record(item, field, name, k, fixes)
    finally:
        f.close()


def _csv(path: Source, field: str) -> Iterator[tuple[int, Record]]:
    name = source_name(path)
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a document may be one huge field
    f, fixes = _reopen_text(path)
    try:
        rows = csv.reader(itertools.chain(f, [",".join(_CSV_END)]))
        header = next(rows)
        if _csv_ended(path, header, rows.line_num):
            header = None
        if header is None or field not in header:
            raise BadFileError(path, "missing_text_column",
                               f"CSV header {header} has no column {field!r}")
        for k, row in enumerate(rows, 1):
            if not row or (row[-1].endswith(_CSV_END[1])  # cheap test first
                           and _csv_ended(path, row, rows.line_num)):
                continue
            if len(row) > len(header):  # e.g. an unquoted comma in a text
                fixes.add("extra_fields")
            obj = dict(zip(header, row))
            if (text := obj.get(field)) is None:  # a short row
                yield k, Record(f"{name}:{k}", "", name, fixes, "missing_text")
            else:
                doc_id, source, lang = _meta(obj, name, k)
                text = _clean(_no_nul(text, fixes), fixes)
                yield k, Record(doc_id, text, source, fixes, None, lang or None)
            fixes = set()
    finally:
        f.close()


def _csv_ended(path: Source, row: list[str], line_num: int) -> bool:
    """Whether `row` is the end mark appended to a CSV stream.

    Raises:
        BadFileError: the end mark closed a quoted field left open; the message names the
            line where that field opens (counted back from the end by its line ends).
    """
    last, mark = row[-1], ",".join(_CSV_END)
    if not last.endswith(_CSV_END[1]):
        return False
    if row[-2:] == list(_CSV_END):
        return True
    if not last.endswith(mark):
        return False
    value = last[:-len(mark)]
    # The mark is line `line_num`, the file's last line the one before; the value spans
    # from its opening line to there, with one line end per line, except the last line's
    # when the file has none.
    opened = line_num - len(_EOL.findall(value)) - (not value.endswith(("\n", "\r")))
    raise BadFileError(path, "unclosed_csv_quote", f"line {opened}: quoted field opened here "
                       "is never closed (no closing '\"' before the end of the file)")


def _parquet(path: Source, field: str) -> Iterator[tuple[int, Record]]:
    with open_raw(path) as raw:
        try:
            yield from _parquet_rows(path, pq.ParquetFile(raw), source_name(path), field)
        except DAMAGED_DATA_ERRORS as e:
            if not is_damaged_data(e):
                raise
            raise BadFileError(path, "corrupt_parquet",
                               f"truncated or corrupt Parquet file: {e}") from e


def _parquet_rows(path: Source, pf: pq.ParquetFile, name: str,
                  field: str) -> Iterator[tuple[int, Record]]:
    names = pf.schema_arrow.names
    if field not in names:
        raise BadFileError(path, "missing_text_column",
                           f"Parquet columns {names} have no column {field!r}")
    kind = pf.schema_arrow.field(field).type
    value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)
            or pa.types.is_string_view(value_kind)):
        # A whole column of the wrong type would drop every row as missing_text: a
        # wrong text_field or a wrong file, better stopped than counted.
        raise BadFileError(path, "text_column_type", f"Parquet column {field!r} has type "
                           f"{kind}, not a string type; set text_field to a string column")
    cols = [field] + [c for c in ("id", "source", "lang") if c in names and c != field]
    k = 0
    for batch in pf.iter_batches(batch_size=1024, columns=cols):
        data, invalid = {}, set()
        for c in cols:
            data[c], bad_rows = _column_values(batch.column(c))
            invalid |= bad_rows
        for i in range(batch.num_rows):
            k += 1
            obj = {c: data[c][i] for c in cols}
            text = obj[field]
            fixes: set[str] = {"invalid_utf8"} if i in invalid else set()
            if not isinstance(text, str):  # null
                yield k, Record(f"{name}:{k}", "", name, fixes, "missing_text")
                continue
            doc_id, source, lang = _meta(obj, name, k)
            yield k, Record(doc_id, _no_nul(text, fixes), source, fixes, None, lang)


def _column_values(column: pa.Array) -> tuple[list, set[int]]:
    """A column's values as Python objects, and the rows whose strings held invalid UTF-8
    (Parquet writers need not validate it), decoded with U+FFFD in its place."""
    try:
        return column.to_pylist(), set()
    except UnicodeDecodeError:
        pass
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    values, invalid = [], set()
    for i, raw in enumerate(column.cast(pa.large_binary()).to_pylist()):
        try:
            values.append(None if raw is None else raw.decode("utf-8"))
        except UnicodeDecodeError:
            values.append(raw.decode("utf-8", "replace"))
            invalid.add(i)
    return values, invalid
