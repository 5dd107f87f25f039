"""Stage 7, tracking: the MLflow tracker (mlflow imported lazily); the verbs that read or
clean up after runs (runs/compare, gc, fill-mask/export, the run log) are in
`mlm_pipeline.app`, above the stages.

Rooms: `tracker` (`MlflowTracker`: run lifecycle, params, tags, artifacts; tracking URIs),
`sink` (`MlflowSink`: batched step metrics), `records` (what a pipeline run records:
params, lineage tags, data accounting and results; the run summary is
`mlm_pipeline.app.summary`), `lineage` (the shards
as MLflow dataset inputs), `periodic` (the periodic evaluator of a tracked run and the
fill-mask table), `plots` (`plots/loss.png`), `resume` (the records of continuing
unfinished runs), `registry` (logging, registering and promoting the model).
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
