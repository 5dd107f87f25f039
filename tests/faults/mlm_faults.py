"""Faults that tests inject into the training library, which knows nothing of them.

Each fault replaces one library function with a wrapper that misbehaves once, at the point
the test names; the library holds no test hook and reads no test variable (STYLE rule 15).

- In the test's own process: pass `monkeypatch.setattr` as `patch`, so pytest undoes it,
  e.g. `nan_at_step(3, monkeypatch.setattr)`.
- In fresh processes (the `mlm-pipeline` CLI, torchrun's ranks): give the child the
  variables of `child_env(...)`. They put this folder on the child's `PYTHONPATH`, whose
  `sitecustomize.py` calls `install_from_env()` at interpreter start-up; that patches each
  named module right after it is first imported, so a child that never imports it (a
  Prefect server, the torchrun launcher) pays nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: This folder: what `child_env` puts first on a child's `PYTHONPATH`.
FAULTS_DIR = Path(__file__).resolve().parent

#: Test-only variables, read only by `install_from_env` (never by the library).
NAN_AT_STEP = "MLM_FAULT_NAN_AT_STEP"  # "STEP"
KILL_IN_CHECKPOINT = "MLM_FAULT_KILL_IN_CHECKPOINT"  # "STEP"
FAIL_RANK_AT_STEP = "MLM_FAULT_FAIL_RANK_AT_STEP"  # "RANK:STEP"

Patch = Callable[[Any, str, Any], None]

_LOOP = "mlm_pipeline.train.loop"
_CHECKPOINT = "mlm_pipeline.train.checkpoint"


def nan_at_step(step: int, patch: Patch = setattr) -> None:
    """Make the loss of optimizer step `step` (1-based: the step the loop is about to
    apply) NaN, the first time that step is tried: the gradients stay the batch's, the
    summed loss becomes NaN before the loop checks it, as a numeric blow-up would."""
    loop = importlib.import_module(_LOOP)
    train_step, accumulate = loop.train_step, loop.accumulate_gradients
    trying: list[int] = []
    fired: list[int] = []

    def tracked_train_step(parts, cfg):
        trying[:] = [parts.train_state.step + 1]
        return train_step(parts, cfg)

    def nan_accumulate(*args, **kwargs):
        loss_sum, masked = accumulate(*args, **kwargs)
        if trying == [step] and not fired:
            fired.append(step)
            loss_sum = loss_sum * float("nan")
        return loss_sum, masked

    patch(loop, "train_step", tracked_train_step)
    patch(loop, "accumulate_gradients", nan_accumulate)


def fail_rank_at_step(rank: int, step: int, patch: Patch = setattr) -> None:
    """Make rank `rank` raise `RuntimeError("injected fault: ...")` when it starts optimizer
    step `step` (1-based), before it reads the step's batches."""
    loop = importlib.import_module(_LOOP)
    train_step = loop.train_step

    def failing_train_step(parts, cfg):
        if parts.world.rank == rank and parts.train_state.step + 1 == step:
            raise RuntimeError(f"injected fault: rank {rank} fails at step {step}")
        return train_step(parts, cfg)

    patch(loop, "train_step", failing_train_step)


def kill_in_checkpoint(step: int, patch: Patch = setattr) -> None:
    """SIGKILL this process while it writes the checkpoint of step `step`: right after the
    first file of its temporary directory is written and fsynced, before `state.json`."""
    checkpoint = importlib.import_module(_CHECKPOINT)
    fsync = checkpoint._fsync
    temporary = f".{checkpoint.checkpoint_name(step)}."

    def dying_fsync(path):
        fsync(path)
        path = Path(path)
        if path.parent.name.startswith(temporary) and path.name != checkpoint._JSON:
            os.kill(os.getpid(), signal.SIGKILL)

    patch(checkpoint, "_fsync", dying_fsync)


def child_env(nan_at_step: int | None = None, kill_in_checkpoint: int | None = None,
              fail_rank_at_step: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment variables that inject the named faults into child processes
    (add them to the child's environment, or `monkeypatch.setenv` each for the children
    of library code); `PYTHONPATH` keeps the entries the test process was given."""
    env = {"PYTHONPATH": os.pathsep.join(
        [str(FAULTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if nan_at_step is not None:
        env[NAN_AT_STEP] = str(nan_at_step)
    if kill_in_checkpoint is not None:
        env[KILL_IN_CHECKPOINT] = str(kill_in_checkpoint)
    if fail_rank_at_step is not None:
        env[FAIL_RANK_AT_STEP] = "{}:{}".format(*fail_rank_at_step)
    return env


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs the installs registered for a module right after it is first executed."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        installs = self.pending.pop(fullname)  # once; and not in the way of the lookup below
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_then_patch(module):
            execute(module)
            for install in installs:
                install()

        spec.loader.exec_module = exec_then_patch
        return spec


_FINDER = _PatchOnImport()


def _when_imported(name: str, install: Callable[[], None]) -> None:
    if name in sys.modules:
        install()
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.pending.setdefault(name, []).append(install)


def install_from_env() -> None:
    """Inject the faults `child_env` named (tests/faults/sitecustomize.py calls this)."""
    env = os.environ
    if NAN_AT_STEP in env:
        nan_step = int(env[NAN_AT_STEP])
        _when_imported(_LOOP, lambda: nan_at_step(nan_step))
    if KILL_IN_CHECKPOINT in env:
        kill_step = int(env[KILL_IN_CHECKPOINT])
        _when_imported(_CHECKPOINT, lambda: kill_in_checkpoint(kill_step))
    if FAIL_RANK_AT_STEP in env:
        rank, fail_step = (int(v) for v in env[FAIL_RANK_AT_STEP].split(":"))
        _when_imported(_LOOP, lambda: fail_rank_at_step(rank, fail_step))
