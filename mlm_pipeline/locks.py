"""Concurrent runs sharing a work directory: one builder per stage directory, temporary
names unique per process, stale temporaries removed only when their owner is gone.

A stage builds its directory `<work_dir>/<stage>/<digest[:16]>` under `stage_lock(out_dir)`,
an exclusive lock on `<work_dir>/.locks/<stage>-<digest[:16]>.lock` (`filelock`: `flock(2)`
on Linux, which the kernel releases when its holder exits, even by SIGKILL, so a killed run
never blocks the next). A run that finds the lock taken waits, then checks the manifest
again and reuses what the other run built. The lock file is outside the stage directory, so
a failed build may remove its directory.

Temporaries are named `.<name>.<pid>-<random>.tmp` (`temp_path`): two processes or threads
never share one. While a process holds a stage's lock no other writes there, so every
temporary there belongs to a process that ended or gave the lock back:
`remove_stale_temporaries` deletes them (this process's own are kept), only under the lock.
This module imports neither torch nor prefect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)
M = TypeVar("M")

#: A temporary name made by `temp_path`: `.<name>.<pid>-<random>.tmp`.
_TEMP = re.compile(r"^\..*\.(?P<pid>\d+)-[0-9a-z_]+\.tmp$")
#: Temporary names of versions before this module (no pid): `.NAME.tmp`, `.tmp-XXXX`.
_LEGACY_TEMP = re.compile(r"^\.(.*\.tmp|tmp-.*)$")


def lock_path(out_dir: str | os.PathLike[str]) -> Path:
    """The lock file of stage directory `<work_dir>/<stage>/<name>`:
    `<work_dir>/.locks/<stage>-<name>.lock`."""
    out = Path(out_dir)
    return out.parent.parent / ".locks" / f"{out.parent.name}-{out.name}.lock"


@contextlib.contextmanager
def stage_lock(out_dir: str | os.PathLike[str], what: str = "stage") -> Iterator[None]:
    """Hold the inter-process lock of `out_dir` (created with its parents) until the block
    ends; waits as long as another process holds it, logging once that it waits.

    Args:
        out_dir: the stage directory (it need not exist).
        what: the stage's name, for the log line.
    """
    path = lock_path(out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        started = time.monotonic()
        logger.info("%s: another run is building %s (lock %s held); waiting for it",
                    what, out_dir, path)
        lock.acquire()
        logger.info("%s: %s released after %.1f s", what, path, time.monotonic() - started)
    try:
        yield
    finally:
        lock.release()


def reuse_or_build(out_dir: str | os.PathLike[str], what: str, load: Callable[[], M | None],
                   build: Callable[[], M]) -> tuple[M, bool]:
    """The stage's manifest: reused when `load()` finds a complete, verified one, else
    built by `build()` under `stage_lock(out_dir)` (checking `load()` again once the lock is
    held, so a run that waited reuses what the other run built).

    Args:
        out_dir: the stage directory.
        what: the stage's name, for log lines.
        load: returns the reusable manifest, or None.
        build: builds the directory and returns its manifest.

    Returns:
        (the manifest, whether it was reused rather than built here).
    """
    if (found := load()) is not None:
        return found, True
    with stage_lock(out_dir, what):  # one builder; the others wait, then reuse
        found = load()
        return (found, True) if found is not None else (build(), False)


def temp_path(final: str | os.PathLike[str]) -> Path:
    """A temporary name beside `final`, unique to this process and call:
    `.<name>.<pid>-<16 hex>.tmp` in the same directory (so `os.replace` is atomic)."""
    p = Path(final)
    return p.with_name(f".{p.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp")


def remove_stale_temporaries(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporaries other processes left in `out_dir` (files or directories named
    by `temp_path`, or by earlier versions: `.NAME.tmp`, `.tmp-*`); call it only while
    holding `stage_lock(out_dir)`, which proves their owners gone (see the module docstring).

    Returns:
        The paths removed (logged), in name order; none when `out_dir` does not exist.
    """
    out = Path(out_dir)
    if not out.is_dir():
        return []
    removed = []
    for entry in sorted(out.iterdir()):
        m = _TEMP.match(entry.name)
        if m is None and not _LEGACY_TEMP.match(entry.name):
            continue
        if m is not None and int(m.group("pid")) == os.getpid():
            continue  # this process's own (another thread's, or an open one)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d temporaries left in %s by runs that ended (%s)",
                    len(removed), out, ", ".join(p.name for p in removed))
    return removed
