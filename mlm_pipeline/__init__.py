"""mlm-pipeline: pretrain BERT-style masked language models end to end.

Rooms, lowest first. The ground floor, which every stage may use: `config` (typed
configs), `config_files` (finding, loading and printing config files), `manifest` (stage
manifests and digests), `errors` (the kinds of failure), `sinks` (metric sinks), `store`
(the work directory, local or mirrored from an object store; the cache), `locks` (one
builder per stage directory), `progress` (progress reporters). The stages, in pipeline
order: `ingest`, `tokenizer`, `masking`, `shards`, `train`, `evaluate`, `tracking` (the
only MLflow user). Above them `app` (the verbs), and `cli` (the `mlm-pipeline` commands).
A stage imports only the ground floor and the stages before it; nothing here imports
Prefect or `flows` (`tests/unit/test_boundaries.py`), and importing this package imports
neither torch nor prefect.

Every stage has one contract, `verb(stage_config, input_manifests..., work_dir) -> Manifest`:
it computes its own output directory from a digest of its config and its inputs' digests,
writes its files atomically and returns a small pydantic manifest; the digest is its cache
key and lineage (docs/architecture.md has the table of stages).
"""

__version__ = "0.1.0"
