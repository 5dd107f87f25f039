"""A check the tests of every end-stage path share: each metric of an MLflow run holds one
point per step in its history (a model logged, the model skipped, a run resumed, end
stages retried), read back through `MlflowClient.get_metric_history`."""

from __future__ import annotations

from collections import Counter


def repeated_steps(client, run_id: str) -> dict[str, dict[int, int]]:
    """Metric key -> {step: number of points} for every step of the run's history that
    holds more than one point of that key (empty: one point per step everywhere)."""
    repeated = {}
    for key in client.get_run(run_id).data.metrics:
        counts = Counter(m.step for m in client.get_metric_history(run_id, key))
        if twice := {step: n for step, n in counts.items() if n > 1}:
            repeated[key] = twice
    return repeated


def assert_one_point_per_step(client, run_id: str) -> int:
    """Assert that every metric of the run holds one point per step; returns how many
    metric keys were read (so a caller can check the run is not empty)."""
    repeated = repeated_steps(client, run_id)
    assert not repeated, f"run {run_id}: metrics with several points at a step: {repeated}"
    return len(client.get_run(run_id).data.metrics)
