"""Data preparation on a real local Dask cluster (2 worker processes, `DaskTaskRunner`)
gives the digests and bytes of the single-process stages: corpus, tokenizer and shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlm_pipeline.config import (
    DataPrepConfig,
    IngestConfig,
    PipelineConfig,
    ShardConfig,
    TokenizerConfig,
)
from mlm_pipeline.ingest import ingest
from mlm_pipeline.ingest.partitions import plan_partitions
from mlm_pipeline.ingest.sources import resolve_sources
from mlm_pipeline.shards import write_shards
from mlm_pipeline.tokenizer import train_tokenizer
from tests.integration.test_partitioned_prep import _tree_sha256, _write_inputs

pytest.importorskip("prefect_dask")


@pytest.mark.slow  # a local Dask cluster's start: the push tier, on every push
def test_dask_prep_equals_single_process(tmp_path, tiny_paragraphs):
    from mlm_pipeline_flows.dask_prep import prepare_partitioned

    src = _write_inputs(tmp_path, tiny_paragraphs)
    cfg = PipelineConfig(
        work_dir=str(tmp_path / "dask"),
        ingest=IngestConfig(sources=[str(src)], validation_fraction=0.1),
        tokenizer=TokenizerConfig(vocab_size=128),
        shards=ShardConfig(seq_len=16, rows_per_shard=64, encode_batch_size=4),
        data=DataPrepConfig(executor="dask", workers=2, partitions=6),
    )
    one_dir = tmp_path / "one"
    corpus = ingest(cfg.ingest, one_dir)
    tokenizer = train_tokenizer(cfg.tokenizer, corpus, one_dir)
    shards = write_shards(cfg.shards, corpus, tokenizer, one_dir, cfg.masking)

    got = prepare_partitioned(cfg)

    for single, dask in zip((corpus, tokenizer, shards), got):
        print(f"{single.stage}: in-process {single.digest[:16]}, Dask {dask.digest[:16]}")
        assert dask.digest == single.digest
        assert Path(dask.output_dir).is_relative_to(tmp_path / "dask")
        assert _tree_sha256(Path(dask.output_dir)) == _tree_sha256(Path(single.output_dir))
    assert len(got[2].train.shards) > 1
    # The partition work ran as Prefect task runs (one per partition), all completed.
    parts = plan_partitions(resolve_sources(cfg.ingest), cfg.ingest, 6)
    states = _partition_states()
    assert states["read-partition"] == ["Completed"] * len(parts)
    assert set(states["encode-partition"]) == {"Completed"}


def _partition_states() -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs()
    states: dict[str, list[str]] = {}
    for r in runs:
        kind = r.name.rsplit("-", 1)[0]
        if kind in ("read-partition", "encode-partition"):
            states.setdefault(kind, []).append(r.state.name)
    return states


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings in CI; the test above runs on every push
def test_prepare_data_flow_with_the_dask_executor_matches_the_local_one(tmp_path, tiny_paragraphs):
    """The `prepare-data` flow with `data.executor=dask` (what a user sets) returns the
    manifests of the local executor: same digests, byte-identical files."""
    from mlm_pipeline_flows.prepare_data import prepare_data_flow
    from mlm_pipeline_flows.pretraining import PretrainParams

    src = _write_inputs(tmp_path, tiny_paragraphs)
    base = [f"ingest.sources=[{src}]", "ingest.validation_fraction=0.1",
            "tokenizer.vocab_size=128", "shards.seq_len=16", "shards.rows_per_shard=64"]
    local = prepare_data_flow(PretrainParams(
        config="tiny", overrides=[*base, f"work_dir={tmp_path / 'local'}"]))
    dask = prepare_data_flow(PretrainParams(
        config="tiny", overrides=[*base, f"work_dir={tmp_path / 'dask'}", "data.executor=dask",
                                  "data.workers=2", "data.partitions=4"]))
    for stage in ("corpus", "tokenizer", "shards"):
        a, b = getattr(local, stage), getattr(dask, stage)
        assert a.digest == b.digest, stage
        assert _tree_sha256(Path(b.path).parent) == _tree_sha256(Path(a.path).parent), stage
