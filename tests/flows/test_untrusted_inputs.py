"""What an attacker can plant or send never runs or reads anything:
a pickle planted in Prefect's result storage under the cache key of a data stage is never
unpickled, and corpus sources sent by an event are read only inside
`ingest.allowed_sources`."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.serializers import PickleSerializer
from prefect.settings import get_current_settings
from pydantic import ValidationError

from mlm_pipeline_flows.pretraining import PretrainParams, _ingest_key, _tokenizer_key, mlm_pretraining
from mlm_pipeline_flows.result_store import SERIALIZER_TYPE
from mlm_pipeline.config_files import load_config
from mlm_pipeline.ingest import ingest

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        f"work_dir={tmp_path / 'work'}", f"ingest.sources=[{ASSETS / 'tiny_fr.txt'}]",
        "ingest.validation_fraction=0.15", "tokenizer.vocab_size=128", "shards.seq_len=16",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "train.micro_batch_size=4", "train.max_steps=2",
        "train.warmup_steps=1", "train.log_every=1", "eval.max_rows=8", "eval.probes=[]",
        "linear_probe.enabled=false", "tracking.log_model=false",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.experiment_name=untrusted", *extra,
    ]


class _WritesMarker:
    """Unpickling it writes `path` (a stand-in for any command)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


def _pickle_record(marker: Path) -> bytes:
    """A Prefect result record that names the pickle serializer, as Prefect writes one."""
    return ResultRecord(result=_WritesMarker(marker),
                        metadata=ResultRecordMetadata(serializer=PickleSerializer())).serialize()


def test_a_pickle_planted_under_a_cache_key_is_never_unpickled(tmp_path):
    params = PretrainParams(config="tiny", overrides=_overrides(tmp_path))
    cfg = load_config(*params.resolved())
    storage = Path(get_current_settings().results.local_storage_path)
    marker = tmp_path / "marker"
    # The payload is live: Prefect's own reader runs it.
    control = tmp_path / "control-marker"
    ResultRecord.deserialize(_pickle_record(control))
    assert control.read_text() == "unpickled"
    # Plant a pickle record under the ingest key and raw pickle bytes under the tokenizer's.
    corpus = ingest(cfg.ingest, cfg.work_dir)  # the tokenizer key depends on the corpus
    planted = {storage / _ingest_key(None, {"cfg": cfg}): _pickle_record(marker),
               storage / _tokenizer_key(None, {"cfg": cfg, "corpus": corpus}):
                   pickle.dumps(_WritesMarker(marker))}
    for path, data in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    state = mlm_pretraining(params, return_state=True)

    assert state.is_completed(), state.message
    assert not marker.exists()
    for path in planted:  # recomputed, and replaced by a JSON manifest record
        record = json.loads(path.read_bytes())
        assert record["metadata"]["serializer"]["type"] == SERIALIZER_TYPE
        assert json.loads(record["result"])["stage"] in ("ingest", "tokenizer")


def test_event_sources_outside_the_allow_list_are_refused_before_reading(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = ASSETS / "tiny_fr.txt"
    params = PretrainParams(config="tiny", event_sources=[str(outside)],
                            overrides=_overrides(tmp_path, f"ingest.allowed_sources=[{allowed}]"))
    state = mlm_pretraining(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError) as info:
        state.result()
    message = str(info.value)
    assert repr(str(outside)) in message and str(allowed) in message
    assert not (tmp_path / "work").exists()  # nothing read, nothing written
    assert not (tmp_path / "mlflow.db").exists()


def test_event_sources_without_an_allow_list_are_refused(tmp_path):
    params = PretrainParams(config="tiny", event_sources=[str(ASSETS / "tiny_fr.txt")],
                            overrides=_overrides(tmp_path, "ingest.allowed_sources=null"))
    state = mlm_pretraining(params, return_state=True)
    with pytest.raises(ValueError, match="sets no ingest.allowed_sources"):
        state.result()
    assert not (tmp_path / "work").exists()


def test_event_sources_inside_the_allow_list_replace_the_config_sources(tmp_path):
    corpus = tmp_path / "incoming" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_bytes((ASSETS / "tiny_fr.txt").read_bytes())
    params = PretrainParams(
        config="tiny", event_sources=[str(corpus)],
        overrides=_overrides(tmp_path, f"ingest.sources=[{tmp_path / 'missing.txt'}]",
                             f"ingest.allowed_sources=[{corpus.parent}]"))
    state = mlm_pretraining(params, return_state=True)
    assert state.is_completed(), state.message
    manifest = json.loads(Path(state.result()["manifests"]["ingest"]).read_text())
    assert [s["path"] for s in manifest["sources"]] == [str(corpus)]


def test_an_event_payload_that_is_not_a_list_of_strings_is_not_a_parameter():
    for bad in ("/etc/passwd", [{"path": "/etc"}], [1]):
        with pytest.raises(ValidationError):
            PretrainParams.model_validate({"event_sources": bad})
    schema = PretrainParams.model_json_schema()["properties"]["event_sources"]
    assert {"type": "array", "items": {"type": "string"}, "maxItems": 1000} in schema["anyOf"]
    # a trigger whose event has no corpus renders [""]: the config's own sources
    assert PretrainParams.model_validate({"event_sources": [""]}).event_sources is None


def test_a_failed_data_stage_keeps_its_error_without_any_class_by_name(tmp_path, caplog):
    """A failing cached stage: Prefect persists the exception with the stage's serializer
    (no "Failed to write result" warning), as its type and message only; read back, it is a
    plain RuntimeError with that text, and the failure reaches the caller unchanged."""
    from mlm_pipeline_flows.result_store import ManifestSerializer
    from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining

    missing = tmp_path / "nowhere.txt"
    with caplog.at_level("WARNING"):
        state = mlm_pretraining(PretrainParams(
            config="tiny", overrides=[*_overrides(tmp_path), f"ingest.sources=[{missing}]"]),
            return_state=True)
    assert state.is_failed()
    assert "Failed to write result" not in caplog.text
    with pytest.raises(Exception, match="nowhere.txt"):
        state.result()
    blob = ManifestSerializer().dumps(FileNotFoundError(f"{missing}: no such file"))
    back = ManifestSerializer().loads(blob)
    assert type(back) is RuntimeError and str(back) == f"FileNotFoundError: {missing}: no such file"
