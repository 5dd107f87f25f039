"""The `prepare-data` flow: ingest -> tokenizer -> shards (CPU work; the CPU work pool).

Each stage is a Prefect task around one library function; tasks exchange manifests. The
flow returns `PreparedData` (the three manifests by path and digest in the work directory),
what the `train-evaluate` flow takes: data prepared once serves any number of training
runs (a sweep over `train.*`, `model.*`), none of which runs a data stage again.

Caching: the data stages are cached across flow runs under the digest of their output,
computed by the library from the content of their inputs and their config (never from
paths or modification times), so a rerun of the same config shows them as Cached, and a
change reruns exactly the stages downstream of it. The cache is per work directory
(`work_dir`, resolved): another checkout or work directory builds its own outputs. A cached
manifest whose files were deleted is recomputed.

No MLflow run here: the data's lineage (digests, accounting, tokenizer) is recorded by the
training run that uses it (`train-evaluate`'s record-data task).
"""

from __future__ import annotations

import hashlib
import logging

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (
    CorpusManifest,
    ShardManifest,
    TokenizerManifest,
    find_manifest,
    stage_dir,
)
from mlm_pipeline.store import work_root
from mlm_pipeline.tracking import records as pipeline

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows.pretrain_params import PreparedData, PretrainParams, flow_run_name
from mlm_pipeline_flows.result_store import MANIFEST_RESULTS
from mlm_pipeline_flows.task_support import IO_RETRIES, data_progress

#: The flow's entry point (`prefect.yaml`).
ENTRYPOINT = "flows/prepare_data.py:prepare_data_flow"


def _in_work_dir(cfg: PipelineConfig, key: str) -> str:
    """`key` qualified by the absolute work directory (a URL one's local mirror): Prefect's
    result cache is shared by every flow run of a user (`PREFECT_HOME`), and a hit from
    another checkout would return a manifest whose files live in that checkout's work
    directory, not in this one."""
    # The directory the manifest's paths are in: a URL work directory's local mirror.
    work_dir = str(work_root(cfg.work_dir))
    return f"{key}-{hashlib.sha256(work_dir.encode()).hexdigest()[:16]}"


def _ingest_key(context, parameters) -> str:
    from mlm_pipeline.ingest import ingest_digest

    cfg = parameters["cfg"]
    return _in_work_dir(cfg, "ingest-" + ingest_digest(cfg.ingest, cfg.work_dir))


def _tokenizer_key(context, parameters) -> str:
    from mlm_pipeline.tracking.parents import tokenizer_digest_for

    cfg = parameters["cfg"]
    return _in_work_dir(cfg, "tokenizer-" + tokenizer_digest_for(cfg, parameters["corpus"]))


def _shards_key(context, parameters) -> str:
    from mlm_pipeline.shards import shards_digest

    p = parameters
    cfg = p["cfg"]
    return _in_work_dir(cfg, "shards-" + shards_digest(
        cfg.shards, p["corpus"], p["tokenizer"], cfg.masking
    ))


@task(name="ingest", cache_key_fn=_ingest_key, **MANIFEST_RESULTS, **IO_RETRIES)
def ingest_task(cfg: PipelineConfig) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus."""
    from mlm_pipeline.ingest import ingest

    return ingest(cfg.ingest, cfg.work_dir, data_progress())


@task(name="tokenizer", cache_key_fn=_tokenizer_key, **MANIFEST_RESULTS)
def tokenizer_task(cfg: PipelineConfig, corpus: CorpusManifest) -> TokenizerManifest:
    """Train the SentencePiece tokenizer on the training split (with
    `tokenizer.from_init`, reuse the `train.init_from` model's: nothing trained)."""
    from mlm_pipeline.tracking.parents import prepare_tokenizer

    return prepare_tokenizer(cfg, corpus, data_progress())


@task(name="shards", cache_key_fn=_shards_key, **MANIFEST_RESULTS)
def shards_task(
    cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest
) -> ShardManifest:
    """Encode and pack both splits into Arrow shards (plus the masked copies of the
    training split with precomputed masking, keyed by `masking.seed`)."""
    from mlm_pipeline.shards import write_shards

    return write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir, cfg.masking,
                        data_progress())


def _fresh(stage_task, cfg: PipelineConfig, *args):
    """Run a cached stage; recompute it if the cached manifest's files were deleted. A
    cached manifest whose `output_dir` is outside `cfg.work_dir` is refused (an error
    naming both), whatever the result record says."""
    args = (cfg, *args)
    manifest = stage_task(*args)
    if not pipeline.outputs_exist(manifest, cfg.work_dir):
        manifest = stage_task.with_options(refresh_cache=True)(*args)
    return manifest


def prepare(cfg: PipelineConfig) -> tuple[CorpusManifest, TokenizerManifest, ShardManifest]:
    """Run the three data stages (cached) in the current flow run; returns their manifests.
    With `data.executor: dask` the partition work (reading and cleaning input partitions,
    encoding documents) fans out on a Dask cluster (`dask_prep.prepare_partitioned`): the
    same digests and byte-identical files."""
    if cfg.data.executor == "dask":
        from mlm_pipeline_flows.dask_prep import prepare_partitioned
        return prepare_partitioned(cfg)
    corpus = _fresh(ingest_task, cfg)
    tokenizer = _fresh(tokenizer_task, cfg, corpus)
    return corpus, tokenizer, _fresh(shards_task, cfg, corpus, tokenizer)


def locate_prepared(cfg: PipelineConfig) -> PreparedData:
    """The data `prepare-data` made for `cfg` in `cfg.work_dir`, found by the stages'
    digests (the cache keys: the corpus is hashed through the work directory's hash memo,
    nothing else is read). How the `mlm-pretraining` flow finds what a `prepare-data`
    deployment run made, whatever machine ran it, when the work directory is shared.

    Raises:
        FileNotFoundError: a stage's manifest is not in the work directory (the data was
            not prepared for this config there, or it changed since: the corpus too).
        ValueError: the manifest found does not validate.
    """
    from mlm_pipeline.ingest import ingest_digest
    from mlm_pipeline.shards import shards_digest
    from mlm_pipeline.tracking.parents import tokenizer_digest_for

    def read(stage, digest, cls):
        try:  # in the work directory, or in a URL one's store
            return find_manifest(stage_dir(cfg.work_dir, stage, digest), cls, cfg.work_dir)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc}: no {stage} output for this config in work_dir "
                                    f"{cfg.work_dir} (prepare-data did not make it there)"
                                    ) from exc

    corpus = read("ingest", ingest_digest(cfg.ingest, cfg.work_dir), CorpusManifest)
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
