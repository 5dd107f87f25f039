"""Data preparation on a Dask cluster (`data.executor: dask`): ingestion and shard encoding
fan out over input partitions as Prefect tasks on `prefect_dask.DaskTaskRunner`.

`prepare_partitioned(cfg)` runs the subflow `prepare-data-dask` on a local cluster of
`data.workers` processes, or on the cluster at `data.dask_address` (whose workers must see
the sources and the work directory at the same paths: a shared file system, or a URL work
directory with the same cache directory and credentials, `mlm_pipeline.store`). In it,
`read-partition` tasks read and clean input partitions (`mlm_pipeline.ingest.partitions`)
and `encode-partition` tasks encode row ranges of the splits (`mlm_pipeline.shards.parallel`);
the merge, the tokenizer training and the packing run in this process, in input order.

The outputs are those of the single-process stages, byte for byte, under the same digests
(tests/integration/test_partitioned_prep.py, tests/flows/test_dask_prep.py), so either path
reuses the other's. Partition results travel back through Dask, all of a stage's submitted
at once: size `data.partitions` so that a partition's text fits comfortably in memory.

Needs the `dask` extra (`pip install -e ".[dask]"`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import CorpusManifest, ShardManifest, TokenizerManifest

#: Partitions per Dask worker when `data.partitions` is None (room to balance uneven ones).
PARTITIONS_PER_WORKER = 4


@task(name="partition", cache_policy=NO_CACHE, persist_result=False)
def partition_task(fn: Callable[[Any], Any], item: Any, work_dir: str) -> Any:
    """`fn(item)` on a Dask worker (`fn`: `read_partition` or `encode_partition` bound to its
    config); not cached: the stage around it is. A URL `work_dir` gets its local mirror on
    the worker first (`store.work_root`), so a partition's documents come from the store."""
    from mlm_pipeline.store import work_root

    work_root(work_dir)
    return fn(item)


def task_mapper(name: str, work_dir: str
                ) -> Callable[[Callable[[Any], Any], list[Any]], Iterator[Any]]:
    """A `Mapper` (`mlm_pipeline.ingest.partitions.Mapper`) that submits one `name` task per
    item to the flow's task runner at once and yields the results in the items' order.

    Raises:
        Exception: the first failed partition's error, when its result is reached.
    """
    named = partition_task.with_options(name=name)

    def mapper(fn: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
        for future in named.map(unmapped(fn), items, unmapped(work_dir)):
            yield future.result()

    return mapper


def dask_task_runner(cfg: PipelineConfig):
    """The `DaskTaskRunner` of `cfg.data`: the cluster at `dask_address`, else a local one of
    `workers` processes, one thread each (SentencePiece and the cleaning hold the GIL in
    turns; processes use the cores), no dashboard.

    Raises:
        ImportError: `prefect-dask` is not installed (the `dask` extra).
    """
    from prefect_dask import DaskTaskRunner

    if cfg.data.dask_address:
        return DaskTaskRunner(address=cfg.data.dask_address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": cfg.data.workers, "processes": True,
                                          "threads_per_worker": 1, "dashboard_address": None})


def partition_count(cfg: PipelineConfig) -> int:
    """`data.partitions`, else `PARTITIONS_PER_WORKER` per local worker."""
    return cfg.data.partitions or PARTITIONS_PER_WORKER * cfg.data.workers


@flow(name="prepare-data-dask", persist_result=False, validate_parameters=False)
def dask_prep_flow(cfg: PipelineConfig) -> tuple[CorpusManifest, TokenizerManifest,
                                                 ShardManifest]:
    """Ingest, tokenizer and shards with the partition work on this flow's task runner
    (module docstring); returns the three manifests (each reused when already made)."""
    from mlm_pipeline.ingest import ingest, read_holdout
    from mlm_pipeline.ingest.partitions import partitioned
    from mlm_pipeline.shards import write_shards
    from mlm_pipeline.shards.parallel import partitioned_encoder
    from mlm_pipeline.tokenizer import Tokenizer
    from mlm_pipeline.app.parents import prepare_tokenizer

    n = partition_count(cfg)
    corpus = ingest(cfg.ingest, cfg.work_dir,
                    accounting=partitioned(task_mapper("read-partition", cfg.work_dir), n),
                    holdout=read_holdout(cfg))
    tokenizer = prepare_tokenizer(cfg, corpus)
    encode = partitioned_encoder(Tokenizer.load(tokenizer).path, cfg.shards,
                                 task_mapper("encode-partition", cfg.work_dir), n)
    shards = write_shards(cfg.shards, corpus, tokenizer, cfg.work_dir, cfg.masking,
                          encode=encode)
    return corpus, tokenizer, shards


def prepare_partitioned(cfg: PipelineConfig) -> tuple[CorpusManifest, TokenizerManifest,
                                                      ShardManifest]:
    """Run `dask_prep_flow` on `dask_task_runner(cfg)` (the `prepare-data` flow's path for
    `data.executor: dask`): the same manifests and files as the single-process stages.

    Raises:
        ImportError: the `dask` extra is not installed.
        The errors of `ingest`, `train_tokenizer` and `write_shards`; a partition's error.
    """
    return dask_prep_flow.with_options(task_runner=dask_task_runner(cfg))(cfg)
