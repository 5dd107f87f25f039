"""Hostile inputs: the bad-file policy, CR-only JSONL, resynchronised
JSON arrays, binary content, control characters and special directory entries.

Every fixture is written here, in tmp_path; expected counts are worked out by hand from
the bytes written (see the comments), never by the code under test.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.readers import read_records
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.tracking.records import accounting_rows, data_accounting

needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/null")


def run(tmp_path: Path, *sources, **kw):
    kw.setdefault("validation_fraction", 0.0)
    return ingest(IngestConfig(sources=[str(s) for s in sources], **kw), tmp_path / "work")


def texts_by_id(m) -> dict[str, str]:
    out = {}
    for e in m.train + m.validation:
        t = pq.read_table(m.file(e.path))
        out.update(zip(t.column("id").to_pylist(), t.column("text").to_pylist()))
    return out


def jsonl(texts: list[str], eol: str = "\n") -> bytes:
    return "".join(json.dumps({"text": t}, ensure_ascii=False) + eol for t in texts).encode()


def random_binary(seed: int, n: int) -> bytes:
    """`n` random bytes without line ends or NUL (so a `.txt` paragraph is one line and
    no `nul` repair is made), with a 0xFF (never valid UTF-8) in front."""
    rng = random.Random(seed)
    pool = [b for b in range(256) if b not in (0x00, 0x0A, 0x0D)]
    return b"\xff" + bytes(rng.choice(pool) for _ in range(n - 1))


# ------------------------------------------------------------------ the hostile directory
GOOD = ["Premier document valide.", "Deuxième document valide.", "Troisième document valide."]
CR_ONLY = ["Une ligne finie par CR.", "Encore une ligne CR.", "Dernière ligne CR."]
ARRAY = [{"text": f"Élément numéro {i} du tableau."} for i in range(1, 7)]


def build_hostile(d: Path) -> None:
    d.mkdir()
    (d / "a_good.jsonl").write_bytes(jsonl(GOOD))
    (d / "b_cr_only.jsonl").write_bytes(jsonl(CR_ONLY, eol="\r"))
    elements = [json.dumps(e, ensure_ascii=False) for e in ARRAY]
    elements[1] = '{"text" "element 2 has no colon"}'  # a syntax error in element 2 of 6
    (d / "c_array.json").write_text("[\n" + ",\n".join(elements) + "\n]\n", encoding="utf-8")
    (d / "d_controls.txt").write_bytes(b"Texte\x01 avec\x07 des\x1b contr\x08oles.\n\n"
                                       b"Texte propre, sans controle.\n")
    # 4 KB of random bytes, in three paragraphs (two blank lines put in by hand).
    noise = random_binary(1, 4096)
    (d / "e_random.txt").write_bytes(noise[:1300] + b"\n\n" + noise[1300:2600] + b"\n\n"
                                     + noise[2600:])
    whole = gzip.compress(jsonl([f"Ligne compressée {i}." for i in range(4)]))
    (d / "f_truncated.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    (d / "g_not_gzip.jsonl.gz").write_bytes(jsonl(["Pas du gzip du tout."]))
    (d / "h_object.json").write_text('{"text": "un objet, pas un tableau"}')
    pq.write_table(pa.table({"body": ["la colonne text manque"]}), d / "i_no_text.parquet")
    (d / "j_empty.parquet").write_bytes(b"")
    (d / "k_open_quote.csv").write_text('id,text\nk1,Une ligne CSV correcte.\n'
                                        'k2,"ce guillemet ne ferme jamais\nsuite\n')
    os.mkfifo(d / "l_pipe.jsonl")
    os.symlink("m_loop.txt", d / "m_loop.txt")  # a link to itself
    os.symlink(d / "missing.jsonl", d / "n_dangling.jsonl")
    (d / "notes.md").write_text("pas une entrée")
    (d / "o_dir.jsonl").mkdir()
    os.symlink("/dev/null", d / "p_null.txt")
    (d / "q_dup.txt").write_text(GOOD[0] + "\n")
    (d / "r_two_arrays.json").write_text('[{"text": "Premier tableau."}]\n'
                                         '[{"text": "Second tableau."}]\n')


@needs_posix
def test_hostile_directory_exact_accounting(tmp_path, caplog):
    d = tmp_path / "hostile"
    build_hostile(d)
    with caplog.at_level(logging.WARNING):
        m = run(tmp_path, d)
    # file -> records read, documents kept (worked out from the bytes above):
    want = {
        "a_good.jsonl": (3, 3),
        "b_cr_only.jsonl": (3, 3),  # CR-only line ends still separate the 3 records
        "c_array.json": (6, 5),  # element 2 lost as bad_json, 3-6 resynchronised
        "d_controls.txt": (2, 2),  # 4 control characters removed: 1 `control` repair
        "e_random.txt": (3, 0),  # 3 paragraphs of noise dropped as binary
        "f_truncated.jsonl.gz": (0, 0),  # bad: the first read already ends the stream
        "g_not_gzip.jsonl.gz": (0, 0),  # bad
        "h_object.json": (0, 0),  # bad
        "i_no_text.parquet": (0, 0),  # bad
        "j_empty.parquet": (0, 0),  # bad
        "k_open_quote.csv": (1, 1),  # bad after its first row, which is kept
        "q_dup.txt": (1, 0),  # a duplicate of a_good.jsonl's first record
        "r_two_arrays.json": (1, 1),  # bad after its first array, whose element is kept
    }
    assert [(Path(s.path).name, s.documents) for s in m.sources] == [
        (name, read) for name, (read, _) in want.items()]
    kept = texts_by_id(m)
    per_file: dict[str, int] = {}
    for doc_id in kept:
        name = doc_id.rsplit(":", 1)[0] if ":" in doc_id else "k_open_quote.csv"  # id k1
        per_file[name] = per_file.get(name, 0) + 1
    assert per_file == {name: n for name, (_, n) in want.items() if n}
    assert sorted(kept.values()) == sorted(
        GOOD + CR_ONLY + [e["text"] for i, e in enumerate(ARRAY) if i != 1]
        + ["Texte avec des controles.", "Texte propre, sans controle.",
           "Une ligne CSV correcte.", "Premier tableau."])
    # 3+3+6+2+3+1+1+1 = 20 read; 3+3+5+2+1+1 = 15 kept; 1 bad_json + 3 binary + 1 duplicate.
    assert m.documents_read == 20 and m.documents_kept == 15
    assert {k: v for k, v in m.dropped.items() if v} == {
        "bad_json": 1, "binary": 3, "duplicate": 1}
    assert {k: v for k, v in m.repaired.items() if v} == {"control": 1, "invalid_utf8": 3}
    assert m.documents_read + m.split_parts_extra == m.documents_kept + sum(m.dropped.values())
    assert [(Path(b.path).name, b.reason, b.documents) for b in m.bad_files] == [
        ("f_truncated.jsonl.gz", "corrupt_compressed", 0),
        ("g_not_gzip.jsonl.gz", "corrupt_compressed", 0),
        ("h_object.json", "not_json_array", 0),
        ("i_no_text.parquet", "missing_text_column", 0),
        ("j_empty.parquet", "corrupt_parquet", 0),
        ("k_open_quote.csv", "unclosed_csv_quote", 1),
        ("r_two_arrays.json", "json_extra_data", 1),
    ]
    assert all(b.error.startswith(b.path + ": ") for b in m.bad_files)
    assert [(Path(s.path).name, s.reason) for s in m.skipped_files] == [
        ("l_pipe.jsonl", "fifo"), ("m_loop.txt", "symlink_loop"),
        ("n_dangling.jsonl", "dangling_symlink"), ("notes.md", "unsupported_type"),
        ("o_dir.jsonl", "directory"), ("p_null.txt", "device")]
    # Every bad file and every special entry is named in a warning.
    for b in m.bad_files:
        assert any(b.error in r.getMessage() for r in caplog.records)
    special = next(r.getMessage() for r in caplog.records if "never opened" in r.getMessage())
    for name in ("l_pipe.jsonl (fifo)", "m_loop.txt (symlink_loop)", "o_dir.jsonl (directory)",
                 "n_dangling.jsonl (dangling_symlink)", "p_null.txt (device)"):
        assert name in special
    # ... and reach the tracking records (MLflow metrics, the accounting table).
    split = SimpleNamespace(rows=0, remainder_tokens=0)
    params = data_accounting(m, SimpleNamespace(vocab_size=128),
                             SimpleNamespace(seq_len=16, train=split, validation=split))
    assert params["files_rejected"] == 7 and params["files_skipped"] == 6
    assert params["dropped_binary"] == 3 and params["repaired_control"] == 1
    rows = [r for r in accounting_rows(m) if r["what"] == "file rejected"]
    assert [(r["reason"], r["documents"]) for r in rows] == [
        (f"{b.reason}: {b.path}", b.documents) for b in m.bad_files]

    # on_bad_file: fail reports all 7 bad files at once, one line each, and writes nothing.
    with pytest.raises(ValueError, match=r"^ingest: 7 bad input file\(s\)") as err:
        run(tmp_path / "fail", d, on_bad_file="fail")
    lines = str(err.value).splitlines()[1:]
    assert lines == [b.error for b in m.bad_files]
    assert not list((tmp_path / "fail").rglob("manifest.json"))


def test_cached_manifest_with_bad_files_fails_under_fail(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.json"
    good.write_text("Un document.\n")
    bad.write_text('{"text": "pas un tableau"}')
    m = run(tmp_path, good, bad)
    assert [b.reason for b in m.bad_files] == ["not_json_array"] and m.documents_kept == 1
    # on_bad_file is not in the digest: the cached corpus is found, and refused.
    with pytest.raises(ValueError, match="1 bad input file") as err:
        run(tmp_path, good, bad, on_bad_file="fail")
    assert str(bad.resolve()) in str(err.value)


# ------------------------------------------------------------------ readers, one by one
@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_jsonl_every_line_end_separates_records(tmp_path, eol):
    f = tmp_path / "a.jsonl"
    f.write_bytes(jsonl(["un", "deux", "trois"], eol=eol) + eol.encode())  # + a blank line
    recs = list(read_records(f, "text", "paragraph"))
    assert [(r.id, r.text) for r in recs] == [("a.jsonl:1", "un"), ("a.jsonl:2", "deux"),
                                             ("a.jsonl:3", "trois")]


@pytest.mark.parametrize("damaged, want", [
    # element 2 damaged in four ways; the other five survive, element ids unchanged
    ('{"text" "no colon"}', None),
    ('{"text": oops}', None),
    ('{"text": "a", "n": 1,}', None),
    ('{"text": "unbalanced}', None),  # its quote swallows element 3: counted as 1 lost
    # two damaged elements in a row are two records lost
    ('{"text": x}, {"text": y}', "two"),
])
def test_json_array_resynchronises_after_a_syntax_error(tmp_path, damaged, want):
    elements = [json.dumps({"text": f"element {i}"}) for i in range(1, 7)]
    elements[1] = damaged
    f = tmp_path / "a.json"
    f.write_text("[" + ", ".join(elements) + "]")
    got = [(r.id, r.text, r.drop) for r in read_records(f, "text", "paragraph")]
    if damaged == '{"text": "unbalanced}':
        # `"unbalanced}, ` is a string; the error comes at element 3's text: elements 2
        # and 3 are one damaged span, counted as 1; parsing resumes at element 4.
        assert got == [("a.json:1", "element 1", None), ("a.json:2", "", "bad_json")] + [
            (f"a.json:{i - 1}", f"element {i}", None) for i in range(4, 7)]
    elif want == "two":
        assert got == [("a.json:1", "element 1", None), ("a.json:2", "", "bad_json"),
                       ("a.json:3", "", "bad_json")] + [
            (f"a.json:{i + 1}", f"element {i}", None) for i in range(3, 7)]
    else:
        assert got == [(f"a.json:{i}", f"element {i}", None) if i != 2 else
                       ("a.json:2", "", "bad_json") for i in range(1, 7)]


def test_json_array_damage_at_the_end_and_trailing_comma(tmp_path):
    (tmp_path / "a.json").write_text('[{"text": "a"}, {"text": oops}]')
    (tmp_path / "b.json").write_text('[{"text": "a"}, {"text": "b"},]')
    (tmp_path / "c.json").write_text('[{"text": "a"}, {"text": "b"')  # cut: no closing ']'
    for name in ("a.json", "b.json", "c.json"):
        got = [(r.text, r.drop) for r in read_records(tmp_path / name, "text", "paragraph")]
        assert got == [("a", None), ("", "bad_json")] if name != "b.json" else [
            ("a", None), ("b", None), ("", "bad_json")], name


def test_deeply_nested_json_is_a_bad_record_not_a_crash(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "a.jsonl").write_text(deep + "\n" + json.dumps({"text": "après"}) + "\n")
    (tmp_path / "b.json").write_text("[" + deep + ', {"text": "après"}]')
    for name in ("a.jsonl", "b.json"):
        got = [(r.text, r.drop) for r in read_records(tmp_path / name, "text", "paragraph")]
        assert got == [("", "bad_json"), ("après", None)], name


def test_random_bytes_are_dropped_as_binary(tmp_path):
    f = tmp_path / "noise.txt"
    f.write_bytes(random_binary(7, 4096))  # one line, one paragraph
    ok = tmp_path / "ok.txt"
    ok.write_text("un vrai texte")
    m = run(tmp_path, f, ok)
    assert (m.documents_read, m.documents_kept, m.dropped["binary"]) == (2, 1, 1)


def test_control_characters_are_removed_and_counted(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(jsonl(["tab\tand\nnewline\r\nkept", "bell\x07 and escape\x1b[0m gone",
                        "vertical\x0btab"]))
    m = run(tmp_path, f)
    assert sorted(texts_by_id(m).values()) == sorted([
        "tab\tand\nnewline\r\nkept", "bell and escape[0m gone", "vertical tab"])
    assert (m.repaired["control"], m.repaired["control_space"]) == (1, 1)


def test_control_separators_keep_words_apart(tmp_path):
    # Form feed, vertical tab and the separators U+001C-U+001F between two words: the words
    # stay two (one space per run), counted as `control_space`, never glued ("ab").
    f = tmp_path / "sep.jsonl"
    f.write_bytes(jsonl(["a\x0cb", "c\x0bd", "e\x1c\x1d\x1e\x1ff", "g\x07\x0ch",
                         "plain words"]))
    m = run(tmp_path, f)
    assert sorted(texts_by_id(m).values()) == ["a b", "c d", "e f", "g h", "plain words"]
    assert (m.repaired["control_space"], m.repaired["control"]) == (4, 1)
    assert m.documents_read == m.documents_kept == 5


def test_form_feed_in_a_text_file_is_a_space(tmp_path):
    f = tmp_path / "ff.txt"
    f.write_bytes(b"one\x0ctwo three\n")
    m = run(tmp_path, f)
    assert list(texts_by_id(m).values()) == ["one two three"]
    assert m.repaired["control_space"] == 1 and m.repaired["control"] == 0


@needs_posix
def test_special_entries_given_as_sources_are_never_opened(tmp_path):
    os.mkfifo(tmp_path / "p.jsonl")
    with pytest.raises(FileNotFoundError, match=r"matches no file; skipped: .*p\.jsonl \(fifo\)"):
        run(tmp_path, tmp_path / "p.jsonl")
    (tmp_path / "ok.txt").write_text("un texte")
    m = run(tmp_path, str(tmp_path / "*"))  # a glob matching the FIFO too
    assert [Path(s.path).name for s in m.sources] == ["ok.txt"]
    assert [(Path(s.path).name, s.reason) for s in m.skipped_files] == [("p.jsonl", "fifo")]
