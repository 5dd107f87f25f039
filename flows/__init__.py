"""Prefect flows of mlm-pipeline: thin wrappers that chain library stages as tasks.

Flows load a config, call one library function per task and pass manifests (small pydantic
records) between tasks, never tensors or corpora. All ML logic lives in `mlm_pipeline`.

In a checkout this folder is the package `flows` (prefect.yaml's entrypoints load
`flows/pretraining.py`); the wheel installs it as `mlm_pipeline_flows`, so no module here
imports another as `flows.x` (`cli.py` uses a relative import; `pretraining.py`, which
Prefect also loads as a plain script, imports only `result_store`: relatively, else as a
top-level module from its own folder, which Prefect puts on `sys.path` while loading it).
"""
