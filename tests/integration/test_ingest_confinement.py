"""`ingest.allowed_sources` confines every file read, not only the source strings: a file
symlink (or a glob match) inside an allowed root that leads out of every root is skipped,
never opened, and named in `skipped_files`; a link that stays inside the roots is read.

Each test builds its own tree in tmp_path: an allowed root `allowed/`, a second allowed
root `other/`, and a secret outside both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.partitions import Partition, partitioned, read_partition
from mlm_pipeline.ingest.stage import ingest

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")

SECRET = "Le secret qui ne doit jamais sortir du coffre."
GOOD = "Un document ordinaire, dans la racine permise."
LINKED = "Un document d'une autre racine permise, lu par un lien."


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    allowed, other, elsewhere = (tmp_path / n for n in ("allowed", "other", "elsewhere"))
    for d in (allowed, other, elsewhere):
        d.mkdir()
    (elsewhere / "secret.txt").write_text(SECRET + "\n")
    (allowed / "good.txt").write_text(GOOD + "\n")
    (other / "real.txt").write_text(LINKED + "\n")
    (allowed / "leak.txt").symlink_to(elsewhere / "secret.txt")
    (allowed / "inside.txt").symlink_to(other / "real.txt")
    return {"root": tmp_path, "allowed": allowed, "other": other, "elsewhere": elsewhere}


def texts(m) -> list[str]:
    out = []
    for e in m.train + m.validation:
        out += pq.read_table(m.file(e.path)).column("text").to_pylist()
    return sorted(out)


def run(tree, source: str, **kw):
    cfg = IngestConfig(sources=[source], validation_fraction=0.0, min_chars=1,
                       allowed_sources=[str(tree["allowed"]), str(tree["other"])])
    return ingest(cfg, tree["root"] / "work", **kw)


def outside(m) -> list[str]:
    return [s.path for s in m.skipped_files if s.reason == "outside_allowed_sources"]


@pytest.mark.parametrize("how", ["directory", "glob", "partitioned"])
def test_a_file_symlink_leading_out_is_skipped_and_named(tree, how):
    source = str(tree["allowed"] / "*.txt") if how == "glob" else str(tree["allowed"])
    kw = {"accounting": partitioned(map, 3)} if how == "partitioned" else {}
    m = run(tree, source, **kw)
    assert texts(m) == sorted([GOOD, LINKED])  # the link staying inside is read
    assert outside(m) == [str(tree["allowed"] / "leak.txt")]
    assert m.documents_read == 2 and SECRET not in texts(m)
    assert [Path(s.path).name for s in m.sources] == ["good.txt", "real.txt"]


def test_a_source_named_inside_the_root_that_leads_out_matches_nothing(tree):
    with pytest.raises(FileNotFoundError, match="outside_allowed_sources"):
        run(tree, str(tree["allowed"] / "leak.txt"))


def test_without_an_allow_list_the_config_reads_what_it_names(tree):
    cfg = IngestConfig(sources=[str(tree["allowed"])], validation_fraction=0.0, min_chars=1)
    m = ingest(cfg, tree["root"] / "work")
    assert texts(m) == sorted([GOOD, LINKED, SECRET])  # the user's own sources: unchecked
    assert outside(m) == []


def test_a_link_swapped_in_after_listing_is_refused_when_read(tree):
    # A partition planned on a file inside the root that leads out when a worker opens it.
    cfg = IngestConfig(sources=[str(tree["allowed"])], min_chars=1,
                       allowed_sources=[str(tree["allowed"])])
    res = read_partition(cfg, Partition(0, tree["allowed"] / "leak.txt"))
    assert res.records == []
    assert res.error[0] == "outside_allowed_sources"
    assert str(tree["elsewhere"] / "secret.txt") in res.error[1]


def test_file_url_globs_are_confined_too(tree):
    # (fsspec's directory listing already names links as `other`; its glob follows them)
    cfg = IngestConfig(sources=[f"file://{tree['allowed']}/*.txt"], validation_fraction=0.0,
                       min_chars=1, allowed_sources=[f"file://{tree['allowed']}/",
                                                     str(tree["other"])])
    m = ingest(cfg, tree["root"] / "work")
    assert texts(m) == sorted([GOOD, LINKED])
    assert outside(m) == [f"file://{tree['allowed']}/leak.txt"]
