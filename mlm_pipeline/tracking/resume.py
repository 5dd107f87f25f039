"""Which MLflow run a rerun continues, and what may change when it does.

A killed pretraining run is continued by running the same command again (the same config,
deployment parameters, or Prefect's retry of the task). The run is found by its *job key*
(`job_key`), stored as the tag `mlm.job_key`: of the experiment's runs with it, the newest
that is not FINISHED, whose process is gone and that has an intact checkpoint in
`<work_dir>/train/<run id>/checkpoints` is continued (`find_resumable`). A FINISHED run is
never continued; `tracking.resume: never` (`--fresh`) starts a new run.

Settings that do not change what the steps compute (`COMPATIBLE`) may differ and are
recorded as tags; any other difference in `train`, `model` or `masking` refuses to
continue, naming the fields (`config_changes`).

The budget (`train.max_steps`, `plan`): continuing never goes back; a larger budget is
recorded in `mlm.resume.<n>` and the tag `mlm.max_steps` (MLflow params are immutable). A
run whose training reached its budget and that failed after it (evaluation, model logging,
registration) is *finished* by a rerun with the same `train.max_steps`: only what is
missing is done (no second final evaluation point, logged model or model version).

A run whose process may be alive is never touched: runs record `mlm.host` and `mlm.pid`. A
RUNNING run of another host is left alone too (nothing here can tell whether it still
trains): name it with `tracking.resume_run_id` to take it over once its machine is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlm_pipeline import store
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.errors import NonFiniteLossError, ResumeRefusedError, TrainingInterrupted
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)

JOB_KEY_TAG = "mlm.job_key"
#: Set when a continued run's budget differs from its (immutable) param `train.max_steps`.
MAX_STEPS_TAG = "mlm.max_steps"
HOST_TAG, PID_TAG = "mlm.host", "mlm.pid"
#: Flattened params that a continued run may change: they do not alter what a step computes.
COMPATIBLE = frozenset({
    "train.max_steps", "train.max_time_s", "train.log_every", "train.checkpoint_every",
    "train.checkpoint_interval_s", "train.keep_last_checkpoints", "train.num_threads",
    "train.verify_shards", "train.compile", "train.nonfinite", "train.max_skipped_steps",
    "train.warmup_in_effect"})
#: Sections whose other params must be equal to continue a run.
_CHECKED_PREFIXES = ("train.", "model.", "masking.")


def job_key(cfg: PipelineConfig) -> str:
    """Hex sha256 identifying a job for resumption: config name, experiment, absolute work
    directory (or its URL) and the data sections (`ingest`, `tokenizer`, `shards`)."""
    identity = {"name": cfg.name, "experiment": cfg.tracking.experiment_name,
                "work_dir": store.work_id(cfg.work_dir)}
    for section in ("ingest", "tokenizer", "shards"):
        identity[section] = getattr(cfg, section).model_dump(mode="json")
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def process_tags() -> dict[str, str]:
    """`mlm.host` and `mlm.pid` of this process (to tell a live run from a dead one)."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def config_changes(old: Mapping[str, str], new: Mapping[str, object]
                   ) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """Compare a run's logged params with the params of a rerun.

    Args:
        old: the MLflow run's params (strings).
        new: the rerun's flattened params (`records.run_params`), any values.

    Returns:
        (compatible, incompatible): `{key: (old value, new value)}` of the `train.`,
        `model.` and `masking.` params that differ, split by `COMPATIBLE`; a param only one
        side has counts as a difference, with `<unset>` for the missing side.
    """
    compatible, incompatible = {}, {}
    keys = {k for k in (*old, *new) if k.startswith(_CHECKED_PREFIXES)}
    for key in sorted(keys):
        before = old.get(key, "<unset>")
        after = str(new[key]) if key in new else "<unset>"
        if before != after:
            (compatible if key in COMPATIBLE else incompatible)[key] = (before, after)
    return compatible, incompatible


def _alive(tags: Mapping[str, str], run_id: str = "") -> bool:
    """True when the run's process may still exist: it is on this host and exists, or it
    is on another host (which no check here can reach; logged, with how to take it over)."""
    host = tags.get(HOST_TAG)
    if host and host != socket.gethostname():
        logger.info("MLflow run %s is RUNNING on host %s: left alone (it may still be "
                    "training); once that machine is gone, continue it with "
                    "tracking.resume_run_id=%s", run_id, host, run_id)
        return True
    pid = tags.get(PID_TAG, "")
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Resumable:
    """The run a rerun continues.

    Attributes:
        run_id: the MLflow run.
        status: its status before the rerun (`RUNNING`, `FAILED` or `KILLED`).
        checkpoint: its newest intact checkpoint directory.
        compatible: params that change (`{key: (old, new)}`), recorded on the run.
        finish: its training reached its budget: only the end stages are left.
    """

    run_id: str
    status: str
    checkpoint: Path
    compatible: dict[str, tuple[str, str]] = field(default_factory=dict)
    finish: bool = False

    @property
    def step(self) -> int:
        """The optimizer step of `checkpoint`."""
        return checkpoint_step(self.checkpoint)


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step of a checkpoint directory (`step-00000060` -> 60)."""
    return int(checkpoint.name.split("-")[-1])


def run_budget(params: Mapping[str, str], tags: Mapping[str, str]) -> int | None:
    """The `train.max_steps` a run trained towards: its param, or the value the newest
    `mlm.resume.<n>` tag changed it to; None when unknown (not logged)."""
    budget = params.get("train.max_steps")
    resumes = sorted((int(k.rsplit(".", 1)[1]), v) for k, v in tags.items()
                     if k.startswith("mlm.resume.") and k.rsplit(".", 1)[1].isdigit())
    for _, record in resumes:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            change = json.loads(record).get("changed", {}).get("train.max_steps")
            if change:
                budget = change["to"]
    return int(budget) if budget is not None and str(budget).isdigit() else None


def plan(run_id: str, step: int, budget: int | None, max_steps: int,
         named: bool = False) -> str:
    """How a rerun with `train.max_steps` = `max_steps` goes on with unfinished run
    `run_id`, whose newest checkpoint is at `step` and whose budget was `budget`.

    Returns:
        `finish` (its training reached the budget and the rerun asks for the same: only
        the end stages are left), `train` (continue training to `max_steps`, at or above
        the budget) or `new` (its training is complete and the rerun asks for another
        budget: start a new run).

    Raises:
        ResumeRefusedError: `max_steps` is at or below `step` (going back), below the
            budget of a training that has steps left (cutting its schedule short), or the
            run was named (`named`, `tracking.resume_run_id`) and the plan would be `new`.
    """
    if budget is not None and step >= budget:
        if max_steps == step:
            return "finish"
        if named:
            raise ResumeRefusedError(
                f"cannot continue MLflow run {run_id} with train.max_steps={max_steps}: it "
                f"trained all its {budget} steps, and only train.max_steps={budget} "
                "finishes it; start a new run with --fresh (tracking.resume=never)")
        return "new"
    if max_steps <= step:
        raise ResumeRefusedError(
            f"cannot continue MLflow run {run_id} from step {step} with "
            f"train.max_steps={max_steps}: a continued run never goes back; start a new run "
            f"with --fresh (tracking.resume=never), give train.max_steps above {step}, or "
            "name another run with tracking.resume_run_id")
    if budget is not None and max_steps < budget:
        raise ResumeRefusedError(
            f"cannot continue MLflow run {run_id} (checkpoint at step {step} of "
            f"{budget}) with train.max_steps={max_steps}: a continued run keeps or raises "
            f"its budget; give train.max_steps={budget} or more, start a new run with "
            "--fresh (tracking.resume=never), or name another run with "
            "tracking.resume_run_id")
    return "train"


def find_resumable(
    tracker: MlflowTracker, cfg: PipelineConfig, params: Mapping[str, object],
    newest_checkpoint: Callable[[str], Path | None],
) -> Resumable | None:
    """The unfinished run of this job to continue, or None to start a new one.

    Args:
        tracker: the tracker of the experiment.
        cfg: the rerun's config (`job_key`).
        params: the rerun's flattened params (compared with the run's).
        newest_checkpoint: run id -> its newest intact checkpoint, or None.

    Returns:
        The newest run with this job key that is not FINISHED, whose process is gone (a
        RUNNING run of another host counts as alive), that has a checkpoint and that is not
        a complete training of another `train.max_steps` (`plan`); None when there is none.
        Dead RUNNING runs without a checkpoint are closed KILLED on the way.

    Raises:
        ValueError: the run was trained with incompatible settings (named, with what to do).
        ResumeRefusedError: `train.max_steps` is at or below the checkpoint's step (`plan`).
    """
    key = job_key(cfg)
    runs = tracker.client.search_runs(
        [tracker.experiment_id()], filter_string=f"tags.`{JOB_KEY_TAG}` = '{key}'",
        order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        status, run_id = run.info.status, run.info.run_id
        if status == "FINISHED" or (status == "RUNNING" and _alive(run.data.tags, run_id)):
            continue
        checkpoint = newest_checkpoint(run_id)
        if checkpoint is None:
            if status == "RUNNING":
                tracker.end_run(run_id, "KILLED")
                tracker.set_tags(run_id, {"mlflow.note.content": (
                    "Closed KILLED by a later run of the same config: its process was gone "
                    "and it had no checkpoint to continue from.")})
            continue
        step, max_steps = checkpoint_step(checkpoint), int(params["train.max_steps"])
        budget = run_budget(run.data.params, run.data.tags)
        if budget is not None and step >= budget and max_steps != step:  # plan: "new"
            logger.info(
                "MLflow run %s trained all its %d steps and is %s: not continued with "
                "train.max_steps=%d, a new run starts (train.max_steps=%d finishes it)",
                run_id, budget, status, max_steps, budget)
            continue
        compatible, incompatible = config_changes(run.data.params, params)
        if incompatible:
            changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in incompatible.items())
            raise ValueError(
                f"cannot continue MLflow run {run_id} (unfinished, checkpoint "
                f"{checkpoint.name}): these settings differ: {changes}. Run the same config "
                "to continue it, or start a new run with --fresh (tracking.resume=never)")
        how = plan(run_id, step, budget, max_steps)
        return Resumable(run_id, status, checkpoint, compatible, how == "finish")
    return None


def logged_steps(tracker: MlflowTracker, run_id: str) -> dict[str, int]:
    """The highest step at which each metric key was logged on the run (keys the run never
    logged are absent): a continued run sends, key by key, only later steps
    (`sinks.AfterStepSink`), so an evaluation point a kill interrupted still arrives."""
    keys = tracker.client.get_run(run_id).data.metrics
    return {key: max((m.step for m in tracker.client.get_metric_history(run_id, key)),
                     default=0) for key in keys}


def continue_run(tracker: MlflowTracker, run_id: str, params: Mapping[str, object],
                 tags: Mapping[str, str], step: int,
                 changes: Mapping[str, tuple[str, str]] | None = None,
                 finish: bool = False) -> None:
    """Reopen `run_id` (status RUNNING) to continue it from checkpoint `step` (`finish`: only
    the end stages are left; said in the log line).

    Params the run lacks are logged; changed params keep their first value (MLflow params
    are immutable) and are recorded, with the step and time, in a tag `mlm.resume.<n>` (n =
    1, 2, ... per resume); a changed `train.max_steps` is also the tag `mlm.max_steps`;
    `tags` and the tracker's `bookkeeping_tags` are set.

    Raises:
        ValueError: the run is FINISHED (a finished run is never continued) or unknown.
    """
    import time

    try:
        run = tracker.get_run(run_id)
    except Exception as exc:  # mlflow.exceptions.MlflowException
        raise ValueError(f"cannot continue MLflow run {run_id!r}: {exc}") from exc
    if run.info.status == "FINISHED":
        raise ValueError(f"MLflow run {run_id} is FINISHED: a finished run is never continued "
                         "(start a new run: leave tracking.resume_run_id unset)")
    old = run.data.params
    changed = {k: (old[k], str(v)) for k, v in params.items() if k in old and old[k] != str(v)}
    changed |= dict(changes or {})
    number = 1 + sum(1 for k in run.data.tags if k.startswith("mlm.resume."))
    record = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "previous_status": run.info.status,
              "changed": {k: {"from": a, "to": b} for k, (a, b) in sorted(changed.items())}}
    tracker.client.update_run(run_id, status="RUNNING")
    tracker.log_params(run_id, {k: v for k, v in params.items() if k not in old})
    budget = ({MAX_STEPS_TAG: changed["train.max_steps"][1]}
              if "train.max_steps" in changed else {})
    tracker.set_tags(run_id, {**tracker.bookkeeping_tags, **tags, **budget,
                              f"mlm.resume.{number}": json.dumps(record)})
    how = ("finishing MLflow run %s: its training reached step %d, only what is missing "
           "after training is done" if finish else "continuing MLflow run %s from step %d")
    logger.info(how + " (resume %d; --fresh starts a new run instead)", run_id, step, number)


def failure_tags(exc: BaseException) -> tuple[str, dict[str, str]]:
    """The status and tags that record why a run ended abnormally.

    Returns:
        (`KILLED` for an interruption (`KeyboardInterrupt`, `TrainingInterrupted`), else
        `FAILED`; tags `mlm.error` ("Class: message"), `mlm.stop_reason` (`interrupted`,
        `nonfinite` or `error`), `mlm.error_step` and
        `mlm.last_checkpoint` when the exception knows them, and `mlflow.note.content`,
        the run's description in the UI, saying what happened and how to continue).
    """
    name = type(exc).__name__
    interrupted = isinstance(exc, KeyboardInterrupt | TrainingInterrupted)
    message = str(exc).strip() or name
    tags = {"mlm.error": f"{name}: {message}"[:2000],
            "mlm.stop_reason": ("interrupted" if interrupted else
                                "nonfinite" if isinstance(exc, NonFiniteLossError)
                                else "error")}
    step = getattr(exc, "step", None)
    checkpoint = getattr(exc, "checkpoint", None) or getattr(exc, "last_checkpoint", None)
    if step is not None:
        tags["mlm.error_step"] = str(step)
    if checkpoint is not None:
        tags["mlm.last_checkpoint"] = str(checkpoint)
    what = "Interrupted" if interrupted else "Failed"
    note = [f"**{what}**" + (f" at step {step}" if step is not None else "") + f": {message}"]
    if checkpoint is not None:
        note.append(f"Last good checkpoint: `{checkpoint}`.")
    if interrupted or checkpoint is not None:
        note.append("Run the same command (or deployment) again to continue this run.")
    tags["mlflow.note.content"] = "\n\n".join(note)
    return ("KILLED" if interrupted else "FAILED"), tags


def close_runs_of_flow_run(tracker: MlflowTracker, flow_run_id: str, status: str,
                           note: str) -> list[str]:
    """End the RUNNING MLflow runs tagged with Prefect flow run `flow_run_id` (a cancelled
    or crashed flow run whose process could not close its run); returns their ids."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id()],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'", max_results=10)
    closed = []
    for run in runs:
        if run.info.status == "RUNNING":
            tracker.set_tags(run.info.run_id, {"mlflow.note.content": note,
                                               "mlm.error": f"flow run {status.lower()}"})
            tracker.end_run(run.info.run_id, status)
            closed.append(run.info.run_id)
    return closed


def log_missing_metrics(tracker: MlflowTracker, run_id: str, metrics: Mapping[str, float],
                        step: int) -> dict[str, float]:
    """Log the `metrics` the run does not hold at `step` yet (a finished run's end stages
    done again keep one point per key and step); returns those logged."""
    missing = {k: v for k, v in metrics.items()
               if all(m.step != step for m in tracker.client.get_metric_history(run_id, k))}
    if missing:
        tracker.log_metrics(run_id, missing, step=step)
    return missing
