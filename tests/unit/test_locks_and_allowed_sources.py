"""Stage locks, per-process temporary names and stale cleanup (`mlm_pipeline.locks`), and the
allow-list of event sources (`mlm_pipeline.ingest.allowed`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.allowed import check_event_sources, refused_reason
from mlm_pipeline.locks import lock_path, remove_stale_temporaries, stage_lock, temp_path


def test_temp_names_are_unique_per_process_and_call(tmp_path):
    final = tmp_path / "train-00000.parquet"
    names = {temp_path(final) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert name.parent == tmp_path
        assert name.name.startswith(f".train-00000.parquet.{os.getpid()}-")
        assert name.name.endswith(".tmp")


def test_stale_temporaries_go_and_this_process_s_own_stay(tmp_path):
    stage = tmp_path / "work" / "shards" / "0123456789abcdef"
    stage.mkdir(parents=True)
    other = stage / ".train-00000.arrow.999999-0a1b.tmp"  # a pid of a run that ended
    legacy, legacy_dir = stage / ".train-00001.arrow.tmp", stage / ".tmp-abc"
    mine = temp_path(stage / "train-00002.arrow")
    kept = stage / "train-00000.arrow"
    for f in (other, legacy, mine, kept):
        f.write_bytes(b"x")
    legacy_dir.mkdir()
    (legacy_dir / "train.txt").write_text("x")
    with stage_lock(stage):
        removed = remove_stale_temporaries(stage)
    assert sorted(removed) == sorted([other, legacy, legacy_dir])
    assert sorted(p.name for p in stage.iterdir()) == sorted([mine.name, kept.name])
    assert lock_path(stage) == tmp_path / "work" / ".locks" / "shards-0123456789abcdef.lock"


_HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mlm_pipeline.locks import stage_lock
    with stage_lock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.readline()  # hold until told (or killed)
        Path(sys.argv[2]).write_text("released")  # written while still holding the lock
""")


def test_a_second_process_waits_for_the_lock_and_a_killed_holder_frees_it(tmp_path):
    # Exact whatever the machine's speed: the holder writes its marker while it still
    # holds the lock, so whoever gets the lock next must find the marker.
    stage, marker = tmp_path / "ingest" / "abc", tmp_path / "released"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(stage), str(marker)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: _take(stage, marker, seen))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not seen  # blocked while the holder holds the lock
    holder.stdin.write("release\n")
    holder.stdin.flush()
    waiter.join(timeout=60)
    holder.wait(timeout=60)
    assert seen == [True]  # it got the lock only after the holder let go
    killed = subprocess.Popen([sys.executable, "-c", _HOLDER, str(stage), str(marker)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "held"
    killed.kill()  # SIGKILL: no cleanup runs, the kernel releases the lock
    killed.wait(timeout=30)
    with stage_lock(stage):  # would block for ever if the dead holder still held it
        pass


def _take(stage: Path, marker: Path, seen: list[bool]) -> None:
    with stage_lock(stage):
        seen.append(marker.is_file())


def test_event_sources_must_resolve_inside_an_allowed_root(tmp_path):
    root = tmp_path / "corpora"
    (root / "fr").mkdir(parents=True)
    (root / "fr" / "a.txt").write_text("x")
    (root / "escape").symlink_to(tmp_path)  # a link inside the root to outside it
    allowed = [str(root)]
    assert refused_reason(str(root / "fr" / "a.txt"), allowed) is None
    assert refused_reason(str(root / "fr" / "*.txt"), allowed) is None  # a glob
    assert refused_reason(str(root), allowed) is None
    for bad in (str(root / "fr" / ".." / ".." / "secret.txt"), str(root / "escape" / "x"),
                str(tmp_path / "corpora-evil" / "a.txt"), "/etc/passwd", "", "relative.txt"):
        assert refused_reason(bad, allowed) is not None, bad


def test_url_prefixes_match_at_a_path_boundary_and_debian_names_exactly():
    allowed = ["s3://bucket/corpus", "https://data.example/fr/", "debian:fr"]
    assert refused_reason("s3://bucket/corpus/part-1.jsonl", allowed) is None
    assert refused_reason("https://data.example/fr/a.txt", allowed) is None
    assert refused_reason("debian:fr", allowed) is None
    for bad in ("s3://bucket/corpus-evil/x", "s3://bucket/corpus/../secret",
                "s3://other/corpus/x", "file:///etc/passwd", "debian:fr-extra",
                "https://data.example/fr/./../x"):
        assert refused_reason(bad, allowed) is not None, bad


def test_the_error_names_each_refused_source_and_the_allow_list(tmp_path):
    with pytest.raises(ValueError) as info:
        check_event_sources(["/etc/passwd", str(tmp_path / "ok.txt")], [str(tmp_path)])
    message = str(info.value)
    assert "'/etc/passwd'" in message and str(tmp_path / "ok.txt") not in message.split("(")[0]
    assert f"ingest.allowed_sources = [{str(tmp_path)!r}]" in message
    with pytest.raises(ValueError, match="sets no ingest.allowed_sources"):
        check_event_sources(["debian:fr"], None)


def test_allowed_sources_entries_are_roots_urls_or_debian_names():
    IngestConfig(allowed_sources=["/data", "~/corpora", "s3://b/p/", "debian:fr"])
    with pytest.raises(ValueError, match="not absolute directory roots"):
        IngestConfig(allowed_sources=["data/relative"])
