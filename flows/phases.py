"""The `mlm-phases` flow: the phases of one recipe in order, each an `mlm-pretraining` run
that starts from the previous phase's weights (BERT's 128 then 512, ModernBERT's context
extension: `configs/bert-base-512.yaml`, `configs/modern-base-8k.yaml`).

The chain is derived from the last phase's config through each `train.phase_of`
(`mlm_pipeline.app.phases.phase_chain`), or given in full (`phases`). Each phase after the
first runs with `train.init_from` set to the previous phase's MLflow run id
(`app.phases.child_overrides`), so its training fetches and verifies that run's final
checkpoint and records what the phase changes as its lineage (`mlm.init_*` tags). A failed
phase stops the chain. Each phase is an `mlm-pretraining` subflow of this flow run, named
as a run of its config would be, with the same `stages`.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from mlm_pipeline.app.phases import child_overrides, phase_chain
from mlm_pipeline.tracking import records as pipeline

# Absolute, under the one installed name (see flows/__init__.py), also when Prefect runs
# this file as the script of prefect.yaml's entry point.
from mlm_pipeline_flows.pretrain_params import PretrainParams, StageDeployments, flow_run_name
from mlm_pipeline_flows.pretraining import mlm_pretraining

logger = logging.getLogger(__name__)


def chain_params(params: PretrainParams) -> list[PretrainParams]:
    """The phases that end with `params`' config (`phase_chain`), parent first, each with
    `params`' overrides and typed fields; the last is `params` itself.

    Raises:
        ConfigError: the errors of `phase_chain`.
    """
    config, overrides = params.resolved()
    *parents, _ = phase_chain(config, overrides)
    return [*(params.model_copy(update={"config": name, "config_file": None})
              for name in parents), params]


@flow(name="mlm-phases", flow_run_name=flow_run_name)
def mlm_phases(
    params: PretrainParams = PretrainParams(config="bert-base-512"),  # noqa: B008
    phases: list[PretrainParams] | None = None,
    stages: StageDeployments | None = None,
) -> dict[str, Any]:
    """Run the phases of a recipe in order, each from the previous one's final weights;
    returns `{"mlflow_run_ids": [...], "phases": [...]}`, each phase's `mlm-pretraining`
    result, in order.

    Args:
        params: the last phase (its config and overrides); the phases before it are
            derived from `train.phase_of` and get the same overrides (`chain_params`).
        phases: the whole chain instead, in order (each its own config and overrides);
            `params` is then unused. The first phase starts as its config says.
        stages: the deployments each phase runs its two halves as (`mlm_pretraining`).

    Raises:
        ConfigError: the errors of `phase_chain`; then the error of the failed phase.
    """
    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    chain = list(phases) if phases else chain_params(params)
    results: list[dict[str, Any]] = []
    for i, phase in enumerate(chain):
        if results:
            phase = phase.model_copy(update={"overrides": [
                *phase.overrides, *child_overrides(results[-1]["mlflow_run_id"])]})
        cfg = phase.load()
        name = cfg.tracking.run_name or pipeline.run_name(cfg)
        logger.info("phase %d of %d: %s (%s)", i + 1, len(chain), cfg.name, name)
        results.append(mlm_pretraining.with_options(flow_run_name=name)(phase, stages))
    return {"mlflow_run_ids": [r["mlflow_run_id"] for r in results], "phases": results}
