"""A stage output outside the work directory is refused in the flows too: a manifest
result record planted under a data stage's cache key (it names our serializer, so Prefect
reads it) and a `prepare-data` reference pointing elsewhere never make a stage read or
reuse that directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.settings import get_current_settings

from mlm_pipeline_flows.pretrain_params import ManifestRef
from mlm_pipeline_flows.pretraining import PretrainParams, _ingest_key, mlm_pretraining
from mlm_pipeline_flows.result_store import ManifestSerializer
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


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings in CI; the fast refusal tests run on every push
def test_a_cached_manifest_naming_a_directory_outside_the_work_dir_fails_the_run(tmp_path):
    params = PretrainParams(config="tiny", overrides=_overrides(tmp_path))
    cfg = load_config(*params.resolved())
    elsewhere = ingest(cfg.ingest, tmp_path / "elsewhere")  # same digest, other directory
    storage = Path(get_current_settings().results.local_storage_path)
    record = ResultRecord(result=elsewhere,
                          metadata=ResultRecordMetadata(serializer=ManifestSerializer()))
    key = storage / _ingest_key(None, {"cfg": cfg})
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_bytes(record.serialize())

    state = mlm_pretraining(params, return_state=True)

    assert state.is_failed()
    with pytest.raises(OutsideWorkDirError) as info:
        state.result()
    assert elsewhere.output_dir in str(info.value)
    assert not (Path(cfg.work_dir) / "tokenizer").exists()  # no stage ran on it
