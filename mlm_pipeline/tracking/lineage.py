"""The training and validation shards as MLflow dataset inputs of a run.

MLflow 3 keeps a run's datasets as run *inputs* (`MlflowClient.log_inputs`), each tagged
`mlflow.data.context` (`training`, `validation`): the UI's dataset view, and
`search_runs(filter_string="dataset.digest = '...'")` finds the runs on the same data. The
digest is `ShardManifest.digest` cut to MLflow's 36 characters (`MAX_DATASET_DIGEST_SIZE`
in MLflow 3.17 `mlflow/utils/validation.py`); the full digest stays in the run tag
`digest.shards`. mlflow is imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mlm_pipeline import store
from mlm_pipeline.manifest import ShardManifest, ShardSplit

if TYPE_CHECKING:
    from mlflow.entities import DatasetInput

__all__ = ["CONTEXTS", "DIGEST_CHARS", "dataset_digest", "shard_inputs"]

#: MLflow's longest dataset digest (MLflow 3.17 `MAX_DATASET_DIGEST_SIZE`).
DIGEST_CHARS = 36
#: Split of the shards -> MLflow input context (`mlflow.data.context`).
CONTEXTS = {"train": "training", "validation": "validation"}


def dataset_digest(shards: ShardManifest) -> str:
    """The digest under which both splits of `shards` are logged: the first 36 hex
    characters of `shards.digest` (search runs with `dataset.digest = '<this>'`)."""
    return shards.digest[:DIGEST_CHARS]


def _schema(shards: ShardManifest, split: ShardSplit) -> str:
    """The Arrow columns as an MLflow tensor-spec schema: `input_ids` (rows, seq_len) of
    the shards' dtype, plus `labels` (int32, -100 where not predicted) for precomputed
    masked copies (layout: `mlm_pipeline.shards.format`)."""
    import numpy as np
    from mlflow.types import Schema, TensorSpec

    specs = [TensorSpec(np.dtype(shards.dtype), (-1, shards.seq_len), "input_ids")]
    if split.masked_copies:
        specs.append(TensorSpec(np.dtype("int32"), (-1, shards.seq_len), "labels"))
    return json.dumps({"mlflow_tensorspec": {"features": Schema(specs).to_json(),
                                             "targets": None}})


def shard_inputs(shards: ShardManifest, name_prefix: str = "shards") -> list[DatasetInput]:
    """One `DatasetInput` for each split of `shards`, ready for `MlflowClient.log_inputs`.

    Args:
        shards: the shards stage's manifest.
        name_prefix: dataset names are `<prefix>-train` and `<prefix>-validation`.

    Returns:
        [training input, validation input]: name, digest (`dataset_digest`), source (the
        shards directory as a `file://` URI, source type `local`), schema (`_schema`) and
        profile (JSON: `rows`, `tokens` = rows x seq_len, `documents`, `seq_len`, `files`,
        `masked_copies`), tagged `mlflow.data.context` = `training` / `validation`.
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    source = store.remote_url(shards.output_dir) or Path(shards.output_dir).resolve().as_uri()
    inputs = []
    for split_name, context in CONTEXTS.items():
        split: ShardSplit = getattr(shards, split_name)
        profile = {"rows": split.rows, "tokens": split.rows * shards.seq_len,
                   "documents": split.documents, "seq_len": shards.seq_len,
                   "files": len(split.shards), "masked_copies": split.masked_copies}
        dataset = Dataset(name=f"{name_prefix}-{split_name}", digest=dataset_digest(shards),
                          source_type="local", source=json.dumps({"uri": source}),
                          schema=_schema(shards, split), profile=json.dumps(profile))
        inputs.append(DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    return inputs
