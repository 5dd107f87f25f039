"""Prefect flows of mlm-pipeline: thin wrappers that chain library stages as tasks.

Flows load a config, call one library function per task and pass manifests (small pydantic
records) between tasks, never tensors or corpora. All ML logic lives in `mlm_pipeline`.
`prepare_data.py` (the `prepare-data` flow), `train_evaluate.py` (`train-evaluate`) and
`pretraining.py` (`mlm-pretraining`, chaining them) are the entry points; `pretrain_params`,
`task_support`, `tracking_tasks` and `result_store` are what they share.

In a checkout this folder is the package `flows` (prefect.yaml's entrypoints load
`flows/<module>.py`); the wheel installs it as `mlm_pipeline_flows`, so no module here
imports another as `flows.x`: each imports its neighbours relatively, else (Prefect loads an
entry point as a plain script, with this folder on `sys.path` meanwhile) as top-level
modules, so their names must not clash with an installed package.
"""
