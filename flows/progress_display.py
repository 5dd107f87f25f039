"""Where the flow's stages report progress, and the terminal's live display of it.

The library reports through `mlm_pipeline.progress.Progress`; the flow's data tasks take the
reporter `current()` returns (beside the Prefect progress artifacts). `mlm-pipeline run`
sets it for its run (`display`): in a terminal, `RichProgress`, one live `rich` line per
stage with the log lines printed above the bars; otherwise nothing is set and the tasks use
`LogProgress` (log lines at a bounded rate), as under a deployment. Training reports through
its metrics sink instead: `SinkRecordHandler` turns the `StdoutSink` records into a `train`
line. Tasks of a local run execute in the CLI's process, so a module-level value reaches
them. This module imports neither prefect nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichBars
from rich.table import Column

from mlm_pipeline.progress import Progress, describe

_CURRENT: Progress | None = None
#: Columns of `RichProgress` before its status: stage 17, bar 12, percent 4, ETA 7, and
#: the four spaces between them.
_FIXED_COLUMNS = 17 + 12 + 4 + 7 + 4
#: Sink keys shown on the `train` line, and their names there.
_TRAIN_FIELDS = {"train/loss": "loss", "train/tokens_per_s": "tokens/s"}


def current() -> Progress | None:
    """The reporter `mlm-pipeline run` set for this process (None: none was set)."""
    return _CURRENT


@contextlib.contextmanager
def using(progress: Progress | None) -> Iterator[None]:
    """Make `progress` the one `current()` returns while the block runs."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, progress
    try:
        yield
    finally:
        _CURRENT = previous


class RichProgress:
    """A `Progress` drawn as `rich` bars, one line per stage: stage, bar, percent, ETA
    (the time taken once done), then the count in its units and the fields, cut to the
    terminal's width (80 columns leave them 36 characters). Thread-safe (rich's lock).

    Args:
        console: where to draw; None: a new `Console()` on stdout.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.bars = RichBars(
            TextColumn("[bold]{task.description}", table_column=Column(width=17, no_wrap=True)),
            BarColumn(bar_width=12), TaskProgressColumn(),
            TimeRemainingColumn(elapsed_when_finished=True),
            TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True)),
            console=console, redirect_stdout=True, redirect_stderr=True)
        self._tasks: dict[str, tuple[int, str, dict]] = {}

    def _status(self, completed: float, total: float | None, unit: str, fields: dict) -> str:
        """The count and fields, cut to the terminal's room (else rich squeezes the bar)."""
        text = describe(completed, total, unit, fields, percent=False)
        room = max(16, self.bars.console.width - _FIXED_COLUMNS)
        return text if len(text) <= room else text[: room - 1] + "…"

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        """Add the stage's line (restarted if the stage was shown before)."""
        if stage in self._tasks:
            self.bars.remove_task(self._tasks[stage][0])
        task = self.bars.add_task(stage, total=total, status=self._status(0, total, unit, {}))
        self._tasks[stage] = (task, unit, {})

    def update(self, stage: str, completed: float, **fields: float | str) -> None:
        """Move the stage's bar to `completed` and show `fields` beside it."""
        if stage not in self._tasks:
            return
        task, unit, shown = self._tasks[stage]
        shown.update(fields)
        total = self.bars.tasks[self._index(task)].total
        self.bars.update(task, completed=completed,
                         status=self._status(completed, total, unit, shown))

    def finish(self, stage: str, **fields: float | str) -> None:
        """Fill the bar (to the total when known) and keep the line, stopped."""
        if stage not in self._tasks:
            return
        task, unit, shown = self._tasks[stage]
        shown.update(fields)
        t = self.bars.tasks[self._index(task)]
        done = t.total if t.total is not None else t.completed
        self.bars.update(task, completed=done, total=done,
                         status=self._status(done, t.total, unit, shown))
        self.bars.stop_task(task)

    def _index(self, task: int) -> int:
        """The position of task id `task` in `bars.tasks`."""
        return next(i for i, t in enumerate(self.bars.tasks) if t.id == task)


class SinkRecordHandler(logging.Handler):
    """Turns `StdoutSink` records (`step %d | key value | ...`) into stage `train` of a
    `Progress`: steps of `max_steps`, with `loss` and `tokens/s` (`_TRAIN_FIELDS`).

    Args:
        progress: where to report.
        max_steps: the run's `train.max_steps` (None: unknown).
    """

    def __init__(self, progress: Progress, max_steps: int | None) -> None:
        super().__init__()
        self.progress, self.max_steps, self.started = progress, max_steps, False

    def emit(self, record: logging.LogRecord) -> None:
        """Report the record's step and fields (other records are ignored)."""
        if record.msg != "step %d | %s" or not isinstance(record.args, tuple):
            return
        step, text = record.args
        fields: dict[str, float | str] = {}
        for part in str(text).split(" | "):
            key, _, value = part.rpartition(" ")
            if key in _TRAIN_FIELDS:
                with contextlib.suppress(ValueError):
                    fields[_TRAIN_FIELDS[key]] = float(value.replace(",", ""))
        if not self.started:
            total = float(self.max_steps) if self.max_steps else None
            self.progress.start("train", total, "steps", "optimizer steps")
            self.started = True
        self.progress.update("train", float(step), **fields)


class _HideSinkLines(logging.Filter):
    """Keeps the step lines of `StdoutSink` off the terminal (the `train` bar shows them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a `StdoutSink` step line, True for every other record."""
        return record.msg != "step %d | %s"


def _terminal_handlers() -> list[logging.Handler]:
    """The handlers that write to the terminal: non-file stream handlers (`RunConsole`) and
    those drawing through a `rich` console (Prefect's `PrefectConsoleHandler`)."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(getattr(h, "console", None), Console) or (
                isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler))]


@contextlib.contextmanager
def display(max_steps: int | None, terminal: bool | None = None) -> Iterator[Progress | None]:
    """The progress display of one `mlm-pipeline run`.

    In a terminal (`terminal`, default: stdout is one), `RichProgress` becomes `current()`,
    training's sink records feed its `train` line, and the log lines of Prefect's console
    handlers are printed above the bars (their step lines left out). Otherwise nothing is
    changed (the tasks use `LogProgress`). Yields the reporter set, or None.
    """
    if not (sys.stdout.isatty() if terminal is None else terminal):
        yield None
        return
    rich_progress = RichProgress()
    handler = SinkRecordHandler(rich_progress, max_steps)
    sinks_logger = logging.getLogger("mlm_pipeline.sinks")
    hide = _HideSinkLines()
    terminal_handlers = _terminal_handlers()
    consoles = [h for h in terminal_handlers if isinstance(getattr(h, "console", None), Console)]
    with rich_progress.bars:
        # Prefect's consoles hold the stderr of their creation: give them rich's proxy, which
        # prints above the live bars (a plain stream handler writing to the `sys.stderr` of
        # the moment gets it anyway).
        files = [h.console.file for h in consoles]
        for h in consoles:
            h.console.file = sys.stderr
        for h in terminal_handlers:
            h.addFilter(hide)
        sinks_logger.addHandler(handler)
        try:
            with using(rich_progress):
                yield rich_progress
        finally:
            sinks_logger.removeHandler(handler)
            for h, f in zip(consoles, files):
                h.console.file = f
            for h in terminal_handlers:
                h.removeFilter(hide)
