"""Stage 7, tracking: the one package that talks to MLflow (imported lazily), and nothing
else: it imports neither `train` nor `evaluate`. Work that needs a model and MLflow
(re-scoring the champion, resolving a warm-start parent, the tracked training run) and the
verbs that read or clean up after runs are in `mlm_pipeline.app`, above the stages.

Rooms: `tracker` (`MlflowTracker`: run lifecycle, params, tags, artifacts; tracking URIs),
`sink` (`MlflowSink`: batched step metrics), `records` (what a pipeline run records:
params, lineage tags, data accounting and results), `lineage` (the shards as MLflow
dataset inputs), `fill_mask_table` (the run's fill-mask table), `plots` (`plots/loss.png`),
`resume` (the records of continuing unfinished runs), `registry` (logging and registering
the model, writing the registry's decisions, promoting), `version_lineage` (a model
version's parent, data and steps as its tags), `fetch` (a run's checkpoint and tokenizer
fetched to this machine), `failures` (which MLflow errors a retry cures).
"""

from mlm_pipeline.tracking.sink import MlflowSink
from mlm_pipeline.tracking.tracker import (
    MlflowTracker,
    git_commit,
    resolve_tracking_uri,
    sqlite_db_path,
)

__all__ = ["MlflowSink", "MlflowTracker", "git_commit", "resolve_tracking_uri",
           "sqlite_db_path"]
