"""Nothing outside the work directory is ever a stage output: a manifest (or a result
record, or a `prepare-data` reference) whose directory resolves outside `work_dir` is
refused before anything in it is read, with an error naming both directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import ingest
from mlm_pipeline.manifest import (
    CorpusManifest,
    OutsideWorkDirError,
    find_manifest,
    load_if_complete,
)
from mlm_pipeline.tracking.records import outputs_exist


@pytest.fixture()
def planted(tmp_path: Path):
    """A complete corpus made in `elsewhere/`, and the work directory `work/`."""
    text = tmp_path / "corpus.txt"
    text.write_text("Un premier document assez long.\n\nUn second document, lui aussi.\n")
    made = ingest(IngestConfig(sources=[str(text)], validation_fraction=0.0),
                  tmp_path / "elsewhere")
    work = tmp_path / "work"
    work.mkdir()
    return made, work


def test_a_manifest_outside_the_work_dir_is_refused(planted):
    made, work = planted
    assert outputs_exist(made)  # complete where it is: only the work directory refuses it
    with pytest.raises(OutsideWorkDirError) as info:
        outputs_exist(made, work)
    assert made.output_dir in str(info.value) and str(work.resolve()) in str(info.value)
    with pytest.raises(OutsideWorkDirError):
        find_manifest(made.output_dir, CorpusManifest, work)
    with pytest.raises(OutsideWorkDirError):
        load_if_complete(Path(made.output_dir), CorpusManifest, made.digest, work_dir=work)


def test_a_link_inside_the_work_dir_that_leads_out_is_refused(planted):
    made, work = planted
    (work / "ingest").mkdir()
    link = work / "ingest" / Path(made.output_dir).name
    link.symlink_to(made.output_dir)
    with pytest.raises(OutsideWorkDirError):
        find_manifest(link, CorpusManifest, work)
    moved = made.model_copy(update={"output_dir": str(link)})
    with pytest.raises(OutsideWorkDirError):
        outputs_exist(moved, work)


def test_a_stage_inside_the_work_dir_is_reused(planted):
    made, work = planted
    inside = work / "ingest" / Path(made.output_dir).name
    shutil.copytree(made.output_dir, inside)
    found = find_manifest(inside, CorpusManifest, work)
    assert found.output_dir == str(inside.resolve()) and outputs_exist(found, work)
    assert load_if_complete(inside, CorpusManifest, made.digest, work_dir=work) is not None
