"""What an attacker can send never runs or reads anything: corpus sources sent by an event
are read only inside `ingest.allowed_sources`. (Nothing can be planted in Prefect's result
storage for the data stages to read: they persist no result, see
tests/flows/test_pretraining_flow.py::test_data_stages_are_reused_by_content.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mlm_pipeline_flows.prepare_data import prepare_data_flow
from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining

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
    # The data flow, which the pipeline runs first: event sources are applied where every
    # flow loads its parameters (`PretrainParams.load`); training would prove nothing more.
    state = prepare_data_flow(params, return_state=True)
    assert state.is_completed(), state.message
    (corpus_manifest,) = [m for m in state.result().load(params.load()) if m.stage == "ingest"]
    assert [s.path for s in corpus_manifest.sources] == [str(corpus)]


def test_an_event_payload_that_is_not_a_list_of_strings_is_not_a_parameter():
    for bad in ("/etc/passwd", [{"path": "/etc"}], [1]):
        with pytest.raises(ValidationError):
            PretrainParams.model_validate({"event_sources": bad})
    schema = PretrainParams.model_json_schema()["properties"]["event_sources"]
    assert {"type": "array", "items": {"type": "string"}, "maxItems": 1000} in schema["anyOf"]
    # a trigger whose event has no corpus renders [""]: the config's own sources
    assert PretrainParams.model_validate({"event_sources": [""]}).event_sources is None


def test_a_failed_data_stage_reaches_the_caller_unchanged(tmp_path, caplog):
    """A failing data stage: its exception (type and message) is what the caller gets, and
    Prefect writes no result for it (no "Failed to write result" warning)."""
    missing = tmp_path / "nowhere.txt"
    with caplog.at_level("WARNING"):
        state = mlm_pretraining(PretrainParams(
            config="tiny", overrides=[*_overrides(tmp_path), f"ingest.sources=[{missing}]"]),
            return_state=True)
    assert state.is_failed()
    assert "Failed to write result" not in caplog.text
    with pytest.raises(FileNotFoundError, match="nowhere.txt.*matches no file"):
        state.result()
