"""Disk cleanup across runs: `mlm-pipeline gc` removes finished runs' local training state.

Each training run keeps its state (the last `train.keep_last_checkpoints` checkpoints) in
`<work_dir>/train/<MLflow run id>/checkpoints/` so that it can be continued; once the run
is FINISHED its model is in MLflow and the local state is dead weight. `plan_gc` decides,
per run directory, whether its `checkpoints/` goes:

- kept: the run is not FINISHED (RUNNING, FAILED, KILLED: it can be resumed), it is not
  found in the tracking store (nothing proves it finished), its model version holds the
  registry alias `champion` (`tracking.registry.CHAMPION`), or it is one of the newest
  `keep` FINISHED runs of its experiment (by start time);
- removed: every other FINISHED run.

With a URL work directory (`mlm_pipeline.store`) the runs are those of its store and of
this machine's mirror, and a removed `checkpoints/` goes from both. The rest of a run
directory is small and stays. (`mlflow gc` is another thing: it purges deleted runs.)
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlm_pipeline import store
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.tracking.registry import CHAMPION, RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcItem:
    """One run directory's training state and what `gc` does with it.

    Attributes:
        path: the `checkpoints/` directory (`<work_dir>/train/<run_id>/checkpoints`).
        run_id: the MLflow run id (the run directory's name).
        experiment: the run's experiment name ("" when the run is not in the store).
        bytes: size of the files under `path` (bytes; symbolic links count as themselves).
        action: `remove` or `keep`.
        reason: why, in words (e.g. `champion`, `unfinished (KILLED): can be resumed`).
    """

    path: Path
    run_id: str
    experiment: str
    bytes: int
    action: Literal["remove", "keep"]
    reason: str


def tree_bytes(path: Path) -> int:
    """Total size in bytes of the files under `path` (not following symbolic links)."""
    total = 0
    for root, dirs, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        total += sum(os.lstat(os.path.join(root, d)).st_size for d in dirs
                     if os.path.islink(os.path.join(root, d)))
    return total


def champion_run_ids(tracker: MlflowTracker) -> set[str]:
    """Run ids of the model versions holding the alias `champion`, over every registered
    model of the tracking store."""
    client, found, token = tracker.client, set(), None
    while True:
        page = client.search_registered_models(max_results=100, page_token=token)
        for model in page:
            if (version := (model.aliases or {}).get(CHAMPION)) is not None:
                found.add(client.get_model_version(model.name, str(version)).run_id)
        token = page.token
        if not token:
            return found


def plan_gc(tracker: MlflowTracker, work_dir: str | Path, keep: int = 1,
            experiment: str | None = None) -> list[GcItem]:
    """What `gc` would do with each run's training state in `work_dir` (module docstring).

    Args:
        tracker: the tracking store the runs were recorded in.
        work_dir: the pipeline work directory (`work_dir` of the config).
        keep: newest FINISHED runs per experiment whose state is kept (0: none).
        experiment: only runs of this experiment; None: every experiment.

    Returns:
        One item per `<work_dir>/train/<run id>/checkpoints/` directory (the runs of other
        experiments left out when `experiment` is given), newest run first within each
        experiment. A directory not named by an MLflow run id, or whose `checkpoints` is a
        symbolic link, is not listed (it is not a pipeline run's own state).

    Raises:
        ValueError: `keep` is negative.
    """
    from mlflow.exceptions import MlflowException

    if keep < 0:
        raise ValueError(f"gc: --keep must be >= 0, got {keep}")
    client = tracker.client
    champions = champion_run_ids(tracker)
    found, missing, names = [], [], {}
    root = store.work_root(work_dir) / "train"  # a URL work directory: its mirror
    local = {p.name for p in root.iterdir()} if root.is_dir() else set()
    in_store = set(store.remote_children(root))  # a URL work directory's runs, anywhere
    for name in sorted(local | in_store):
        run_dir = root / name
        state = run_dir / "checkpoints"
        if not RUN_ID.fullmatch(name) or state.is_symlink() or not (
                state.is_dir() or name in in_store):
            continue
        try:
            run = client.get_run(name)
        except MlflowException:
            missing.append(GcItem(state, name, "", _state_bytes(state), "keep",
                                  f"not a run of {tracker.tracking_uri}"))
            continue
        exp_id = run.info.experiment_id
        if exp_id not in names:
            names[exp_id] = client.get_experiment(exp_id).name
        if experiment is None or names[exp_id] == experiment:
            found.append(run)
    items = [] if experiment is not None else missing
    found.sort(key=lambda r: (names[r.info.experiment_id], -(r.info.start_time or 0)))
    finished_seen: dict[str, int] = {}
    for run in found:
        info = run.info
        state = root / info.run_id / "checkpoints"
        action, reason = "keep", None
        if info.status != "FINISHED":
            reason = f"unfinished ({info.status}): can be resumed"
        else:
            exp = info.experiment_id
            rank = finished_seen[exp] = finished_seen.get(exp, 0) + 1
            if info.run_id in champions:
                reason = "its model version is the registry's champion"
            elif rank <= keep:
                reason = f"one of the newest {keep} finished runs of its experiment"
            else:
                action, reason = "remove", "finished"
        items.append(GcItem(state, info.run_id, names[info.experiment_id],
                            _state_bytes(state), action, reason))
    return items


def _state_bytes(state: Path) -> int:
    """Bytes of a run's `checkpoints/`: on disk, else in the store of a URL work directory."""
    return tree_bytes(state) if state.is_dir() else sum(store.remote_sizes(state).values())


def apply_gc(items: list[GcItem]) -> int:
    """Delete the `checkpoints/` directory of every item whose action is `remove`: on disk
    and, in the mirror of a URL work directory, in its store.

    Returns:
        The bytes freed (the sum of the removed items' `bytes`).

    Raises:
        OSError: a directory cannot be removed (the ones before it are gone).
    """
    freed = 0
    for item in items:
        if item.action == "remove":
            if item.path.exists():
                shutil.rmtree(item.path)
            store.remove_remote(item.path)
            freed += item.bytes
    return freed


def _mib(n: int) -> str:
    """`n` bytes in MiB, for the report."""
    return f"{n / 2**20:,.1f} MiB"


def gc_report(items: list[GcItem], dry_run: bool) -> list[str]:
    """The lines `mlm-pipeline gc` prints: each directory removed (or, with `dry_run`, that
    would be) with its size, each kept one with the reason, and the total freed."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {item.path} ({_mib(item.bytes)}, {item.bytes:,} bytes; run "
             f"{item.run_id}, experiment {item.experiment!r})"
             for item in items if item.action == "remove"]
    lines += [f"kept {item.path} ({_mib(item.bytes)}): {item.reason}"
              for item in items if item.action == "keep"]
    total = sum(item.bytes for item in items if item.action == "remove")
    lines.append(f"{'would free' if dry_run else 'freed'} {_mib(total)} ({total:,} bytes) in "
                 f"{sum(item.action == 'remove' for item in items)} run directories")
    return lines


def gc(tracker: MlflowTracker, work_dir: str | Path, keep: int = 1,
       experiment: str | None = None, dry_run: bool = False) -> list[str]:
    """`mlm-pipeline gc`: remove (or, with `dry_run`, only list) what `plan_gc` marks;
    returns the report's lines (`gc_report`)."""
    items = plan_gc(tracker, work_dir, keep, experiment)
    if not dry_run:
        apply_gc(items)
    return gc_report(items, dry_run)


def keep_last_runs(tracker: MlflowTracker, cfg: PipelineConfig) -> int:
    """After a run finished: `plan_gc` + `apply_gc` with `tracking.keep_last_runs` on the
    run's experiment (nothing when it is None), each removal logged; returns bytes freed."""
    keep = cfg.tracking.keep_last_runs
    if keep is None:
        return 0
    items = plan_gc(tracker, cfg.work_dir, keep=keep, experiment=cfg.tracking.experiment_name)
    freed = apply_gc(items)
    for line in gc_report([i for i in items if i.action == "remove"], dry_run=False):
        logger.info("tracking.keep_last_runs=%d: %s", keep, line)
    return freed
