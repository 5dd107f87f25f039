"""Progress of the long stages, reported through a callback the library is given (as metrics
go through a `sinks.MetricsSink`), so the library stays free of `rich` and Prefect.

A stage reports in the units a user thinks in (bytes read, documents, rows, ...):
`start(stage, total, unit)` once, `update(stage, completed, **fields)` with the absolute
count so far (never decreasing) and extra fields such as `kept=`, and `finish(stage)`. Stage
names are free text (`ingest`, `shards train`); several stages may be open at once. The
terminal's `rich` bars and the Prefect progress artifacts live in `flows/`. A stage reached
through a function it does not call directly (the corpus fetch, under
`ingest.resolve_sources`) finds its reporter with `active()`, set by `reporting(progress)`.
This module imports neither torch, rich nor prefect.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from mlm_pipeline.sinks import format_value

logger = logging.getLogger(__name__)

#: Seconds between two log lines of one stage in `LogProgress` (first and last always).
LOG_INTERVAL_S = 10.0


class Progress(Protocol):
    """Where a stage reports how far it is (module docstring)."""

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Open `stage`: `total` units of `unit` to do (None when unknown until the end)."""

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """`completed` units of `stage` are done (absolute, never less than before);
        `fields` are extra figures shown beside it (`kept=`, `dropped=`, `phase=`)."""

    def finish(self, stage: str, **fields: float | str) -> None:
        """`stage` is done: its count becomes its total (when known) and it is closed."""


class NullProgress:
    """A `Progress` that reports nothing (the default of every stage)."""

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Nothing."""

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Nothing."""

    def finish(self, stage: str, **fields: float | str) -> None:
        """Nothing."""


def describe(completed: float, total: float | None, unit: str,
             fields: dict[str, float | str], percent: bool = True) -> str:
    """Human form of one progress state, e.g. `1,234/5,000 documents (24.7 %) | kept 1,200`
    (the percentage only with `percent` and a known total).

    Counts use `sinks.format_value`; bytes are shown in MiB.
    """
    scale, shown = (2.0**20, "MiB") if unit == "bytes" else (1.0, unit)

    def num(x: float) -> str:
        return f"{x / scale:,.1f}" if scale != 1.0 else format_value(float(x))

    text = f"{num(completed)}/{num(total)} {shown}" if total is not None else (
        f"{num(completed)} {shown}")
    if total and percent:
        text += f" ({100.0 * completed / total:.1f} %)"
    extra = " | ".join(f"{k} {format_value(float(v)) if isinstance(v, int | float) else v}"
                       for k, v in fields.items())
    return f"{text} | {extra}" if extra else text


class LogProgress:
    """Log lines at a bounded rate, for output that is not a terminal (CI, `| tee`, a
    deployment): the first update of a stage, then at most one line per `interval_s`
    seconds per stage, and the last (at `finish`).

    Args:
        interval_s: least seconds between two lines of one stage.
        log: logger to write to (INFO); None uses this module's.
        clock: monotonic clock in seconds (tests give a fake one).
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S, log: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.logger, self.clock = interval_s, log or logger, clock
        self._stages: dict[str, dict] = {}

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Remember the stage; the first line comes with its first update."""
        self._stages[stage] = {"total": total, "unit": unit, "description": description,
                               "completed": 0.0, "fields": {}, "last": None, "t0": self.clock()}

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Record the state; log it when it is the stage's first or `interval_s` has passed
        since the last line."""
        s = self._stages.get(stage)
        if s is None:
            return
        s["completed"], s["fields"] = completed, {**s["fields"], **fields}
        now = self.clock()
        if s["last"] is None or now - s["last"] >= self.interval_s:
            s["last"] = now
            self._line(stage, s, "")

    def finish(self, stage: str, **fields: float | str) -> None:
        """Log the final line (count = total when known, and the seconds taken)."""
        s = self._stages.pop(stage, None)
        if s is None:
            return
        if s["total"] is not None:
            s["completed"] = s["total"]
        s["fields"] = {**s["fields"], **fields}
        self._line(stage, s, f" | done in {self.clock() - s['t0']:.1f} s")

    def _line(self, stage: str, s: dict, tail: str) -> None:
        what = f"{stage} ({s['description']})" if s["description"] else stage
        self.logger.info("progress: %s: %s%s", what,
                         describe(s["completed"], s["total"], s["unit"], s["fields"]), tail)


class MultiProgress:
    """Fan progress out to several reporters, in order."""

    def __init__(self, *reporters: Progress) -> None:
        self.reporters = reporters

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Start `stage` on every reporter."""
        for r in self.reporters:
            r.start(stage, total, unit, description)

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Update `stage` on every reporter."""
        for r in self.reporters:
            r.update(stage, completed, **fields)

    def finish(self, stage: str, **fields: float | str) -> None:
        """Finish `stage` on every reporter."""
        for r in self.reporters:
            r.finish(stage, **fields)


_ACTIVE: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "mlm_pipeline_progress", default=None)


@contextlib.contextmanager
def reporting(progress: Progress | None) -> Iterator[None]:
    """Make `progress` the one `active()` returns in this context (the corpus fetch, reached
    through `resolve_sources`, reports to it)."""
    token = _ACTIVE.set(progress)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> Progress:
    """The reporter set by the innermost `reporting`, else a `NullProgress`."""
    return _ACTIVE.get() or NullProgress()
