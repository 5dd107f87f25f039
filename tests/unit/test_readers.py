"""Unit tests of `mlm_pipeline.ingest.readers` (formats, compression, decoding) through `ingest`,
on fixtures written in tmp_path with independent writers (json, csv, pyarrow, zstandard,
bz2, lzma, gzip)."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import readers, sources
from mlm_pipeline.ingest.readers import read_records
from mlm_pipeline.ingest.stage import ingest

zstandard = pytest.importorskip("zstandard")

DOCS = [
    {"id": "d1", "text": "Premier document, accentué.", "lang": "fr"},
    {"id": "d2", "text": "Deuxième texte\nsur deux lignes, avec \"guillemets\", virgule.",
     "lang": "fr"},
    {"id": "d3", "text": "Third one\r\nwith CRLF inside\n\nand a blank line.", "lang": "en"},
]
COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            # two frames: a reader must not stop after the first
            ".zst": lambda b: (zstandard.ZstdCompressor().compress(b[:10])
                               + zstandard.ZstdCompressor().compress(b[10:]))}


def records(m) -> list[tuple[str, str, str]]:
    out = []
    for e in m.train + m.validation:
        t = pq.read_table(m.file(e.path))
        out += zip(*(t.column(c).to_pylist() for c in ("id", "text", "source")))
    return out


def run(tmp_path: Path, sources, **kw):
    kw.setdefault("validation_fraction", 0.0)
    return ingest(IngestConfig(sources=[str(s) for s in sources], **kw), tmp_path / "work")


def csv_bytes(rows: list[dict], fields=("id", "text", "lang")) -> bytes:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue().encode("utf-8")


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def json_bytes(rows: list[dict]) -> bytes:
    return json.dumps(rows, ensure_ascii=False, indent=1).encode("utf-8")


def txt_bytes(rows: list[dict]) -> bytes:  # one document per file, txt_document="file"
    return rows[0]["text"].encode("utf-8")


WRITERS = {".csv": csv_bytes, ".jsonl": jsonl_bytes, ".json": json_bytes}


@pytest.mark.parametrize("comp", list(COMPRESS))
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_formats_and_compressions(tmp_path, fmt, comp):
    f = tmp_path / f"c{fmt}{comp}"
    f.write_bytes(COMPRESS[comp](WRITERS[fmt](DOCS)))
    m = run(tmp_path, [f])
    want = [(d["id"], d["text"].strip(), f.name) for d in DOCS]
    assert records(m) == want
    assert m.documents_read == 3 and sum(m.repaired.values()) == 0


@pytest.mark.parametrize("comp", list(COMPRESS))
def test_txt_compressions(tmp_path, comp):
    f = tmp_path / f"a.txt{comp}"
    f.write_bytes(COMPRESS[comp](b"un\r\n\r\ndeux\nlignes\n"))
    assert [t for _, t, _ in records(run(tmp_path, [f]))] == ["un", "deux\nlignes"]


def test_parquet_reads_rows(tmp_path):
    n = 2500
    texts = [f"texte numéro {i}" for i in range(n)]
    texts[7] = None
    pq.write_table(pa.table({"text": texts, "id": [f"p{i}" for i in range(n)],
                             "extra": list(range(n))}), tmp_path / "p.parquet",
                   row_group_size=300)
    pq.write_table(pa.table({"body": ["b"], "source": ["s"]}), tmp_path / "q.parquet")
    m = run(tmp_path, [tmp_path / "p.parquet"])
    got = records(m)
    assert got == [(f"p{i}", t, "p.parquet") for i, t in enumerate(texts) if t is not None]
    assert m.dropped["missing_text"] == 1 and m.documents_read == n
    m = run(tmp_path / "b", [tmp_path / "q.parquet"], text_field="body")
    assert records(m) == [("q.parquet:1", "b", "s")]
    with pytest.raises(ValueError, match=r"q\.parquet.*'text'"):
        run(tmp_path / "c", [tmp_path / "q.parquet"], on_bad_file="fail")


def test_json_incremental_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_CHUNK", 3)  # every element cut across chunks
    rows = [{"text": "a" * 50, "n": 123456789}, [1, 2], {"title": "x"}, {"text": "fin", "id": 7},
            {"text": 1.5e300}]
    f = tmp_path / "a.json"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    recs = list(read_records(f, "text", "paragraph"))
    assert [(r.id, r.text, r.drop) for r in recs] == [
        ("a.json:1", "a" * 50, None), ("a.json:2", "", "bad_json"),
        ("a.json:3", "", "missing_text"), ("7", "fin", None), ("a.json:5", "", "missing_text")]
    assert recs[0].repairs == {"bom"}
    (tmp_path / "b.json").write_text('[{"text": "ok"}, {"text": "cut')
    recs = list(read_records(tmp_path / "b.json", "text", "paragraph"))
    assert [(r.text, r.drop) for r in recs] == [("ok", None), ("", "bad_json")]
    (tmp_path / "c.json").write_text('{"text": "not an array"}')
    with pytest.raises(ValueError, match=r"c\.json.*array"):
        list(read_records(tmp_path / "c.json", "text", "paragraph"))
    (tmp_path / "d.json").write_text(" [ ] ")
    assert list(read_records(tmp_path / "d.json", "text", "paragraph")) == []


NUMBERS = ('[0.5, 12345, -0.25e-3, 1E+10, {"text": "a"}, true, null, "s", 7, {"text": "b"},'
           ' 3.0E-2, -0, 123456789012345678901234567890, {"text": "c"}]')


@pytest.mark.parametrize("chunk", range(1, 12))
def test_json_top_level_numbers_cut_by_any_chunk(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(readers, "_CHUNK", chunk)  # numbers cut at every position
    (tmp_path / "n.json").write_text(NUMBERS)
    want = [(f"n.json:{k}", d["text"], None) if isinstance(d, dict) else
            (f"n.json:{k}", "", "bad_json") for k, d in enumerate(json.loads(NUMBERS), 1)]
    recs = list(read_records(tmp_path / "n.json", "text", "paragraph"))
    assert [(r.id, r.text, r.drop) for r in recs] == want


@pytest.mark.parametrize("chunk", [1, 4, None])  # None: the module's read size
def test_json_errors_give_the_character_offset(tmp_path, monkeypatch, caplog, chunk):
    if chunk is not None:
        monkeypatch.setattr(readers, "_CHUNK", chunk)
    syntax = '[{"text": "ok"},\n {"text" "no colon"}, {"text": "lost"}]'
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(syntax)
    (tmp_path / "s.json").write_text(syntax)
    with caplog.at_level("WARNING", logger="mlm_pipeline.ingest.readers"):
        recs = list(read_records(tmp_path / "s.json", "text", "paragraph"))
    # Only the damaged element is lost; parsing resumes at the next one.
    assert [(r.text, r.drop) for r in recs] == [("ok", None), ("", "bad_json"), ("lost", None)]
    assert f"s.json: char {ref.value.pos}: {ref.value.msg};" in caplog.text
    assert f"parsing resumed at char {syntax.index('{', ref.value.pos)}" in caplog.text
    extra = '[{"text": "a"}]  \n\n   {"text": "b"}'
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(extra)
    (tmp_path / "x.json").write_text(extra)
    with pytest.raises(ValueError, match=rf"x\.json: char {ref.value.pos}: extra data"):
        list(read_records(tmp_path / "x.json", "text", "paragraph"))


def test_json_syntax_error_does_not_read_the_rest_into_memory(tmp_path):
    import tracemalloc

    tail = ", ".join([json.dumps({"text": "x" * 1000})] * 20_000)  # about 20 MB after it
    (tmp_path / "big.json").write_text('[{"text": "ok"}, {"text": oops}, ' + tail + "]")
    tracemalloc.start()
    try:
        n = bad = 0
        for r in read_records(tmp_path / "big.json", "text", "paragraph"):
            n, bad = n + 1, bad + (r.drop == "bad_json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (n, bad) == (1 + 1 + 20_000, 1)  # the element after the error resynchronises
    assert peak < 8 * 2**20  # a few 1 MiB chunks, not the 20 MB after the error


def test_parquet_invalid_utf8_is_replaced_and_counted(tmp_path):
    import numpy as np

    values = [b"ok", b"caf\xe9 latin-1", None, b"fine"]  # a Parquet string with bad bytes
    ends = np.cumsum([0] + [len(v or b"") for v in values], dtype=np.int32)
    texts = pa.Array.from_buffers(
        pa.string(), len(values),
        [pa.array([v is not None for v in values]).buffers()[1],
         pa.py_buffer(ends.tobytes()), pa.py_buffer(b"".join(v or b"" for v in values))])
    pq.write_table(pa.table({"text": texts, "id": ["a", "b", "c", "d"]}), tmp_path / "u.parquet")
    recs = list(read_records(tmp_path / "u.parquet", "text", "paragraph"))
    assert [(r.id, r.text, r.drop, r.repairs) for r in recs] == [
        ("a", "ok", None, set()), ("b", "caf\ufffd latin-1", None, {"invalid_utf8"}),
        ("u.parquet:3", "", "missing_text", set()), ("d", "fine", None, set())]


def test_csv_noncharacters_in_real_data_are_text(tmp_path):
    data = 'text,a,b\nreal row,\ufdd0,\ufdd1\n"quoted ends,\ufdd0,\ufdd1",x,y\nlast,1,2\n'
    (tmp_path / "n.csv").write_text(data, encoding="utf-8")
    recs = list(read_records(tmp_path / "n.csv", "text", "paragraph"))
    assert [r.text for r in recs] == ["real row", "quoted ends,\ufdd0,\ufdd1", "last"]
    assert [r.drop for r in recs] == [None, None, None]


def test_csv_multiline_bom_invalid_bytes_and_missing_column(tmp_path):
    data = b"\xef\xbb\xbf" + csv_bytes(DOCS).replace(b"Premier", b"Pr\xffmier")
    (tmp_path / "a.csv").write_bytes(data)
    recs = list(read_records(tmp_path / "a.csv", "text", "paragraph"))
    assert [r.text for r in recs] == ["Pr\ufffdmier document, accentué."] + [
        d["text"] for d in DOCS[1:]]
    assert [r.repairs for r in recs] == [{"bom", "invalid_utf8"}, set(), set()]
    assert [r.lang for r in recs] == ["fr", "fr", "en"]
    (tmp_path / "b.csv").write_bytes(csv_bytes(DOCS, fields=("id", "body")))
    with pytest.raises(ValueError, match=r"b\.csv.*'text'"):
        list(read_records(tmp_path / "b.csv", "text", "paragraph"))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-le"])
def test_utf16_utf32_with_bom(tmp_path, encoding, monkeypatch):
    monkeypatch.setattr(sources, "_CHUNK", 5)  # odd: code units cut across chunks
    bom = {"utf-16-be": b"\xfe\xff", "utf-32-le": b"\xff\xfe\x00\x00"}.get(encoding, b"")
    texts = ["Été à Paris 🌍", "deux\nlignes"]
    (tmp_path / "a.txt").write_bytes(bom + "\n\n".join(texts).encode(encoding))
    (tmp_path / "b.jsonl").write_bytes(
        bom + "".join(json.dumps({"text": t + "!"}, ensure_ascii=False) + "\n"
                      for t in texts).encode(encoding))
    (tmp_path / "c.csv").write_bytes(bom + csv_bytes([{"id": "x", "text": "virgule, ici"}])
                                     .decode().encode(encoding))
    m = run(tmp_path, [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.csv"])
    assert [t for _, t, _ in records(m)] == texts + [t + "!" for t in texts] + ["virgule, ici"]
    assert sum(m.repaired.values()) == 0


def test_invalid_utf16_is_counted(tmp_path):
    data = "ok\n\n".encode("utf-16-le") + b"\x00\xd8" + "x".encode("utf-16-le")  # lone high
    (tmp_path / "a.txt").write_bytes(b"\xff\xfe" + data + b"\x41")  # + a truncated unit
    recs = list(read_records(tmp_path / "a.txt", "text", "paragraph"))
    assert [r.text for r in recs] == ["ok", "\ufffd" * 3 + "x\ufffd"]
    assert [r.repairs for r in recs] == [set(), {"invalid_utf8"}]


def test_directory_picks_every_supported_suffix(tmp_path, caplog):
    d = tmp_path / "in"
    d.mkdir()
    names = ["a.txt", "b.jsonl.zst", "c.json.bz2", "d.csv.xz", "e.parquet", "f.txt.gz"]
    for i, name in enumerate(names):
        text = f"document {i}"
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"text": [text]}), d / name)
            continue
        fmt = next(s for s in (".txt", ".jsonl", ".json", ".csv") if s + "." in name + ".")
        raw = text.encode() if fmt == ".txt" else WRITERS[fmt]([{"id": str(i), "text": text}])
        comp = name[name.index(fmt) + len(fmt):]
        (d / name).write_bytes(COMPRESS[comp](raw))
    (d / "skip.md").write_text("not read")
    (d / "notes.docx").write_bytes(b"PK")
    with caplog.at_level("WARNING", logger="mlm_pipeline.ingest.sources"):
        m = run(tmp_path, [d])
    assert [Path(s.path).name for s in m.sources] == names
    # skipped files are not silent: counted and named
    assert "skipped 2 file(s) of unsupported type (notes.docx, skip.md)" in caplog.text
    assert sorted(t for _, t, _ in records(m)) == [f"document {i}" for i in range(6)]


def test_file_urls_through_fsspec(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS)))
    pq.write_table(pa.table({"text": ["ligne parquet"]}), d / "sub" / "b.parquet")
    (d / "c.csv.zst").write_bytes(COMPRESS[".zst"](csv_bytes(DOCS[:1])))
    (d / "notes.md").write_text("skipped")
    local = run(tmp_path / "local", [d])
    url = run(tmp_path / "url", [d.as_uri()])
    assert [s.path for s in url.sources] == [f.as_uri() for f in sorted(
        [d / "a.jsonl.gz", d / "c.csv.zst", d / "sub" / "b.parquet"])]
    assert [(s.sha256, s.bytes, s.documents) for s in url.sources] == [
        (s.sha256, s.bytes, s.documents) for s in local.sources]
    assert url.digest == local.digest  # content-addressed: same bytes, same names
    assert records(url) == records(local)
    assert url.documents_kept == 4 and url.dropped["duplicate"] == 1  # the CSV row = d1
    glob_m = run(tmp_path / "glob", [f"file://{d}/*.gz"])
    assert [s.path for s in glob_m.sources] == [(d / "a.jsonl.gz").as_uri()]
    with pytest.raises(FileNotFoundError, match="nothing"):
        run(tmp_path / "none", [f"file://{d}/nothing*.txt"])
