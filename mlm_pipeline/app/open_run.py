"""Which MLflow run a pipeline run trains in: a new one, or this job's unfinished one
continued (the policy of `tracking.resume` and `tracking.resume_run_id`, over the resume
records of `mlm_pipeline.tracking.resume`).

The flows call `open_or_continue` at the start of a run (`flows/tracking_tasks.py`) and
`record_data` once the data is prepared; nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from mlm_pipeline.app.training_run import train_dir
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import CorpusManifest, ShardManifest, TokenizerManifest
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking import records as pipeline


class OpenedRun(NamedTuple):
    """The MLflow run a pipeline run goes on in: its id, and whether it is an earlier run
    continued (it keeps its own name) or a new one."""

    run_id: str
    continued: bool


def newest_checkpoint(cfg: PipelineConfig, run_id: str) -> Path | None:
    """The newest intact checkpoint of MLflow run `run_id`'s training, or None."""
    from mlm_pipeline.train.checkpoint import latest_intact_checkpoint

    return latest_intact_checkpoint(train_dir(cfg, run_id) / "checkpoints")


def open_or_continue(cfg: PipelineConfig, tracker: MlflowTracker, run_tags: dict[str, str],
                     *, fresh: bool = False, run_name: str | None = None) -> OpenedRun:
    """Open the MLflow run, or continue this job's unfinished one (`tracking.resume`,
    `tracking.resume_run_id`; see `mlm_pipeline.tracking.resume`).

    Args:
        cfg: the run's config (its params and job key are recorded on the run).
        tracker: the MLflow backend.
        run_tags: tags every opened or continued run gets (`records.run_tags`); the
            process and job-key tags are added here.
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
    def newest(run_id: str) -> Path | None:
        """`newest_checkpoint` of this config."""
        return newest_checkpoint(cfg, run_id)

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
    name = cfg.tracking.run_name or run_name or pipeline.run_name(cfg)
    return OpenedRun(tracker.start_run(params, tags, run_name=name), False)


def record_data(tracker: MlflowTracker, run_id: str, corpus: CorpusManifest,
                tokenizer: TokenizerManifest, shards: ShardManifest,
                reopen: Callable[[], str]) -> str:
    """Record the data a run trains on (`records.record_data`: lineage, accounting, the
    tokenizer; once per run: a continued run already has them). A continued run whose
    data changed since (a corpus update: another shards digest) is closed KILLED with a
    note, and `reopen()` opens the run that takes over; returns the id of the run that
    goes on."""
    recorded = tracker.get_run(run_id).data.tags.get("digest.shards")
    if recorded == shards.digest:
        return run_id
    if recorded is not None:
        tracker.set_tags(run_id, {"mlflow.note.content": (
            f"Not continued: the training data changed (shards {recorded[:12]} -> "
            f"{shards.digest[:12]}); a new run trains on the new data.")})
        tracker.end_run(run_id, "KILLED")
        run_id = reopen()
    pipeline.record_data(tracker, run_id, corpus, tokenizer, shards)
    return run_id
