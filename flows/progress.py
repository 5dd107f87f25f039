"""A metrics sink that shows training progress as a Prefect progress artifact."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact


class PrefectProgressSink:
    """`MetricsSink` that updates one progress artifact (percent of `max_steps`) per record.

    Args:
        max_steps: optimizer steps of the run (100 %).
        key: artifact key (lowercase letters, digits and dashes).
    """

    def __init__(self, max_steps: int, key: str = "training-progress") -> None:
        self.max_steps = max_steps
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=key, description=f"training progress (% of {max_steps} steps)"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Set the progress to `step / max_steps` (in %)."""
        update_progress_artifact(self.artifact_id, progress=100.0 * step / self.max_steps)

    def flush(self) -> None:
        """Nothing buffered."""

    def close(self) -> None:
        """Nothing to release."""
