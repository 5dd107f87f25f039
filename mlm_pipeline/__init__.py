"""mlm-pipeline: pretrain BERT-style masked language models end to end.

One package per stage, in pipeline order: `ingest` -> `tokenizer` -> `masking` -> `shards`
-> `train` -> `evaluate` -> `tracking` (the only MLflow user), over a ground floor that
every stage may use: `config` (typed configs), `manifest` (stage manifests and digests) and
`sinks` (metric sinks). A stage imports only the ground floor and the stages before it;
nothing here imports Prefect or `flows` (`tests/unit/test_boundaries.py`).

Every stage has one contract, `verb(stage_config, input_manifests..., work_dir) -> Manifest`:
it computes its own output directory from a digest of its config and its inputs' digests,
writes its files atomically and returns a small pydantic manifest; the digest is its cache
key and lineage (docs/architecture.md has the table of stages). Importing this package
imports neither torch nor prefect.

Rooms, lowest first. The ground floor: `config` (typed configs), `config_files` (finding,
loading and printing config files), `manifest` (stage manifests and digests), `errors` (the
kinds of failure), `sinks` (metric sinks), `store` (the work directory, local or mirrored
from an object store; the cache), `locks` (one builder per stage directory), `progress`
(progress reporters). The stages: `ingest`, `tokenizer`, `masking`, `shards`, `train`,
`evaluate`, `tracking`. Above them `app` (the verbs), and `cli` (the `mlm-pipeline`
commands).
"""

__version__ = "0.1.0"
