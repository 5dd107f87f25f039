"""Unit tests of `mlm_pipeline.ingest.stage` on tiny corpora written in tmp_path."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import cleaning, sources
from mlm_pipeline.ingest import writer as ingest_writer
from mlm_pipeline.ingest.stage import ingest, read_documents

# The issue's bytes: BOM, CRLF line, lone-CR line, LF line, U+2028 inside a line, an
# invalid UTF-8 byte, a NUL.
ISSUE_LINES = [b"\xef\xbb\xbfab\r\n", b"cd\r", b"ef\n", "g\u2028h\n".encode(), b"i\xffj\n",
               b"k\x00l\n"]
ZERO_DROPS = {"bad_json": 0, "missing_text": 0, "binary": 0, "language": 0, "empty": 0,
              "too_short": 0, "few_letters": 0, "duplicate": 0, "near_duplicate": 0}
NO_REPAIRS = {"bom": 0, "invalid_utf8": 0, "nul": 0, "control": 0, "control_space": 0,
              "split": 0, "extra_fields": 0}


def records(m) -> list[tuple[str, str, str]]:
    """(id, text, source) of every written document, read with pyarrow directly."""
    out = []
    for e in m.train + m.validation:
        t = pq.read_table(m.file(e.path))
        assert t.schema.names == ["id", "text", "source"]
        out += zip(*(t.column(c).to_pylist() for c in ("id", "text", "source")))
    return sorted(out)


def run(tmp_path: Path, sources, **kw):
    kw.setdefault("validation_fraction", 0.0)
    return ingest(IngestConfig(sources=[str(s) for s in sources], **kw), tmp_path / "work")


def check_accounting(m, extra_parts: int = 0) -> None:
    """The manifest's counts add up; `extra_parts`: parts beyond the first of each split
    document (split parts count as kept documents, see the ingest module docstring)."""
    assert m.documents_read + extra_parts == m.documents_kept + sum(m.dropped.values())
    assert m.documents_kept == m.documents_train + m.documents_validation
    assert sum(e.rows for e in m.train) == m.documents_train
    assert sum(e.rows for e in m.validation) == m.documents_validation
    assert sum(s.documents for s in m.sources) == m.documents_read
    assert set(m.dropped) == set(ZERO_DROPS)
    assert set(m.repaired) == set(NO_REPAIRS)


def test_issue_case_one_document_per_line(tmp_path):
    # Each record followed by a blank line with the same terminator (a "\n" after "cd\r"
    # would make it a CRLF): lines 1, 3, 5, ... hold the records.
    data = (b"\xef\xbb\xbfab\r\n" b"\r\n" b"cd\r" b"\r" b"ef\n" b"\n" + "g\u2028h\n".encode()
            + b"\n" b"i\xffj\n" b"\n" b"k\x00l\n")
    f = tmp_path / "a.txt"
    f.write_bytes(data)
    m = run(tmp_path, [f])
    assert records(m) == sorted([
        ("a.txt:1", "ab", "a.txt"), ("a.txt:3", "cd", "a.txt"), ("a.txt:5", "ef", "a.txt"),
        ("a.txt:7", "g\u2028h", "a.txt"), ("a.txt:9", "i\ufffdj", "a.txt"),
        ("a.txt:11", "kl", "a.txt"),
    ])
    assert m.repaired == {**NO_REPAIRS, "bom": 1, "invalid_utf8": 1, "nul": 1}
    assert m.dropped == ZERO_DROPS
    assert m.documents_read == 6 and m.characters == 4 * 2 + 3 + 3
    check_accounting(m)


def test_issue_case_lone_cr_blank_lines(tmp_path):
    # Records separated by a bare "\r": "cd\r\r" is a line and a blank line (not CRLF).
    f = tmp_path / "b.txt"
    f.write_bytes(b"\r".join(line.rstrip(b"\r\n") + b"\r" for line in ISSUE_LINES))
    m = run(tmp_path, [f])
    assert sorted(t for _, t, _ in records(m)) == sorted(["ab", "cd", "ef", "g\u2028h",
                                                          "i\ufffdj", "kl"])
    assert m.repaired == {**NO_REPAIRS, "bom": 1, "invalid_utf8": 1, "nul": 1}


def test_issue_case_paragraph_and_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"".join(ISSUE_LINES))
    want = "ab\ncd\nef\ng\u2028h\ni\ufffdj\nkl"
    for mode in ("paragraph", "file"):
        m = run(tmp_path / mode, [f], txt_document=mode)
        assert records(m) == [("a.txt:1", want, "a.txt")]
        assert m.repaired == {**NO_REPAIRS, "bom": 1, "invalid_utf8": 1, "nul": 1}
        assert m.documents_read == 1
    g = tmp_path / "g.txt"
    g.write_bytes(b"  \none\n\n\ntwo\n")
    assert records(run(tmp_path / "g", [g], txt_document="file")) == [
        ("g.txt:1", "one\n\n\ntwo", "g.txt")]
    assert records(run(tmp_path / "gp", [g])) == [("g.txt:2", "one", "g.txt"),
                                                   ("g.txt:5", "two", "g.txt")]


def test_other_separators_do_not_split(tmp_path):
    f = tmp_path / "s.txt"
    f.write_bytes("a\x85b\n\nc\u2029d\n\ne\x0cf\ng\x0bh\n".encode())
    m = run(tmp_path, [f])
    # Form feed and vertical tab split nothing; as C0 separators each becomes a space, so
    # the words stay apart (one `control_space` repair: one record).
    assert records(m) == [("s.txt:1", "a\x85b", "s.txt"), ("s.txt:3", "c\u2029d", "s.txt"),
                          ("s.txt:5", "e f\ng h", "s.txt")]
    assert m.repaired == {**NO_REPAIRS, "control_space": 1}


def test_nfkc_and_bom_on_blank_first_line(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf \n\n" + "\ufb01n\n".encode())
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "x\u00b2"}).encode())
    m = run(tmp_path, [tmp_path / "a.txt", tmp_path / "b.jsonl"], normalization="NFKC")
    assert records(m) == [("a.txt:3", "fin", "a.txt"), ("b.jsonl:1", "x2", "b.jsonl")]
    assert m.repaired == {**NO_REPAIRS, "bom": 2, "invalid_utf8": 0, "nul": 0}
    m = run(tmp_path / "nfc", [tmp_path / "a.txt"])
    assert records(m) == [("a.txt:3", "\ufb01n", "a.txt")]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_raw_lines_chunk_boundaries(chunk):
    import io

    data = b"a\r\nb\rc\n\r\n\rd\r\r\ne" + b"x\r" * 5 + b"\r\n"
    want = re.split(rb"\r\n|\r|\n", data)[:-1]  # reference: split the whole buffer
    assert list(sources.raw_lines(io.BytesIO(data), chunk)) == want
    assert list(sources.raw_lines(io.BytesIO(b"no end"), chunk)) == [b"no end"]


def write_jsonl(path: Path, lines: list[str | bytes]) -> None:
    data = b"".join(ln if isinstance(ln, bytes) else (ln + "\n").encode() for ln in lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_jsonl_drops_repairs_and_gz(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [
        json.dumps({"id": "x1", "text": "Bonjour le monde"}),
        "{not json",
        json.dumps({"title": "no text"}),
        json.dumps({"text": 5}),
        json.dumps({"text": "  \t "}),
        json.dumps({"text": "Bonjour le monde", "source": "dup"}),
        json.dumps({"text": "caf\u00e9 noir"}, ensure_ascii=False),
        json.dumps({"text": "cafe\u0301 noir"}),  # NFD: same text after NFC
        "[1, 2]",
        json.dumps({"text": "ok", "source": "src"}),
        "",  # blank line: no record
        json.dumps({"text": "fin\u0000 de ligne", "source": "crlf"}).encode() + b"\r\n",
        b'{"text": "octet \xff invalide"}\n',
        json.dumps({"text": "moiti\ud800"}),  # lone surrogate escape
    ])
    write_jsonl(d / "b.jsonl.gz", [json.dumps({"text": "compress\u00e9"}, ensure_ascii=False),
                                    json.dumps({"text": "Bonjour le monde"})])
    m = run(tmp_path, [d], min_chars=3)
    assert [Path(s.path).name for s in m.sources] == ["a.jsonl", "b.jsonl.gz"]
    assert [s.documents for s in m.sources] == [13, 2]
    assert m.sources[1].sha256 == hashlib.sha256((d / "b.jsonl.gz").read_bytes()).hexdigest()
    assert records(m) == sorted([
        ("x1", "Bonjour le monde", "a.jsonl"),
        ("a.jsonl:7", "caf\u00e9 noir", "a.jsonl"),
        ("a.jsonl:12", "fin de ligne", "crlf"),
        ("a.jsonl:13", "octet \ufffd invalide", "a.jsonl"),
        ("a.jsonl:14", "moiti\ufffd", "a.jsonl"),
        ("b.jsonl.gz:1", "compress\u00e9", "b.jsonl.gz"),
    ])
    assert m.dropped == {**ZERO_DROPS, "bad_json": 2, "missing_text": 2, "empty": 1,
                         "too_short": 1, "duplicate": 3}
    assert m.repaired == {**NO_REPAIRS, "bom": 0, "invalid_utf8": 2, "nul": 1}
    assert m.documents_read == 15
    check_accounting(m)


def test_sources_globs_directories_and_errors(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("deux\n")
    (d / "sub" / "a.txt.gz").write_bytes(gzip.compress(b"un\n"))
    (d / "notes.md").write_text("ignored in a directory\n")
    (d / "c.jsonl").write_text('{"text": "trois"}\n')
    m = run(tmp_path, [d, d / "b.txt", str(d / "*.jsonl")])
    names = [Path(s.path).relative_to(d).as_posix() for s in m.sources]
    assert names == ["b.txt", "c.jsonl", "sub/a.txt.gz", "b.txt", "c.jsonl"]
    assert [t for _, t, _ in records(m)] == ["un", "deux", "trois"]  # by id: a.txt.gz:1 first
    assert m.dropped["duplicate"] == 2
    with pytest.raises(FileNotFoundError, match="nothing"):
        run(tmp_path, [tmp_path / "nothing*.txt"])
    with pytest.raises(ValueError, match="notes.md"):
        run(tmp_path, [d / "notes.md"])
    with pytest.raises(ValueError, match="notes.md"):
        run(tmp_path, [str(d / "*")])


def test_max_documents_stops_reading(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"doc {i}\n\n" for i in range(10)))
    (tmp_path / "b.jsonl").write_text("{bad\n" * 3)
    m = run(tmp_path, [tmp_path / "a.txt", tmp_path / "b.jsonl"], max_documents=4)
    assert m.documents_read == 4 and [s.documents for s in m.sources] == [4, 0]
    assert [t for _, t, _ in records(m)] == ["doc 0", "doc 1", "doc 2", "doc 3"]
    m = run(tmp_path / "x", [tmp_path / "a.txt", tmp_path / "b.jsonl"], max_documents=11)
    assert m.documents_read == 11 and m.dropped["bad_json"] == 1
    check_accounting(m)


def in_validation(text: str, fraction: float) -> bool:
    """Reference split rule from the spec, computed independently of the module."""
    h = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def test_split_deterministic_order_and_directory_independent(tmp_path):
    rng = random.Random(0)
    texts = [f"Phrase numéro {i} : {rng.random():.6f} et quelques mots." for i in range(2000)]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "c.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    shuffled = texts[:]
    rng.shuffle(shuffled)
    (tmp_path / "two" / "c.txt").write_text("\n\n".join(shuffled) + "\n", encoding="utf-8")
    frac = 0.1
    m1 = run(tmp_path / "w1", [tmp_path / "one" / "c.txt"], validation_fraction=frac)
    m2 = run(tmp_path / "w2", [tmp_path / "two" / "c.txt"], validation_fraction=frac)

    def val_texts(m):
        return {t for _, t in read_documents([m.file(e.path) for e in m.validation])}

    want = {t for t in texts if in_validation(t, frac)}
    assert val_texts(m1) == val_texts(m2) == want
    assert m1.documents_kept == 2000
    # Binomial(2000, 0.1): mean 200, sd 13.4; 5 sd either side.
    assert 133 <= m1.documents_validation <= 267
    # The same bytes in another directory: same digest.
    (tmp_path / "three").mkdir()
    shutil.copy(tmp_path / "one" / "c.txt", tmp_path / "three" / "c.txt")
    m3 = run(tmp_path / "w1", [tmp_path / "three" / "c.txt"], validation_fraction=frac)
    assert m3.digest == m1.digest and m2.digest != m1.digest
    assert records(m3) == records(m1)


def test_read_documents_in_file_order(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_writer, "DOCS_PER_FILE", 4)
    monkeypatch.setattr(ingest_writer, "BATCH_DOCS", 3)
    texts = [f"texte {i}" for i in range(10)]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    m = run(tmp_path, [tmp_path / "a.txt"])
    assert [e.path for e in m.train] == [f"train-0000{i}.parquet" for i in range(3)]
    assert [e.rows for e in m.train] == [4, 4, 2]
    got = list(read_documents([m.file(e.path) for e in m.train]))
    assert got == [(f"a.txt:{2 * i + 1}", t) for i, t in enumerate(texts)]


def test_empty_validation_gets_smallest_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_writer, "DOCS_PER_FILE", 2)
    texts = ["alpha", "beta", "gamma", "delta", "epsilon"]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    frac = 1e-12
    assert not any(in_validation(t, frac) for t in texts)
    m = run(tmp_path, [tmp_path / "a.txt"], validation_fraction=frac)
    smallest = min(texts, key=lambda t: hashlib.sha256(t.encode()).digest())
    assert [t for _, t in read_documents([m.file(e.path) for e in m.validation])] == [smallest]
    train = [t for _, t in read_documents([m.file(e.path) for e in m.train])]
    assert train == [t for t in texts if t != smallest]  # reading order kept
    assert m.documents_train == 4 and m.documents_validation == 1
    check_accounting(m)


def test_training_split_empty_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("  \n\n\x00\n")
    with pytest.raises(ValueError, match="training split is empty"):
        run(tmp_path, [tmp_path / "a.txt"])
    (tmp_path / "b.txt").write_text("seul\n")
    assert in_validation("seul", 0.9999)
    with pytest.raises(ValueError, match="training split is empty"):
        run(tmp_path, [tmp_path / "b.txt"], validation_fraction=0.9999)


def test_rerun_is_cached(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("un\n\ndeux\n\ntrois\n")
    m1 = run(tmp_path, [tmp_path / "a.txt"], validation_fraction=0.3)
    out = Path(m1.output_dir)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert "manifest.json" in before and len(before) >= 2
    caplog.set_level("INFO", logger="mlm_pipeline.ingest.stage")
    m2 = run(tmp_path, [tmp_path / "a.txt"], validation_fraction=0.3)
    assert m2 == m1
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert "cached" in caplog.text
    m3 = run(tmp_path, [tmp_path / "a.txt"], validation_fraction=0.3, min_chars=4)
    assert m3.digest != m1.digest and m3.documents_kept == 2


def test_cheap_modules_import_neither_torch_nor_prefect():
    code = ("import sys, mlm_pipeline.ingest.stage, mlm_pipeline.ingest.corpora, mlm_pipeline.ingest.readers, "
            "mlm_pipeline.ingest.sources, mlm_pipeline.ingest.cleaning; "
            "bad = {'torch', 'prefect', 'datasketch', 'fsspec'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------- oversized documents
def check_parts(text: str, pairs, limit: int) -> None:
    assert "".join(p + s for p, s in pairs) == text  # all text kept, in order
    assert all(len(p) <= limit for p, _ in pairs)
    assert all(s.strip() == "" for _, s in pairs)  # only whitespace is a separator


def test_split_text_prefers_paragraph_then_sentence_then_space():
    para, sent = "Un deux. Trois", "quatre cinq. Six sept"
    pairs = cleaning.split_text(para + "\n \n" + sent, 25)
    assert pairs == [(para, "\n \n"), (sent, "")]  # a sentence end came later, unused
    pairs = cleaning.split_text("Aaa bb. Ccc dd ee ff", 14)
    assert pairs == [("Aaa bb.", " "), ("Ccc dd ee ff", "")]  # sentence before space
    pairs = cleaning.split_text("aaa bbb ccc ddd", 9)
    assert pairs == [("aaa bbb", " "), ("ccc ddd", "")]
    assert cleaning.split_text("x" * 25, 10) == [("x" * 10, ""), ("x" * 10, ""), ("x" * 5, "")]
    assert cleaning.split_text("short", 10) == [("short", "")]


def test_split_text_random_texts_keep_everything():
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("ab.!? \n\t") for _ in range(rng.randrange(1, 200))).strip() or "a"
        limit = rng.randrange(1, 30)
        pairs = cleaning.split_text(text, limit)
        check_parts(text, pairs, limit)
        # A cut falls inside no whitespace run: the part ends and the next starts visible.
        assert all(p and not p[-1].isspace() and not p[0].isspace() for p, _ in pairs)


def test_oversized_document_split_and_counted(tmp_path):
    limit = 1000
    sents = [f"Phrase {i} du long document." for i in range(120)]  # about 3300 chars
    long = " ".join(sents)
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"id": "long", "text": long}) + "\n" + json.dumps({"text": "court"}) + "\n")
    m = run(tmp_path, [tmp_path / "a.jsonl"], max_document_chars=limit)
    got = dict((i, t) for i, t, _ in records(m))
    parts = [got[f"long#{k}"] for k in range(1, len(got))]
    assert " ".join(parts) == long  # separators were single spaces
    assert all(len(p) <= limit and p.endswith(".") for p in parts)  # cut at sentence ends
    assert got["a.jsonl:2"] == "court"
    assert m.repaired["split"] == 1 and m.documents_read == 2
    assert m.documents_kept == len(parts) + 1
    check_accounting(m, extra_parts=len(parts) - 1)


def test_30mb_single_line_document_is_kept(tmp_path):
    # Words w0 w1 ...: never periodic, so no part is a duplicate of another.
    text = " ".join(f"w{i}" for i in range(3_700_000))
    assert len(text) > 30_000_000
    (tmp_path / "big.txt").write_text(text + "\n")
    m = run(tmp_path, [tmp_path / "big.txt"])  # default max_document_chars = 1_000_000
    parts = list(read_documents([m.file(e.path) for e in m.train]))
    assert [i for i, _ in parts] == [f"big.txt:1#{k}" for k in range(1, len(parts) + 1)]
    assert all(len(t) <= 1_000_000 for _, t in parts)
    assert " ".join(t for _, t in parts) == text
    assert m.characters == len(text) - (len(parts) - 1)  # only the cut spaces removed
    assert m.repaired["split"] == 1
    check_accounting(m, extra_parts=len(parts) - 1)


# -------------------------------------------------------------------------------- filters
def test_letter_share_and_language_filters(tmp_path):
    rows = [{"text": "abc def", "lang": "fr"}, {"text": "12345 678"}, {"text": "ab 1234"},
            {"text": "é1"}, {"text": "hello world", "lang": "en"}, {"text": "sans langue"},
            {"text": "ok", "lang": "de"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = run(tmp_path, [tmp_path / "a.jsonl"], min_letter_share=0.5, languages=["fr", "de"])

    def share(t):  # reference: letters / non-space characters
        vis = [c for c in t if not c.isspace()]
        return sum(unicodedata.category(c).startswith("L") for c in vis) / len(vis)

    want = [r["text"] for r in rows if r.get("lang", "fr") in ("fr", "de")
            and share(r["text"]) >= 0.5]
    assert want == ["abc def", "é1", "sans langue", "ok"]
    assert sorted(t for _, t, _ in records(m)) == sorted(want)
    assert m.dropped == {**ZERO_DROPS, "few_letters": 2, "language": 1}
    check_accounting(m)


# ----------------------------------------------------------------------------- near-dedup
def test_near_duplicates_dropped(tmp_path):
    pytest.importorskip("datasketch")
    rng = random.Random(3)
    vocab = [f"mot{i}" for i in range(5000)]
    base = [rng.choice(vocab) for _ in range(80)]
    near = base[:]
    near[40] = "changé"  # 5 of 76 shingles differ: Jaccard 71/81 = 0.88
    other = [rng.choice(vocab) for _ in range(80)]
    texts = [" ".join(base), " ".join(other), " ".join(near)]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    m = run(tmp_path, [tmp_path / "a.txt"], near_dedup_threshold=0.7)
    assert [t for _, t, _ in records(m)] == texts[:2]  # the first seen is kept
    assert m.dropped == {**ZERO_DROPS, "near_duplicate": 1}
    check_accounting(m)
    m = run(tmp_path / "off", [tmp_path / "a.txt"])
    assert m.documents_kept == 3


def test_near_dedup_without_datasketch_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasketch", None)  # import fails
    (tmp_path / "a.txt").write_text("un texte\n")
    with pytest.raises(ImportError, match=r"near-dedup"):
        run(tmp_path, [tmp_path / "a.txt"], near_dedup_threshold=0.8)
