"""The stage outputs as Prefect assets (`flows/assets.py`), read back as the Prefect API
stores them: `prefect.asset.materialization.succeeded` events whose resource is the
asset key and whose related resources (role `asset`) are its inputs, the edges of the
UI's asset graph; the metadata is the event's payload.

Keys are computed here from the manifests' digests, independently of
`version_lineage.asset_key`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from pathlib import Path

import pytest
from prefect import flow

from mlm_pipeline.manifest import TrainManifest
from mlm_pipeline_flows.assets import report_data_assets, report_model_asset
from mlm_pipeline_flows.pretraining import PretrainParams, prepare_data_flow
from tests.flows.test_pretraining_flow import _overrides

SUCCEEDED = "prefect.asset.materialization.succeeded"


def _key(stage: str, digest: str) -> str:
    return f"mlm://{stage}/{digest[:16]}"


def _materialized(keys: set[str], since: dt.datetime, count: int = 1,
                  timeout_s: float = 60.0) -> dict[str, list]:
    """key -> its materialization events since `since`, oldest first, once every key has
    `count` of them (events reach the API asynchronously; waits up to `timeout_s`)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=EventFilter(
                occurred=EventOccurredFilter(since=since),
                event=EventNameFilter(prefix=["prefect.asset.materialization."]),
                resource=EventResourceFilter(id=sorted(keys))), limit=50)
        found: dict[str, list] = {k: [] for k in keys}
        for event in sorted(page.events, key=lambda e: e.occurred):
            found[event.resource.id].append(event)
        if all(len(v) >= count for v in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _inputs(event) -> set[str]:
    return {r.id for r in event.related if r.role == "asset"}


def _trained(tmp_path: Path, digest: str, init: dict | None) -> TrainManifest:
    checkpoint = tmp_path / "train" / "checkpoints" / "step-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"state_sha256": digest}))
    return TrainManifest(
        stage="train", digest=hashlib.sha256(b"train").hexdigest(),
        output_dir=str(tmp_path / "train"), config={}, inputs={}, created_at=time.time(),
        wall_time_s=1.0, checkpoint_dir="checkpoints/step-3", steps=3, tokens_seen=192,
        final_metrics={}, metrics_log="metrics.jsonl", stopped_early=False, device="cpu",
        precision="fp32", init=init)


def test_outputs_are_assets_linked_corpus_tokenizer_shards_model(
        tmp_path, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest):
    corpus, tok, shards = tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest
    parent, own = "ab" * 32, "cd" * 32
    trained = _trained(tmp_path, own, {"source": "models:/m@champion", "digest": parent,
                                       "step": 6, "checkpoint": "/elsewhere/step-6"})
    registered = {"model_uri": "models:/m-1", "name": "m", "version": 2,
                  "decision": "promoted"}

    @flow
    def stages_then_model() -> None:
        report_data_assets(corpus, tok, shards, started_at=time.time())
        report_model_asset(trained, tok, shards, registered)

    since = dt.datetime.now(dt.timezone.utc)
    assert stages_then_model(return_state=True).is_completed()
    keys = {"corpus": _key("corpus", corpus.digest), "tokenizer": _key("tokenizer", tok.digest),
            "shards": _key("shards", shards.digest), "model": _key("model", own)}
    events = _materialized(set(keys.values()), since)
    last = {stage: events[key][-1] for stage, key in keys.items()}
    assert {stage: e.event for stage, e in last.items()} == dict.fromkeys(keys, SUCCEEDED)
    assert {stage: _inputs(e) for stage, e in last.items()} == {
        "corpus": set(),
        "tokenizer": {keys["corpus"]},
        "shards": {keys["corpus"], keys["tokenizer"]},
        "model": {keys["shards"], keys["tokenizer"], _key("model", parent)},
    }
    # The fixtures' outputs were made before the flow started: reported as reused.
    assert last["shards"].payload["reused"] is True
    assert last["shards"].payload["digest"] == shards.digest
    assert last["shards"].payload["train_rows"] == shards.train.rows
    assert last["model"].payload["version"] == 2
    assert last["model"].payload["decision"] == "promoted"
    assert last["model"].payload["steps"] == 3


@pytest.mark.slow  # two prepare-data flow runs (ingest, tokenizer, shards): seconds each
def test_prepare_data_reports_its_outputs_also_when_reused(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = PretrainParams(config="tiny", overrides=_overrides(tmp_path, uri))
    since = dt.datetime.now(dt.timezone.utc)
    first = prepare_data_flow(params)
    second = prepare_data_flow(params)  # every stage reused
    assert second == first
    keys = {"corpus": _key("corpus", first.corpus.digest),
            "tokenizer": _key("tokenizer", first.tokenizer.digest),
            "shards": _key("shards", first.shards.digest)}
    events = _materialized(set(keys.values()), since, count=2)
    assert {stage: [e.payload["reused"] for e in events[key]]
            for stage, key in keys.items()} == dict.fromkeys(keys, [False, True])
    assert _inputs(events[keys["shards"]][-1]) == {keys["corpus"], keys["tokenizer"]}
