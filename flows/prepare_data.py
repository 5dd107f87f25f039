"""The `prepare-data` flow: ingest -> tokenizer -> shards (CPU work; the CPU work pool).

The flow returns `PreparedData` (the three manifests by path and digest in the work
directory), what the `train-evaluate` flow takes: data prepared once serves any number of
training runs (a sweep over `train.*`, `model.*`), none of which runs a data stage again.

Reuse: no Prefect result is persisted or cached (a result record would be one more thing
to trust). Each stage finds its own complete output in the work directory by its digest
(computed from the content of its inputs and its config, never from paths or modification
times), verifies every file's size and sha256 and returns its manifest without recomputing;
so a rerun of the same config skips the work (the summary lists the stages as reused), and
a change reruns exactly the stages downstream of it. A stage whose files were deleted or
changed is recomputed.

No MLflow run here: the training run that uses the data records its lineage
(`train-evaluate`'s record-data task).
"""

from __future__ import annotations

import logging
import time

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (CorpusManifest, ShardManifest, TokenizerManifest,
                                   find_manifest, stage_dir)

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows.assets import report_data_assets
from mlm_pipeline_flows.pretrain_params import PreparedData, PretrainParams, flow_run_name
from mlm_pipeline_flows.task_support import IO_RETRIES, NOT_CACHED, data_progress

#: The flow's entry point (`prefect.yaml`).
ENTRYPOINT = "flows/prepare_data.py:prepare_data_flow"


@task(name="ingest", **NOT_CACHED, **IO_RETRIES)
def ingest_task(cfg: PipelineConfig) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus (less the holdout documents)."""
    from mlm_pipeline.ingest import ingest, read_holdout

    return ingest(cfg.ingest, cfg.work_dir, data_progress(), holdout=read_holdout(cfg))


@task(name="tokenizer", **NOT_CACHED)
def tokenizer_task(cfg: PipelineConfig, corpus: CorpusManifest) -> TokenizerManifest:
    """Train the SentencePiece tokenizer on the training split (with
    `tokenizer.from_init`, reuse the `train.init_from` model's: nothing trained)."""
    from mlm_pipeline.app.parents import prepare_tokenizer

    return prepare_tokenizer(cfg, corpus, data_progress())


@task(name="shards", **NOT_CACHED)
def shards_task(
    cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest
) -> ShardManifest:
    """Encode and pack both splits into Arrow shards (plus the masked copies of the
    training split with precomputed masking, keyed by `masking.seed`)."""
    from mlm_pipeline.shards import write_shards

    return write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir, cfg.masking,
                        data_progress())


def prepare(cfg: PipelineConfig) -> tuple[CorpusManifest, TokenizerManifest, ShardManifest]:
    """Run the three data stages in the current flow run (each reuses its complete output,
    found by digest); returns their manifests. With `data.executor: dask` the partition
    work fans out on a Dask cluster (`dask_prep.prepare_partitioned`: the same digests and
    files). The outputs are then reported as Prefect assets (`assets.report_data_assets`)."""
    started_at = time.time()
    if cfg.data.executor == "dask":
        from mlm_pipeline_flows.dask_prep import prepare_partitioned
        made = prepare_partitioned(cfg)
    else:
        corpus = ingest_task(cfg)
        tokenizer = tokenizer_task(cfg, corpus)
        made = corpus, tokenizer, shards_task(cfg, corpus, tokenizer)
    report_data_assets(*made, started_at=started_at)
    return made


def locate_prepared(cfg: PipelineConfig) -> PreparedData:
    """The data `prepare-data` made for `cfg` in `cfg.work_dir`, found by the stages' digests
    as the stages find their own (the corpus hashed through the work directory's hash memo,
    nothing else read): how `mlm-pretraining` finds what a `prepare-data` deployment run
    made on whatever machine, when the work directory is shared.

    Raises:
        FileNotFoundError: a stage's manifest is not in the work directory (the data was
            not prepared for this config there, or it changed since: the corpus too).
        ValueError: the manifest found does not validate.
    """
    from mlm_pipeline.ingest import ingest_digest, read_holdout
    from mlm_pipeline.shards import shards_digest
    from mlm_pipeline.app.parents import tokenizer_digest_for

    def read(stage, digest, cls):
        try:  # in the work directory, or in a URL one's store
            return find_manifest(stage_dir(cfg.work_dir, stage, digest), cls, cfg.work_dir)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc}: no {stage} output for this config in work_dir "
                                    f"{cfg.work_dir} (prepare-data did not make it there)"
                                    ) from exc

    corpus = read("ingest", ingest_digest(cfg.ingest, cfg.work_dir, read_holdout(cfg)),
                  CorpusManifest)
    tokenizer = read("tokenizer", tokenizer_digest_for(cfg, corpus), TokenizerManifest)
    shards = read("shards", shards_digest(cfg.shards, corpus, tokenizer, cfg.masking),
                  ShardManifest)
    return PreparedData.of(corpus, tokenizer, shards)


@flow(name="prepare-data", flow_run_name=flow_run_name)
def prepare_data_flow(params: PretrainParams = PretrainParams()) -> PreparedData:  # noqa: B008
    """Prepare the data of a config (ingest, tokenizer, shards) and return where it is;
    the same JSON is the flow run's `prepared-data` artifact (the `data` parameter of a
    `train-evaluate` run, to copy from the UI)."""
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    data = PreparedData.of(*prepare(params.load()))
    create_markdown_artifact(
        key="prepared-data", markdown=f"```json\n{data.model_dump_json(indent=2)}\n```",
        description="the `data` parameter of train-evaluate: manifests by path and digest")
    return data
