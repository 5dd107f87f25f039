"""Which MLflow run a pipeline run trains in: a new one, or this job's unfinished one
continued (the policy of `tracking.resume` and `tracking.resume_run_id`, over the resume
records of `mlm_pipeline.tracking.resume`).

The flows call `open_or_continue` at the start of a run (`flows/tracking_tasks.py`), with
the tags that name the flow run; nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline


class OpenedRun(NamedTuple):
    """The MLflow run a pipeline run goes on in: its id, and whether it is an earlier run
    continued (it keeps its own name) or a new one."""

    run_id: str
    continued: bool


def open_or_continue(cfg: PipelineConfig, tracker: MlflowTracker, run_tags: dict[str, str],
                     newest: Callable[[str], Path | None], *, fresh: bool = False,
                     run_name: str | None = None) -> OpenedRun:
    """Open the MLflow run, or continue this job's unfinished one (`tracking.resume`,
    `tracking.resume_run_id`; see `mlm_pipeline.tracking.resume`).

    Args:
        cfg: the run's config (its params and job key are recorded on the run).
        tracker: the MLflow backend.
        run_tags: tags every opened or continued run gets (`records.run_tags`); the
            process and job-key tags are added here.
        newest: the newest intact checkpoint of an MLflow run id (None: none).
        fresh: never continue (`--fresh`); `tracking.resume_run_id` still does.
        run_name: the name of a new run when the config sets none (the flow run's);
            None: `records.run_name`.

    Returns:
        The run's id, and whether it was continued.

    Raises:
        ValueError: `tracking.resume_run_id` names a run whose settings differ in a way
            that cannot be continued (the fields named).
        ResumeRefusedError: a `train.max_steps` at or below the step it would continue
            from (before any data stage).
    """
    params = pipeline.run_params(cfg)
    tags = {**run_tags, **resume.process_tags(), resume.JOB_KEY_TAG: resume.job_key(cfg)}
    if cfg.tracking.resume_run_id:
        run_id = cfg.tracking.resume_run_id
        _, incompatible = resume.config_changes(tracker.get_run(run_id).data.params, params)
        if incompatible:
            raise ValueError(f"cannot continue MLflow run {run_id}: these settings differ: "
                             + ", ".join(f"{k} {a!r} -> {b!r}"
                                         for k, (a, b) in incompatible.items()))
        checkpoint = newest(run_id)
        step = 0 if checkpoint is None else resume.checkpoint_step(checkpoint)
        run = tracker.get_run(run_id)
        how = resume.plan(run_id, step, resume.run_budget(run.data.params, run.data.tags),
                          cfg.train.max_steps, named=True)
        resume.continue_run(tracker, run_id, params, tags, step, finish=how == "finish")
        return OpenedRun(run_id, True)
    if cfg.tracking.resume == "auto" and not fresh:
        found = resume.find_resumable(tracker, cfg, params, newest)
        if found is not None:
            resume.continue_run(tracker, found.run_id, params, tags, found.step,
                                found.compatible, finish=found.finish)
            return OpenedRun(found.run_id, True)
    name = cfg.tracking.run_name or run_name
    return OpenedRun(tracker.start_run(params, tags, run_name=name or pipeline.run_name(cfg)),
                     False)
