"""`write_shards` killed with SIGKILL mid-shard or before a rename, then rerun.

The writer runs in a child process whose script wraps one call (pyarrow's
`RecordBatchFileWriter.write_batch`, or `os.replace`) so that the second call kills the
process: no Python cleanup runs, exactly as with `kill -9` or the OOM killer.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mlm_pipeline.config import ShardConfig
from mlm_pipeline.manifest import ShardManifest, load_if_complete, stage_dir
from mlm_pipeline.shards.format import open_shard, verify_shards
from mlm_pipeline.shards.stage import shards_digest, write_shards

CFG = ShardConfig(seq_len=16, rows_per_shard=24, encode_batch_size=4)

SCRIPT = """
import os, signal, sys
import pyarrow.ipc
from mlm_pipeline.config import ShardConfig
from mlm_pipeline.manifest import CorpusManifest, TokenizerManifest, read_manifest
from mlm_pipeline.shards.stage import write_shards

corpus_path, tokenizer_path, work_dir, cfg_json, kill_at = sys.argv[1:]

def kill_on_second(owner, name, before):
    original, calls = getattr(owner, name), [0]
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2 and before:
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(*args, **kwargs)
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(owner, name, wrapper)

if kill_at == "write_batch":  # batch written, footer not: a partial Arrow file
    kill_on_second(pyarrow.ipc.RecordBatchFileWriter, "write_batch", before=False)
elif kill_at == "replace":  # temp file complete and fsynced, not yet renamed
    kill_on_second(os, "replace", before=True)
m = write_shards(ShardConfig.model_validate_json(cfg_json),
                 read_manifest(corpus_path, CorpusManifest),
                 read_manifest(tokenizer_path, TokenizerManifest), work_dir)
print(m.path)
"""


def _run_child(corpus, tokenizer, work_dir, kill_at: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(corpus.path), str(tokenizer.path),
         str(work_dir), CFG.model_dump_json(), kill_at],
        capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def reference(tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path_factory):
    """Shards of a run that was never killed; several train shards by construction."""
    m = write_shards(CFG, tiny_corpus_manifest, tiny_tokenizer_manifest,
                     tmp_path_factory.mktemp("reference"))
    assert len(m.train.shards) >= 3
    return m


@pytest.mark.parametrize("kill_at", ["write_batch", "replace"])
def test_killed_writer_leaves_no_partial_shard_and_rerun_completes(
    kill_at, reference, tiny_corpus_manifest, tiny_tokenizer_manifest, tmp_path
):
    work_dir = tmp_path / "work"
    killed = _run_child(tiny_corpus_manifest, tiny_tokenizer_manifest, work_dir, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    digest = shards_digest(CFG, tiny_corpus_manifest, tiny_tokenizer_manifest)
    out_dir = stage_dir(work_dir, "shards", digest)
    assert not (out_dir / "manifest.json").exists()
    assert load_if_complete(out_dir, ShardManifest, digest) is None
    # Only the first shard was renamed; it is whole and equals the reference's first shard.
    visible = sorted(p.name for p in out_dir.glob("*.arrow"))
    assert visible == [reference.train.shards[0].path]
    np.testing.assert_array_equal(open_shard(out_dir / visible[0]),
                                  open_shard(reference.file(visible[0])))
    # The second shard exists only under temporary names, which are not shard names: its
    # body file (rows appended while packing) and the Arrow file being written around it,
    # both named with the killed process's id (`locks.temp_path`).
    temps = sorted(p.name for p in out_dir.iterdir() if p.name.endswith(".tmp"))
    second = reference.train.shards[1].path
    found = [re.fullmatch(rf"\.{re.escape(second)}(\.body)?\.(\d+)-[0-9a-f]{{16}}\.tmp", t)
             for t in temps]
    assert len(temps) == 2 and all(found), temps
    assert [bool(m.group(1)) for m in found] == [False, True]  # the Arrow file, the body
    assert found[0].group(2) == found[1].group(2)  # one process
    tmp = out_dir / temps[0]
    if kill_at == "write_batch":  # no Arrow footer: not readable as a shard
        with pytest.raises(ValueError):
            open_shard(tmp)
    else:  # complete, but never renamed: still not counted
        np.testing.assert_array_equal(open_shard(tmp),
                                      open_shard(reference.file(reference.train.shards[1].path)))

    rerun = _run_child(tiny_corpus_manifest, tiny_tokenizer_manifest, work_dir, "none")
    assert rerun.returncode == 0, rerun.stderr
    m = load_if_complete(out_dir, ShardManifest, digest)
    assert m is not None and rerun.stdout.strip() == str(m.path)
    verify_shards(m)
    for split in ("train", "validation"):
        got, want = getattr(m, split), getattr(reference, split)
        assert [(e.path, e.rows, e.sha256) for e in got.shards] == [
            (e.path, e.rows, e.sha256) for e in want.shards]
        for e in got.shards:
            np.testing.assert_array_equal(open_shard(m.file(e.path)),
                                          open_shard(reference.file(e.path)))
    # The rerun, holding the stage lock, removed the killed run's temporaries: none is left.
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    assert json.loads(m.path.read_text())["digest"] == digest
