"""`MlflowSink`: the `MetricsSink` (see `mlm_pipeline.sinks`) that sends step metrics to an
MLflow run in batches, and `_mlflow_client`, the one place an `MlflowClient` is made.

mlflow is imported lazily. Before its first import, `MLFLOW_DISABLE_TELEMETRY` is set to
`true` unless the environment sets it: MLflow 3 otherwise sends usage events to an outside
endpoint from every process, which offline workers cannot reach and users never agreed to.

Limit (MLflow 3.17 `mlflow/utils/validation.py`): 1000 metrics per `log_batch`, keys as in
`sinks.check_key`. Runs, params and artifacts are `mlm_pipeline.tracking.tracker`'s.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING

from mlm_pipeline.sinks import check_key, to_float

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

__all__ = ["MlflowSink"]

logger = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000


def _mlflow_client(tracking_uri: str) -> MlflowClient:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # why: see module docstring
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


class MlflowSink:
    """Buffers step metrics and sends them to an MLflow run with `MlflowClient.log_batch`.

    One HTTP call per value costs ~13 ms against a server, so records are sent when
    `flush_every` are waiting, when `flush_interval_s` has passed since the last send
    (checked on `log`, no background thread), on `flush()` and on `close()`; at most 1000
    metrics a send. Non-finite values are dropped and counted in `dropped_nonfinite` (MLflow
    would store `inf` as the largest double). A failed automatic send keeps the metrics for
    the next one with a warning, so an MLflow outage does not stop training; `flush()` and
    `close()` raise. Timestamps are Unix milliseconds of `log`.

    Args:
        run_id: MLflow run to log to.
        tracking_uri: MLflow tracking URI.
        flush_every: records (log calls) buffered before an automatic send.
        flush_interval_s: seconds after which the next `log` sends, however few records.
        client: an `MlflowClient` to share; None creates one for `tracking_uri`.

    Raises:
        ValueError: `flush_every` < 1 or `flush_interval_s` < 0.
    """

    def __init__(self, run_id: str, tracking_uri: str, flush_every: int = 50,
                 flush_interval_s: float = 10.0, client: MlflowClient | None = None) -> None:
        if flush_every < 1 or flush_interval_s < 0:
            raise ValueError(f"MlflowSink: flush_every={flush_every} must be >= 1 and "
                             f"flush_interval_s={flush_interval_s} >= 0")
        self.run_id, self.flush_every = run_id, flush_every
        self.flush_interval_s = flush_interval_s
        self.client = client or _mlflow_client(tracking_uri)
        from mlflow.entities import Metric

        self._metric = Metric
        self._buffer: list[Metric] = []
        self._records = 0
        self._last_send = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self.sent = 0
        """Metrics delivered to MLflow."""
        self.dropped_nonfinite: dict[str, int] = {}
        """Non-finite values dropped, by key."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Buffer one record; send when due.

        Raises:
            ValueError: a key is not MLflow-legal (see `check_key`); nothing is buffered.
            TypeError: a value is not a number.
            RuntimeError: the sink is closed.
        """
        if self._closed:
            raise RuntimeError(f"MlflowSink for run {self.run_id} is closed")
        for key in metrics:  # all keys first, so a bad one leaves nothing buffered
            check_key(key)
        values = {key: to_float(key, value) for key, value in metrics.items()}
        ts = int(time.time() * 1000)
        batch = []
        for key, v in values.items():
            if math.isfinite(v):
                batch.append(self._metric(key=key, value=v, timestamp=ts, step=int(step)))
                continue
            if key not in self.dropped_nonfinite:
                logger.warning("run %s: dropping non-finite %s=%s at step %d (counted)",
                               self.run_id, key, v, step)
            self.dropped_nonfinite[key] = self.dropped_nonfinite.get(key, 0) + 1
        with self._lock:
            self._buffer.extend(batch)
            self._records += 1
            due = (self._records >= self.flush_every
                   or len(self._buffer) >= MAX_METRICS_PER_BATCH
                   or time.monotonic() - self._last_send >= self.flush_interval_s)
        if due:
            try:
                self.flush()
            except Exception as exc:  # keep training; the buffer is retried at the next send
                logger.warning("run %s: sending %d metrics to MLflow failed, kept for retry: %s",
                               self.run_id, len(self._buffer), exc)

    def flush(self) -> None:
        """Send every buffered metric, at most 1000 per `log_batch` call.

        Raises:
            mlflow.exceptions.MlflowException: the tracking backend rejected or missed a batch;
                unsent metrics stay buffered.
        """
        with self._lock:
            try:
                while self._buffer:
                    chunk = self._buffer[:MAX_METRICS_PER_BATCH]
                    self._send(chunk)
                    del self._buffer[: len(chunk)]
                    self.sent += len(chunk)
            finally:  # also after a failure, so an outage is retried per interval, not per step
                self._records = 0
                self._last_send = time.monotonic()

    def _send(self, batch: list[Metric]) -> None:
        """One `log_batch` request (a seam for tests that count requests)."""
        self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def close(self) -> None:
        """Send what is buffered (idempotent) and log a summary of dropped values.

        Raises:
            mlflow.exceptions.MlflowException: the final send failed.
        """
        if self._closed:
            return
        self._closed = True
        if self.dropped_nonfinite:
            logger.warning("run %s: dropped non-finite metric values: %s",
                           self.run_id, self.dropped_nonfinite)
        self.flush()
