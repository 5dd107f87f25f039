"""Prefect flows of mlm-pipeline: thin wrappers that chain library stages as tasks.

Flows load a config, call one library function per task and pass manifests (small pydantic
records) between tasks, never tensors or corpora. All ML logic lives in `mlm_pipeline`.
"""
