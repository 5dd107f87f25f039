"""Prefect flows of mlm-pipeline: thin wrappers that chain library stages as tasks.

Flows load a config, call one library function per task and pass manifests (small pydantic
records) between tasks, never tensors or corpora. All ML logic lives in `mlm_pipeline`.
`prepare_data.py` (the `prepare-data` flow), `train_evaluate.py` (`train-evaluate`) and
`pretraining.py` (`mlm-pretraining`, chaining them) and `phases.py` (`mlm-phases`, a
recipe's phases one after the other) are the entry points; `pretrain_params`,
`task_support` and `tracking_tasks` are what they share. `alerts` creates the Prefect
automations an operator needs (`mlm-pipeline alerts install`), `console` is the command.

One name: this folder is installed (pyproject.toml, editable or wheel) as the package
`mlm_pipeline_flows`, and every module here imports its neighbours absolutely under that
name. prefect.yaml's entry points name the files (`flows/pretraining.py:mlm_pretraining`);
Prefect runs such a file as a script, whose absolute imports then reach the installed
package, so one process never holds two copies of a module (two `PretrainParams` classes
that pydantic would tell apart). Importing the folder as `flows` would make that second
copy, so it is refused here.
"""

if __name__ != "mlm_pipeline_flows":
    raise ImportError(
        f"the flows package is imported as `mlm_pipeline_flows`, not `{__name__}`: "
        "install the project (pip install -e .) and import mlm_pipeline_flows.<module>")
