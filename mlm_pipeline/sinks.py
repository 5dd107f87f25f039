"""Metrics sinks without MLflow: the training loop's way out for metrics (STYLE rule 8).

The loop builds one `dict[str, float]` per log interval and hands it to a `MetricsSink`:
`StdoutSink` (a log line), `JsonlSink` (a local file), `mlm_pipeline.tracking.sink.MlflowSink`
(batched MLflow calls) or a `MultiSink` of several. `check_key` holds the metric-key rule
every sink shares, so a key that MLflow would reject fails in the first test, not at the end
of a long run. This module imports neither mlflow, torch nor prefect.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

logger = logging.getLogger(__name__)

#: Longest metric or param key MLflow accepts (MLflow 3.17 `utils/validation.py`).
MAX_KEY_LENGTH = 250
#: Portable subset of MLflow's key characters (MLflow also allows `:` except on Windows).
_KEY_RE = re.compile(r"[A-Za-z0-9_\-. /]+")


@functools.lru_cache(maxsize=4096)  # valid keys repeat every step; errors are not cached
def check_key(key: str) -> None:
    """Check that `key` is a legal, portable MLflow metric or param key.

    Raises:
        ValueError: the key is empty, longer than 250 characters, holds a character other
            than alphanumerics, `_ - . /` and space, or is not a normalized relative path
            (`a//b`, `a/`, `./a`, `../a`, `/a`: MLflow may store keys as file paths).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"metric/param key {key!r}: must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"metric/param key {key!r}: longer than {MAX_KEY_LENGTH} characters")
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"metric/param key {key!r}: only alphanumerics, '_', '-', '.', '/' "
                         "and space are allowed by MLflow")
    norm = posixpath.normpath(key)
    if norm != key or norm == "." or norm.startswith(("..", "/")):
        raise ValueError(f"metric/param key {key!r}: not a normalized relative path ({norm!r})")


def to_float(key: str, value: Any) -> float:
    """`float(value)` (numbers, numpy and 0-d torch scalars).

    Raises:
        TypeError: `value` is not a number (the metric key is named).
    """
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: value {value!r} is not a number") from None


def format_value(value: float) -> str:
    """Compact human form: `12,345` from 1000 up, `1.0e-03` below 0.01, else 4 digits."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) < 1e-2:
        return f"{value:.1e}"
    return f"{value:.4g}"


class MetricsSink(Protocol):
    """Where the training loop's metrics go (STYLE rule 8)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` (key -> value, units in the key) at optimizer step `step`."""

    def flush(self) -> None:
        """Deliver whatever is buffered."""

    def close(self) -> None:
        """Flush and release resources; the sink takes no more records."""


class StdoutSink:
    """One compact log line per record, e.g. `step 120 | train/loss 5.123 | train/lr 1.0e-03`.

    Args:
        level: logging level of the lines.
        log: logger to write to; None uses this module's logger.
    """

    def __init__(self, level: int = logging.INFO, log: logging.Logger | None = None) -> None:
        self.level, self.logger = level, log or logger

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log one line: the step, then `key value` pairs in the given order."""
        if self.logger.isEnabledFor(self.level):
            parts = [f"{k} {format_value(float(v))}" for k, v in metrics.items()]
            self.logger.log(self.level, "step %d | %s", step, " | ".join(parts))

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        """Nothing to release."""


class JsonlSink:
    """One JSON object per record, `{"step": ..., **metrics}`, one per line.

    Non-finite values are written as `null` so every line is strict JSON (RFC 8259 has no
    NaN). Lines reach the disk on `flush()` and `close()`.

    Args:
        path: file to write; parent directories are created.
        append: keep existing records (a resumed run) instead of truncating.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append one record.

        Raises:
            ValueError: a key is not MLflow-legal (see `check_key`) or is `step`.
            TypeError: a value is not a number.
            RuntimeError: the sink is closed.
        """
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path}) is closed")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            check_key(key)
            if key == "step":
                raise ValueError("metric key 'step' collides with the record's step field")
            v = to_float(key, value)
            record[key] = v if math.isfinite(v) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def flush(self) -> None:
        """Push buffered lines to the operating system."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class MultiSink:
    """Fan records out to several sinks; keys are checked once before any sink writes."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Check every key, then log to each sink in order.

        Raises:
            ValueError: a key is not MLflow-legal (see `check_key`); no sink has written.
        """
        for key in metrics:
            check_key(key)
        for sink in self.sinks:
            sink.log(metrics, step)

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Close every sink, even when one fails; then re-raise the first error."""
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


class AfterStepSink:
    """Pass on only the metrics of steps after those a sink already holds, key by key: a
    resumed run re-trains the steps between its checkpoint and the kill, which the sink must
    not get twice; per key, so that a point the sink lacks at a held step (an evaluation the
    kill interrupted) still arrives, and every key keeps exactly one value per step.

    Args:
        sink: the sink to forward to.
        step: the last step the sink holds, per metric key (`{"train/loss": 40,
            "eval/loss": 30}`; a key not listed holds nothing), or one step for every key.
    """

    def __init__(self, sink: MetricsSink, step: int | Mapping[str, int]) -> None:
        self.sink = sink
        self.held: dict[str, int] = dict(step) if isinstance(step, Mapping) else {}
        self.default = 0 if isinstance(step, Mapping) else int(step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Forward the metrics of `metrics` whose key the sink does not hold at `step`
        (nothing when none is left)."""
        fresh = {k: v for k, v in metrics.items() if step > self.held.get(k, self.default)}
        if fresh:
            self.sink.log(fresh, step)

    def flush(self) -> None:
        """Flush the wrapped sink."""
        self.sink.flush()

    def close(self) -> None:
        """Close the wrapped sink."""
        self.sink.close()
