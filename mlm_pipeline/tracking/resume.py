"""Which MLflow run a rerun continues, and what may change when it does.

A killed pretraining run is continued by running the same command again: the same config
(`mlm-pipeline run`, the same deployment parameters, or Prefect's retry of the task). The
run to continue is found by its *job key* (`job_key`): a digest of the config's name, the
experiment, the resolved work directory and the data sections (`ingest`, `tokenizer`,
`shards`), stored on the run as the tag `mlm.job_key`. Among the runs of the experiment with
that tag, the newest that is not FINISHED, whose process is gone and that has an intact
checkpoint in `<work_dir>/train/<run id>/checkpoints` is continued (`find_resumable`). A
FINISHED run is never continued; `tracking.resume: never` (`--fresh`) starts a new run.

What may differ from the continued run (`config_changes`): settings that do not change what
the steps compute (`COMPATIBLE`: more steps, the time cap, logging and checkpoint cadence,
threads, evaluation and tracking settings) are recorded as tags; any other difference in
`train`, `model` or `masking` refuses to continue, naming the fields.

A run whose process is alive is never touched: runs record `mlm.host` and `mlm.pid`, and a
RUNNING run of this host whose process still exists is left alone (two runs at once start
two MLflow runs). A RUNNING run of another host is left alone too, since nothing here can
tell whether it still trains (a shared MLflow server, an `s3://` work directory): name it
with `tracking.resume_run_id` to take it over once its machine is gone. A RUNNING run of a
dead process without a checkpoint is closed KILLED.
"""

from __future__ import annotations

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
from mlm_pipeline.errors import NonFiniteLossError, TrainingInterrupted
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)

JOB_KEY_TAG = "mlm.job_key"
HOST_TAG, PID_TAG = "mlm.host", "mlm.pid"
#: Flattened params that a continued run may change: they do not alter what a step computes.
COMPATIBLE = frozenset({
    "train.max_steps", "train.max_time_s", "train.log_every", "train.checkpoint_every",
    "train.checkpoint_interval_s", "train.keep_last_checkpoints", "train.num_threads",
    "train.verify_shards", "train.compile", "train.nonfinite", "train.max_skipped_steps",
    "train.warmup_in_effect",
})
#: Sections whose other params must be equal to continue a run.
_CHECKED_PREFIXES = ("train.", "model.", "masking.")


def job_key(cfg: PipelineConfig) -> str:
    """Hex sha256 identifying a job for resumption: config name, experiment, absolute work
    directory (or its URL) and the data sections (`ingest`, `tokenizer`, `shards`)."""
    identity = {
        "name": cfg.name,
        "experiment": cfg.tracking.experiment_name,
        "work_dir": store.work_id(cfg.work_dir),
        "ingest": cfg.ingest.model_dump(mode="json"),
        "tokenizer": cfg.tokenizer.model_dump(mode="json"),
        "shards": cfg.shards.model_dump(mode="json"),
    }
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
    if not tags.get(PID_TAG, "").isdigit():
        return False
    pid = int(tags[PID_TAG])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
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
    """

    run_id: str
    status: str
    checkpoint: Path
    compatible: dict[str, tuple[str, str]] = field(default_factory=dict)


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
        RUNNING run of another host counts as alive) and that has a checkpoint; None when
        there is none. Dead RUNNING runs without a
        checkpoint are closed KILLED on the way (nothing to continue).

    Raises:
        ValueError: the run to continue was trained with incompatible settings (the
            differing params are named, with what to do).
    """
    key = job_key(cfg)
    runs = tracker.client.search_runs(
        [tracker.experiment_id()], filter_string=f"tags.`{JOB_KEY_TAG}` = '{key}'",
        order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        status = run.info.status
        if status == "FINISHED" or (status == "RUNNING" and _alive(run.data.tags,
                                                                   run.info.run_id)):
            continue
        checkpoint = newest_checkpoint(run.info.run_id)
        if checkpoint is None:
            if status == "RUNNING":
                tracker.end_run(run.info.run_id, "KILLED")
                tracker.set_tags(run.info.run_id, {"mlflow.note.content": (
                    "Closed KILLED by a later run of the same config: its process was gone "
                    "and it had no checkpoint to continue from.")})
            continue
        compatible, incompatible = config_changes(run.data.params, params)
        if incompatible:
            changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in incompatible.items())
            raise ValueError(
                f"cannot continue MLflow run {run.info.run_id} (unfinished, checkpoint "
                f"{checkpoint.name}): these settings differ: {changes}. Run the same config "
                "to continue it, or start a new run with --fresh (tracking.resume=never)")
        return Resumable(run.info.run_id, status, checkpoint, compatible)
    return None


def last_logged_step(tracker: MlflowTracker, run_id: str, key: str = "train/loss") -> int:
    """The highest step at which `key` was logged on the run, 0 if never: a continued run
    sends only later steps, so every step keeps exactly one value."""
    history = tracker.client.get_metric_history(run_id, key)
    return max((m.step for m in history), default=0)


def continue_run(tracker: MlflowTracker, run_id: str, params: Mapping[str, object],
                 tags: Mapping[str, str], step: int,
                 changes: Mapping[str, tuple[str, str]] | None = None) -> None:
    """Reopen `run_id` (status RUNNING) to continue it from checkpoint `step`.

    Params the run lacks are logged; params whose value changed (compatible ones, and
    settings outside `train`/`model`/`masking`) keep their first value (MLflow params are
    immutable) and are recorded, with the step and time, in a tag `mlm.resume.<n>`
    (n = 1, 2, ... per resume); `tags` are set.

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
    tracker.set_tags(run_id, {**tags, f"mlm.resume.{number}": json.dumps(record)})
    logger.info("continuing MLflow run %s from step %d (resume %d)", run_id, step, number)


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
