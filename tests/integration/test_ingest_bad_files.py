"""Ingest on damaged or malformed input files: a clear error that names the file (and the
line, offset or column) under `on_bad_file: fail`, the file named in the manifest under
`skip`, or every drop and repair logged once per file and reason.

Fixtures are written here with independent writers (gzip, bz2, lzma, zstandard, pyarrow,
json); expected offsets and lines come from the standard library or from the text built.
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import readers
from mlm_pipeline.ingest.sources import BadFileError
from mlm_pipeline.ingest.stage import ingest

zstandard = pytest.importorskip("zstandard")

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}
CODEC = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


def run(tmp_path: Path, *files: Path, **kw):
    kw.setdefault("validation_fraction", 0.0)
    return ingest(IngestConfig(sources=[str(f) for f in files], **kw), tmp_path / "work")


def jsonl_docs(n: int) -> bytes:
    rng = random.Random(0)  # varied text, so the compressed stream is long
    return "".join(json.dumps({"text": f"doc {i} {rng.random()}"}) + "\n"
                   for i in range(n)).encode()


def raises_naming(path: Path, what: str):
    """pytest.raises for the ValueError of `on_bad_file: fail`, one line of whose message
    starts with the file's path and `what`."""
    return pytest.raises(ValueError, match="(?m)^" + re.escape(f"{path.resolve()}: {what}"))


def fail(tmp_path: Path, *files: Path, **kw):
    return run(tmp_path, *files, on_bad_file="fail", **kw)


# ------------------------------------------------------------------ A: damaged files
@pytest.mark.parametrize("comp", list(COMPRESS))
def test_truncated_compressed_file_is_named(tmp_path, comp):
    full = COMPRESS[comp](jsonl_docs(20_000))
    f = tmp_path / f"cut.jsonl{comp}"
    f.write_bytes(full[:len(full) // 2])
    with raises_naming(f, f"truncated or corrupt {CODEC[comp]} stream: ") as err:
        fail(tmp_path, f)
    bad = err.value.__cause__  # the file's error, raised from the decompressor's
    assert isinstance(bad, BadFileError) and bad.reason == "corrupt_compressed"
    assert bad.__cause__ is not None and str(bad).endswith(str(bad.__cause__))


@pytest.mark.parametrize("comp", list(COMPRESS))
def test_not_compressed_file_is_named(tmp_path, comp):
    f = tmp_path / f"plain.jsonl{comp}"
    f.write_bytes(jsonl_docs(100))  # not compressed at all
    with raises_naming(f, f"truncated or corrupt {CODEC[comp]} stream: "):
        fail(tmp_path, f)


def test_truncated_or_empty_parquet_is_named(tmp_path):
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(5000)]}), tmp_path / "p.parquet")
    data = (tmp_path / "p.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    (tmp_path / "empty.parquet").write_bytes(b"")
    for name in ("cut.parquet", "empty.parquet"):
        with raises_naming(tmp_path / name, "truncated or corrupt Parquet file: ") as err:
            fail(tmp_path, tmp_path / name)
        assert isinstance(err.value.__cause__.__cause__, pa.ArrowException)


@pytest.mark.parametrize("kind", [pa.int64(), pa.binary(), pa.null()])
def test_parquet_text_column_of_wrong_type_is_an_error(tmp_path, kind):
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": pa.array([None] * 3 if kind == pa.null() else
                                              [1, 2, 3] if kind == pa.int64()
                                              else [b"a", b"b", b"c"], kind)}), f)
    with raises_naming(f, f"Parquet column 'text' has type {kind}, not a string type"):
        fail(tmp_path, f)


def test_parquet_large_and_dictionary_strings_are_read(tmp_path):
    texts = ["un texte", "deux textes", "un texte"]
    pq.write_table(pa.table({"text": pa.array(texts, pa.large_string())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), tmp_path / "b.parquet")
    assert pq.read_schema(tmp_path / "b.parquet").field("text").type.value_type == pa.string()
    m = run(tmp_path, tmp_path / "a.parquet", tmp_path / "b.parquet")
    assert m.documents_read == 6 and m.documents_kept == 2  # 4 exact duplicates


# ------------------------------------------------------------------ B: drops and repairs are logged
def warnings_for(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"{path.resolve()}:")]


def test_every_drop_and_repair_is_logged_once_per_file_and_reason(tmp_path, caplog):
    lines = [json.dumps({"text": f"good document {i}"}) for i in range(20)]
    bad_at = [2, 5, 6, 9, 12, 15, 18]  # 1-based line numbers of bad JSON
    for n in bad_at:
        lines[n - 1] = "{not json"
    lines[0] = "\ufeff" + lines[0]  # a BOM: one bom repair at line 1
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cs = tmp_path / "b.csv"
    cs.write_text("id,text\n1,first row of text\n2\n3,third row\n4\n", encoding="utf-8")
    tx = tmp_path / "c.txt"
    tx.write_bytes(b"caf\xe9 latin-1\n\nclean paragraph\n\nna\xefve again\n")
    pa_f = tmp_path / "d.parquet"
    texts = [f"row {i}" if i not in (3, 7) else None for i in range(1, 11)]
    pq.write_table(pa.table({"text": texts}), pa_f)
    js = tmp_path / "e.json"
    js.write_text(json.dumps([{"text": "nul\u0000 here"}, {"text": 5}, {"text": "fine"}]))
    with caplog.at_level(logging.WARNING):
        m = run(tmp_path, jl, cs, tx, pa_f, js)
    want = {  # per file: (reason, count, first positions), derived from the inputs above
        jl: [("bad_json", 7, "line 2, 5, 6, 9, 12, ..."), ("bom", 1, "line 1")],
        cs: [("missing_text", 2, "data row 2, 4")],
        tx: [("invalid_utf8", 2, "line 1, 5")],
        pa_f: [("missing_text", 2, "row 3, 7")],
        js: [("missing_text", 1, "element 2"), ("nul", 1, "element 1")],
    }
    for path, reasons in want.items():
        got = warnings_for(caplog, path)
        assert len(got) == len(reasons), got  # once per reason, not per record
        for reason, n, at in reasons:
            [msg] = [g for g in got if f" {reason} " in g]
            assert f": {n} record(s) " in msg and msg.endswith(f", at {at}"), msg
    assert m.dropped["bad_json"] == 7 and m.dropped["missing_text"] == 5
    assert {k: v for k, v in m.repaired.items() if v} == {"bom": 1, "invalid_utf8": 2, "nul": 1}


def test_csv_row_with_extra_fields_is_counted_and_logged(tmp_path, caplog):
    f = tmp_path / "x.csv"
    f.write_text('id,text\n1,hello, world\n2,"quoted, fine"\n3,a,b,c\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        m = run(tmp_path, f)
    [msg] = warnings_for(caplog, f)
    assert ": 2 record(s) repaired: extra_fields " in msg and msg.endswith("data row 1, 3")
    assert m.repaired["extra_fields"] == 2 and m.documents_kept == 3


# ------------------------------------------------------------------ C: unterminated CSV quote
@pytest.mark.parametrize("data", [
    'text\n"unterminated\nrow two\nrow three\n',
    'id,text\n1,ok\n2,"fine\nstill fine"\n3,"open\nmore\nlines',
    'id,text\r\n1,ok\r\n2,"open\r\nnext\r\n',
    'id,text\n1,ok\n2,"a ""quoted"" word, then no end',
    '"text\nrow\n',
])
def test_csv_unterminated_quote_names_its_line(tmp_path, data):
    f = tmp_path / "q.csv"
    f.write_bytes(data.encode())
    # The line of the last quote that opens a field (after a comma or at a line start).
    start = max(data.rfind(',"'), data.rfind('\n"')) + 1
    line = len(re.findall(r"\r\n|\r|\n", data[:start])) + 1 if start else 1
    with raises_naming(f, f"line {line}: quoted field opened here is never closed"):
        fail(tmp_path, f)


def test_csv_closed_quote_at_end_of_file_is_read(tmp_path):
    f = tmp_path / "ok.csv"
    f.write_bytes(b'text\nplain\n"two\nlines, and ""quotes"""')  # no final line end
    m = run(tmp_path, f)
    assert m.documents_kept == 2 and m.documents_read == 2


# ------------------------------------------------------------------ D, E: JSON arrays
@pytest.mark.parametrize("text", [
    '[{"text":"first array"}]\n[{"text":"second array"}]\n',
    '[ ] x',
    '[{"text":"a"}] {"text":"b"}',
])
def test_json_data_after_the_array_is_an_error(tmp_path, text):
    f = tmp_path / "two.json"
    f.write_text(text)
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(text)
    assert ref.value.msg == "Extra data"
    with raises_naming(f, f"char {ref.value.pos}: extra data after the closing ']'"):
        fail(tmp_path, f)


def test_json_number_cut_by_the_read_size_keeps_the_rest(tmp_path):
    # A top-level 0.5 whose "0." ends the first read (readers._CHUNK characters).
    chunk = readers._CHUNK
    head, n = "[", 0
    while len(head) + 1100 < chunk - 2:
        head += json.dumps({"text": f"before {n} " + "x" * 1000}) + ", "
        n += 1
    head += " " * (chunk - 2 - len(head))
    after = [{"text": f"document after the number, {i}"} for i in range(1000)]
    text = head + "0.5, " + ", ".join(json.dumps(d) for d in after) + "]"
    assert text.index("0.5") == chunk - 2 and len(json.loads(text)) == n + 1 + 1000
    f = tmp_path / "f.json"
    f.write_text(text)
    m = run(tmp_path, f)
    assert m.documents_read == n + 1 + 1000
    assert m.dropped["bad_json"] == 1  # the 0.5: not an object
    assert m.documents_kept == n + 1000
