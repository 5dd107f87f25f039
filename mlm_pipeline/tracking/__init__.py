"""Stage 7, tracking: the one package that talks to MLflow (imported lazily); it imports
neither `train` nor `evaluate`. Work that needs a model and MLflow, and the verbs that read
or clean up after runs, are in `mlm_pipeline.app`, above the stages.

Rooms: `tracker` (`MlflowTracker`, tracking URIs), `sink` (`MlflowSink`), `records` (what a
pipeline run records), `lineage` (shards as dataset inputs), `fill_mask_table`, `plots`,
`resume` (continuing unfinished runs), `registry` (the model and the registry's decisions),
`version_lineage` (a version's parent and data), `fetch` (a run's checkpoint fetched here),
`failures` (which MLflow errors a retry cures).
"""

from mlm_pipeline.tracking.sink import MlflowSink
from mlm_pipeline.tracking.tracker import (
    MlflowTracker, git_commit, resolve_tracking_uri, sqlite_db_path)

__all__ = ["MlflowSink", "MlflowTracker", "git_commit", "resolve_tracking_uri",
           "sqlite_db_path"]
