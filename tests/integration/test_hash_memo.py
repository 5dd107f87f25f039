"""The work directory's hash memo (`mlm_pipeline.ingest.hashing`): an in-place edit that
keeps size and mtime is seen in one long-lived process, a second process reuses the memo
instead of reading the files, a racy entry is not trusted, two processes write it at
once, and a damaged memo only costs the reading."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import hashing
from mlm_pipeline.ingest.hashing import MEMO_FILE, HashMemo
from mlm_pipeline.ingest.stage import ingest_digest

TEXT = "Le chat dort sur le canapé du salon.\n\nLes oiseaux chantent dans le jardin.\n"


@pytest.fixture()
def reads(monkeypatch) -> list[int]:
    """Bytes of every file the memo reads to hash it, one entry per read."""
    seen: list[int] = []
    real = hashing.hash_stream

    def counting(f):
        size, sha = real(f)
        seen.append(size)
        return size, sha

    monkeypatch.setattr(hashing, "hash_stream", counting)
    return seen


def _later(monkeypatch) -> None:
    """Hashes now count as taken 10 s after the files' last change (not racy)."""
    monkeypatch.setattr(hashing, "_now_ns", lambda: time.time_ns() + 10 * 10**9)


def _edit_in_place_keeping_mtime(path: Path, new: bytes) -> None:
    """Rewrite `path` with `new` (same size) and set its atime and mtime back; waits until
    ctime differs from before (file system timestamps move by clock ticks)."""
    before = path.stat()
    assert len(new) == before.st_size
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    deadline = time.monotonic() + 5
    while path.stat().st_ctime_ns == before.st_ctime_ns and time.monotonic() < deadline:
        time.sleep(0.01)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # sets ctime to now
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ino)
    assert after.st_ctime_ns != before.st_ctime_ns


def test_same_size_edit_with_mtime_restored_is_seen_in_one_process(tmp_path, monkeypatch, reads):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT, encoding="utf-8")
    cfg, work = IngestConfig(sources=[str(src)]), tmp_path / "work"
    _later(monkeypatch)
    first = ingest_digest(cfg, work)
    assert reads == [len(TEXT.encode())]
    assert ingest_digest(cfg, work) == first and len(reads) == 1  # remembered: not read
    assert ingest_digest(cfg) == first and len(reads) == 2  # the in-process memo
    assert ingest_digest(cfg) == first and len(reads) == 2

    edited = TEXT.replace("chat", "chien").replace("canapé", "canape").encode()
    edited = edited[: len(TEXT.encode())].ljust(len(TEXT.encode()), b"\n")
    _edit_in_place_keeping_mtime(src, edited)
    assert HashMemo(work).file_sha256(src) == hashlib.sha256(edited).hexdigest()
    assert ingest_digest(cfg, work) != first
    assert ingest_digest(cfg) != first  # the in-process memo sees it too


def test_second_process_reuses_the_memo_without_reading(tmp_path, monkeypatch, reads):
    files = [tmp_path / f"doc{i}.txt" for i in range(3)]
    for i, f in enumerate(files):
        f.write_bytes(f"document {i}\n".encode() * (1000 + i))
    work = tmp_path / "work"
    _later(monkeypatch)
    here = [HashMemo(work).file_sha256(f) for f in files]
    assert here == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert len(reads) == 3 and (work / MEMO_FILE).is_file()
    child = textwrap.dedent(f"""
        import json, sys
        from mlm_pipeline.ingest import hashing
        reads = []
        real = hashing.hash_stream
        def counting(f):
            reads.append(1)
            return real(f)
        hashing.hash_stream = counting
        files = {[str(f) for f in files]!r}
        hashes = [hashing.HashMemo({str(work)!r}).file_sha256(f) for f in files]
        json.dump({{"hashes": hashes, "reads": len(reads)}}, sys.stdout)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout)
    assert got == {"hashes": here, "reads": 0}


def test_racy_entry_is_hashed_again_then_trusted(tmp_path, monkeypatch, reads):
    f = tmp_path / "fresh.txt"
    f.write_bytes(b"just written\n")
    changed = max(f.stat().st_mtime_ns, f.stat().st_ctime_ns)
    memo = HashMemo(tmp_path / "work")
    # Hashed within RACY_NS of the file's last change: the entry is not trusted ...
    monkeypatch.setattr(hashing, "_now_ns", lambda: changed + hashing.RACY_NS // 2)
    memo.file_sha256(f)
    memo.file_sha256(f)
    assert len(reads) == 2
    # ... until a hash taken long enough after it.
    monkeypatch.setattr(hashing, "_now_ns", lambda: changed + hashing.RACY_NS)
    memo.file_sha256(f)
    memo.file_sha256(f)
    assert len(reads) == 3


def test_two_processes_fill_one_memo_at_once(tmp_path):
    files = [tmp_path / f"f{i:03d}.txt" for i in range(60)]
    for i, f in enumerate(files):
        f.write_bytes(b"x" * i)
    work = tmp_path / "work"
    child = textwrap.dedent(f"""
        import json, sys
        from mlm_pipeline.ingest.hashing import HashMemo
        files = {[str(f) for f in files]!r}
        order = files if sys.argv[1] == "0" else files[::-1]
        got = {{f: HashMemo({str(work)!r}).file_sha256(f) for f in order}}
        json.dump(got, sys.stdout)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", child, str(k)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    want = {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "not usable" not in err
        assert json.loads(out) == want
    import sqlite3

    with sqlite3.connect(work / MEMO_FILE) as con:
        rows = dict(con.execute("SELECT name, sha256 FROM memo").fetchall())
    assert rows == {str(Path(k).resolve()): v for k, v in want.items()}


def test_damaged_memo_is_skipped_with_a_warning(tmp_path, caplog):
    work = tmp_path / "work"
    work.mkdir()
    (work / MEMO_FILE).write_bytes(b"not a database, " * 64)
    f = tmp_path / "a.txt"
    f.write_bytes(b"bytes\n")
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.ingest.hashing"):
        assert HashMemo(work).file_sha256(f) == hashlib.sha256(b"bytes\n").hexdigest()
    assert f"{work.resolve() / MEMO_FILE}: hash memo not usable" in caplog.text


def test_memo_of_a_stage_dir_is_created_only_in_a_work_dir(tmp_path):
    stage = tmp_path / "elsewhere" / "tokenizer" / "0123456789abcdef"
    stage.mkdir(parents=True)
    assert HashMemo.of_stage_dir(stage).db is None
    (tmp_path / "elsewhere" / MEMO_FILE).touch()
    assert HashMemo.of_stage_dir(stage).db == (tmp_path / "elsewhere" / MEMO_FILE).resolve()
