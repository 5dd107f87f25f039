"""A stage output outside the work directory is refused in the flows too: a `prepare-data`
reference pointing elsewhere never makes a stage read or reuse that directory. (The data
stages persist no Prefect result, so no result record can point elsewhere.)"""

from __future__ import annotations

import pytest

from mlm_pipeline_flows.pretrain_params import ManifestRef
from mlm_pipeline.config_files import load_config
from mlm_pipeline.ingest import ingest
from mlm_pipeline.manifest import CorpusManifest, OutsideWorkDirError
from tests.flows.test_untrusted_inputs import _overrides


def test_a_prepared_data_reference_outside_the_work_dir_is_refused(tmp_path):
    cfg = load_config("tiny", _overrides(tmp_path))
    elsewhere = ingest(cfg.ingest, tmp_path / "elsewhere")  # complete, digest right
    ref = ManifestRef.of(elsewhere)
    with pytest.raises(OutsideWorkDirError, match="outside the work directory"):
        ref.read(CorpusManifest, cfg.work_dir)
