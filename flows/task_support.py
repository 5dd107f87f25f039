"""What the flows' tasks share: Prefect progress artifacts, the data tasks' progress
reporter, and the task options for retries (`IO_RETRIES`, `retry_condition`) and no
caching (`NOT_CACHED`).
"""

from __future__ import annotations

import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from mlm_pipeline.progress import LogProgress, MultiProgress, Progress
from mlm_pipeline.tracking.failures import retry_cures

from mlm_pipeline_flows.progress_display import current as current_progress


class PrefectProgressSink:
    """`MetricsSink` that updates one progress artifact (percent of `max_steps`) per record.

    Args:
        max_steps: optimizer steps of the run (100 %).
        key: artifact key (lowercase letters, digits and dashes).
    """

    def __init__(self, max_steps: int, key: str = "training-progress") -> None:
        self.max_steps = max_steps
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=key, description=f"training progress (% of {max_steps} steps)")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Set the progress to `step / max_steps` (in %)."""
        update_progress_artifact(self.artifact_id, progress=100.0 * step / self.max_steps)

    def flush(self) -> None:
        """Nothing buffered."""

    def close(self) -> None:
        """Nothing to release."""


class PrefectProgressArtifacts:
    """`mlm_pipeline.progress.Progress` that keeps one progress artifact per stage with a
    known total (key `<stage>-progress`, e.g. `ingest-progress`, `shards-train-progress`:
    percent done), updated at most once per `interval_s` seconds, and at 100 % at the end.

    Args:
        interval_s: least seconds between two updates of one artifact.
    """

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._stages: dict[str, list] = {}  # stage -> [artifact id, total, last update]

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Create the stage's artifact at 0 % (none when `total` is unknown or 0)."""
        if not total:
            return
        key = "-".join("".join(c if c.isalnum() else " " for c in stage.lower()).split())
        artifact = create_progress_artifact(
            progress=0.0, key=f"{key}-progress",
            description=f"{stage}: % of {total:,.0f} {unit}" + (
                f" ({description})" if description else ""))
        self._stages[stage] = [artifact, total, time.monotonic()]

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Set the percent done, when `interval_s` has passed since the last update."""
        if (s := self._stages.get(stage)) and time.monotonic() - s[2] >= self.interval_s:
            s[2] = time.monotonic()
            update_progress_artifact(s[0], progress=min(100.0, 100.0 * completed / s[1]))

    def finish(self, stage: str, **fields: float | str) -> None:
        """Set 100 %."""
        if (s := self._stages.pop(stage, None)) is not None:
            update_progress_artifact(s[0], progress=100.0)


def data_progress() -> Progress:
    """The data tasks' reporter: Prefect progress artifacts, plus the display `mlm-pipeline
    run` set (`progress_display.current()`) or, when none is (a deployment, a test), log
    lines at a bounded rate."""
    return MultiProgress(PrefectProgressArtifacts(), current_progress() or LogProgress())


def retry_condition(task, task_run, state) -> bool:
    """A task's `retry_condition_fn`: retry only what a second try can cure (network, I/O,
    an MLflow server error; `mlm_pipeline.tracking.failures.retry_cures`, by type), never a
    config error, a missing dependency, a compile failure or damaged input."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - classified by type below
        return retry_cures(exc)
    return False


#: Options of a task that talks to a server or a disk: two retries for transient errors.
IO_RETRIES = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": retry_condition}
#: Options of a task whose result is neither cached nor persisted.
NOT_CACHED = {"cache_policy": NO_CACHE, "persist_result": False}
