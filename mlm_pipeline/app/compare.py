"""Runs side by side, outside the MLflow UI: the table of `mlm-pipeline runs` and
`mlm-pipeline compare`, and the comparison PNG of `compare`.

One row per run (`run_table`): name and id, status, lineage, the params that differ between
the listed runs (only those), tokens seen, wall time, mean training speed, the final
held-out and downstream figures beside their controls (`FINAL_METRICS`), the figures a run
could not compute, the data digest and the registry aliases its versions hold.

Everything is read from the tracking store with the tracker's `MlflowClient` (mlflow is
imported lazily); nothing is written to it.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlm_pipeline.app.compare_plot import compare_figure, run_curves
from mlm_pipeline.tracking.plots import metric_series
from mlm_pipeline.tracking.registry import RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker, sqlite_db_path
from mlm_pipeline.tracking.version_lineage import parent_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = ["SPEED", "RunTable", "check_store", "compare_runs", "find_runs",
           "loop_tokens_per_s", "newest_run_experiment", "resolve_run_id", "resolve_runs",
           "run_table"]

#: Header of the speed column, saying what it is.
SPEED = "tokens/s (seen / loop time)"
#: Final metrics shown, in this order (blank when a run did not log one): each downstream
#: figure beside its controls. `eval/*` at `eval/mlm_probability`; `probe/accuracy` of the
#: trained encoder, of random-init encoders, TF-IDF on the same input, the majority class
#: (`evaluate.downstream`); `finetune/*` from the trained and from random weights and their
#: paired difference (`evaluate.finetune`); with a parent (`train.init_from`), the parent's
#: figures and the paired adapted - parent difference (`evaluate.parent`).
FINAL_METRICS = ("eval/mlm_probability", "eval/loss", "eval/parent_loss", "eval/mlm_accuracy",
                 "eval/parent_mlm_accuracy", "probe/accuracy", "probe/accuracy_parent",
                 "probe/accuracy_random_init", "probe/tfidf_accuracy_same_input",
                 "probe/majority_accuracy", "finetune/accuracy", "finetune/parent_accuracy",
                 "finetune/scratch_accuracy", "finetune/diff", "finetune/diff_ci95_low",
                 "finetune/diff_ci95_high", "finetune/diff_parent",
                 "finetune/diff_parent_ci95_low", "finetune/diff_parent_ci95_high")
#: Column of the figures a run could not compute (its `unavailable.*` tags).
UNAVAILABLE = "not computed"
#: Run ids are shown by their first characters in the table.
SHORT = 8


@dataclass(frozen=True)
class RunTable:
    """The comparison table: `columns` in order, one dict per run (column -> value; None
    is blank). Values are raw (numbers, full ids and digests); `rich` shortens them.
    `narrow` are the columns shown by default, to fit a 100-column terminal (None: all);
    every column is shown with `wide` and in the rows' JSON."""

    columns: list[str]
    rows: list[dict[str, Any]]
    narrow: list[str] | None = None

    def rich(self, title: str | None = None, wide: bool = False):
        """A `rich.table.Table` of the rows (the `narrow` columns unless `wide`): ids and
        digests cut to 8 and 12 characters, wall time as h:mm:ss, floats to 4 decimals,
        counts with thousands separators."""
        from rich.table import Table

        table = Table(title=title)
        # Run names stay whole on one line (copyable into `compare`): the column is as wide
        # as the longest name, and narrow terminals shrink the other columns instead.
        longest = max((len(str(r.get("run") or "")) for r in self.rows), default=3)
        shown = self.columns if wide or self.narrow is None else [
            c for c in self.columns if c in self.narrow]
        for col in shown:
            if col == "run":
                table.add_column(col, no_wrap=True, min_width=longest)
            else:
                table.add_column(col, justify="right" if col in _NUMERIC else "left")
        for row in self.rows:
            table.add_row(*(_cell(col, row.get(col)) for col in shown))
        return table


_NUMERIC = {"tokens seen", "wall time", SPEED, "steps added", *FINAL_METRICS}
#: Digest columns, cut to 12 characters on screen (`mlm-pipeline models` too).
DIGESTS = {"data (digest.shards)", "corpus", "tokenizer"}


def _cell(col: str, value: Any) -> str:
    """`value` as the table shows it in column `col`."""
    if value is None:
        return ""
    if col == "id":
        return value[:SHORT]
    if col in DIGESTS:
        return value[:12]
    if col == "wall time":
        s = round(value)
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    if col in ("tokens seen", "steps added", SPEED):
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def check_store(tracker: MlflowTracker) -> None:
    """Refuse a SQLite URI whose file is missing (reading it would create an empty
    database).

    Raises:
        ValueError: the database file does not exist (the message names it).
    """
    db = sqlite_db_path(tracker.tracking_uri)
    if db is not None and not db.is_file():
        raise ValueError(f"no MLflow database at {db} (give --tracking-uri or set "
                         "MLFLOW_TRACKING_URI)")


def _experiment_ids(client: MlflowClient, experiment: str | None, uri: str) -> list[str]:
    """The ids of `experiment` (None: every active one); ValueError naming those there."""
    if experiment is None:
        return [e.experiment_id for e in client.search_experiments()]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"no MLflow experiment {experiment!r} at {uri} (experiments there: "
                         f"{', '.join(names) or 'none'}); give --experiment NAME")
    return [exp.experiment_id]


def newest_run_experiment(tracker: MlflowTracker) -> str | None:
    """The name of the experiment holding the store's most recently started run (active
    runs of active experiments), None when the store holds no run: what `mlm-pipeline
    runs` lists without `--experiment`.

    Raises:
        ValueError: the SQLite database does not exist.
    """
    check_store(tracker)
    client = tracker.client
    ids = [e.experiment_id for e in client.search_experiments()]
    newest = client.search_runs(ids, max_results=1,
                                order_by=["attributes.start_time DESC"]) if ids else []
    return client.get_experiment(newest[0].info.experiment_id).name if newest else None


def find_runs(tracker: MlflowTracker, experiment: str | None = None,
              filter_string: str = "", max_results: int = 50) -> list[Run]:
    """The runs of an experiment, newest first (MLflow's `search_runs`, active runs only).

    Args:
        tracker: the tracking store (`tracker.tracking_uri`).
        experiment: experiment name; None uses `tracker.experiment_name`.
        filter_string: an MLflow search filter, e.g. `params."train.lr" = '0.001'` or
            `metrics."eval/loss" < 5`.
        max_results: at most this many runs.

    Raises:
        ValueError: the SQLite database does not exist, the experiment does not exist
            (the message lists those that do), `max_results` < 1, or MLflow rejects the
            filter (its message is kept).
    """
    from mlflow.exceptions import MlflowException

    if max_results < 1:
        raise ValueError(f"runs: --max {max_results} must be at least 1")
    check_store(tracker)
    client = tracker.client
    ids = _experiment_ids(client, experiment or tracker.experiment_name, tracker.tracking_uri)
    try:
        return list(client.search_runs(ids, filter_string or "", max_results=max_results))
    except MlflowException as exc:
        raise ValueError(f"runs: bad --filter {filter_string!r}: {exc.message}") from exc


#: A run-id prefix: hex digits, shorter than a full id (the table shows 8).
ID_PREFIX = re.compile(r"[0-9a-f]{1,31}")
#: Candidates listed when a prefix or a name is ambiguous.
MAX_CANDIDATES = 10


def resolve_run_id(tracker: MlflowTracker, ref: str, experiment: str | None = None) -> Run:
    """The run `ref` names: a full run id (32 hex digits), a unique prefix of one, or a run
    name (tried first), looked up in `experiment` (None: every active experiment).

    Raises:
        ValueError: the SQLite database does not exist, the experiment does not exist,
            nothing matches, or several runs match (the message names `ref` and lists the
            candidates' ids and names).
    """
    from mlflow.exceptions import MlflowException

    check_store(tracker)
    client = tracker.client
    if RUN_ID.fullmatch(ref):
        try:
            return client.get_run(ref)
        except MlflowException as exc:
            raise ValueError(f"MLflow run {ref!r} not found at {tracker.tracking_uri}"
                             ) from exc
    ids = _experiment_ids(client, experiment, tracker.tracking_uri)
    quoted = ref.replace("'", "\\'")
    where = f" at {tracker.tracking_uri}" + (f" in experiment {experiment!r}" if experiment
                                              else "")
    found = client.search_runs(ids, f"attributes.run_name = '{quoted}'",
                               max_results=MAX_CANDIDATES)
    what = f"several MLflow runs are named {ref!r}"
    if not found and ID_PREFIX.fullmatch(ref):
        found = client.search_runs(ids, f"attributes.run_id LIKE '{ref}%'",
                                   max_results=MAX_CANDIDATES)
        what = f"the prefix {ref!r} matches several MLflow run ids"
    if not found:
        raise ValueError(f"no MLflow run with id, id prefix or name {ref!r}{where}")
    if len(found) > 1:
        listed = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in found)
        raise ValueError(f"{what}{where}: {listed}"
                         + (" and more" if len(found) >= MAX_CANDIDATES else "")
                         + "; give more of the id")
    return found[0]


def nested_runs(tracker: MlflowTracker, parent: Run) -> list[Run]:
    """The runs nested under `parent` (MLflow's tag `mlflow.parentRunId`: a sweep's
    children), oldest first."""
    return list(tracker.client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"], max_results=1000))


def resolve_runs(tracker: MlflowTracker, refs: Sequence[str],
                 experiment: str | None = None) -> list[Run]:
    """The runs named by `refs`, in that order (each as in `resolve_run_id`: a run id, a
    unique id prefix or a run name); a sweep's parent run (tag `mlm.sweep`) stands for its
    children (`nested_runs`).

    Raises:
        ValueError: `refs` is empty, or as `resolve_run_id` for a reference.
    """
    if not refs:
        raise ValueError("compare: give at least one run id or run name")
    runs = []
    for ref in refs:
        run = resolve_run_id(tracker, ref, experiment)
        runs += (nested_runs(tracker, run) or [run]) if run.data.tags.get(
            "mlm.sweep") == "parent" else [run]
    return runs


def loop_tokens_per_s(tokens_seen: list[tuple[int, float]],
                      tokens_per_s: list[tuple[int, float]]) -> float | None:
    """Mean training speed of a run: tokens seen / loop time, from its log intervals (each
    interval's tokens: the rise of `train/tokens_seen`; its loop time: those tokens / its
    `train/tokens_per_s`). Checkpoints, evaluation and start-up are outside the loop time.

    Args:
        tokens_seen, tokens_per_s: the two histories (`plots.metric_series`), logged at
            the same steps.

    Returns:
        Tokens per second, or None when no step carries both with a positive speed.
    """
    speed = dict(tokens_per_s)
    tokens = seconds = before = 0.0
    for step, seen in tokens_seen:
        rise, before = seen - before, seen
        if speed.get(step, 0.0) > 0 and rise > 0:
            tokens += rise
            seconds += rise / speed[step]
    return tokens / seconds if seconds > 0 else None


def _aliases(client: MlflowClient, run_id: str, models: dict[str, dict[str, int]]
             ) -> str | None:
    """`alias (model vN)` for each alias held by a version `run_id` registered; `models`
    caches each registered model's alias -> version map (`search_model_versions` leaves
    `aliases` empty on a SQLite store in MLflow 3.17; `get_registered_model` fills it)."""
    found = []
    for v in client.search_model_versions(f"run_id = '{run_id}'"):
        if v.name not in models:
            models[v.name] = dict(client.get_registered_model(v.name).aliases)
        found += [f"{alias} ({v.name} v{v.version})" for alias, version
                  in sorted(models[v.name].items()) if str(version) == str(v.version)]
    return ", ".join(found) or None


def _differing(params: list[dict[str, str]]) -> list[str]:
    """The config keys (`train.lr`, `name`, ...: as `records.run_params` logs them) whose
    value is not the same in every run (absent counts); others' params (MLflow's model
    flavors: `tokenizer_kwargs/truncation`) are left out."""
    from mlm_pipeline.config import PipelineConfig

    keys = sorted({k for p in params for k in p
                   if k.split(".")[0] in PipelineConfig.model_fields})
    return [k for k in keys if len({p.get(k) for p in params}) > 1]


def run_table(tracker: MlflowTracker, runs: Sequence[Run]) -> RunTable:
    """The comparison table of `runs`, in their order. Columns: `run`, `id`, `status`,
    `parent` (`version_lineage.parent_label`), `steps added` (tag `lineage.steps_added`,
    else the step of the last `train/tokens_seen`), `decision` (tag `registry.decision`),
    the differing params (by key), `tokens seen`, `wall time` (s: end, or now, minus start),
    `SPEED` (`loop_tokens_per_s`), `FINAL_METRICS` (at the highest step), `UNAVAILABLE`
    (the run's `unavailable.*` tags), `data (digest.shards)` and `registry alias`."""
    client = tracker.client
    differing = _differing([dict(r.data.params) for r in runs])
    columns = ["run", "id", "status", "parent", "steps added", "decision", *differing,
               "tokens seen", "wall time", SPEED, *FINAL_METRICS, UNAVAILABLE,
               "data (digest.shards)", "registry alias"]
    rows = []
    models: dict[str, dict[str, int]] = {}
    now_ms = time.time() * 1000
    for run in runs:
        info, data = run.info, run.data
        seen = metric_series(client, info.run_id, "train/tokens_seen")
        speed = metric_series(client, info.run_id, "train/tokens_per_s")
        end = info.end_time if info.end_time else now_ms
        final = {k: data.metrics.get(k) for k in FINAL_METRICS}
        rows.append({
            "run": info.run_name, "id": info.run_id, "status": info.status,
            "parent": parent_label(data.tags),
            "steps added": int(data.tags["lineage.steps_added"])
            if "lineage.steps_added" in data.tags else (seen[-1][0] if seen else None),
            "decision": data.tags.get("registry.decision"),
            **{k: data.params.get(k) for k in differing},
            "tokens seen": seen[-1][1] if seen else None,
            "wall time": (end - info.start_time) / 1000 if info.start_time else None,
            SPEED: loop_tokens_per_s(seen, speed),
            **{k: v if v is None or math.isfinite(v) else None for k, v in final.items()},
            UNAVAILABLE: ", ".join(sorted(k.removeprefix("unavailable.")
                                          for k in data.tags if k.startswith("unavailable.")))
            or None,
            "data (digest.shards)": data.tags.get("digest.shards"),
            "registry alias": _aliases(client, info.run_id, models),
        })
    narrow = ["run", "id", "status", "decision", *differing, SPEED, "eval/loss",
              "eval/mlm_accuracy"]
    return RunTable(columns, rows, narrow)


def experiment_runs(tracker: MlflowTracker, experiment: str | None = None,
                    filter_string: str = "", max_runs: int = 50,
                    parent: str | None = None) -> tuple[RunTable, str]:
    """`mlm-pipeline runs`: the table of an experiment's runs (`find_runs`, `run_table`;
    default: the experiment of the newest run in the store) and its title; with `parent`
    (a run id, prefix or name), the runs nested under it (a sweep's children).

    Raises:
        ValueError: see `find_runs` and `resolve_run_id`.
    """
    if parent is not None:
        run = resolve_run_id(tracker, parent, experiment)
        runs = nested_runs(tracker, run)[:max_runs]
        return run_table(tracker, runs), (f"{len(runs)} runs nested under {run.info.run_name}"
                                          f" ({run.info.run_id[:SHORT]}, "
                                          f"{tracker.tracking_uri})")
    name = experiment or newest_run_experiment(tracker) or tracker.experiment_name
    runs = find_runs(tracker, name, filter_string, max_runs)
    which = "" if experiment else ", the newest run's; --experiment NAME for another"
    return run_table(tracker, runs), (f"{len(runs)} runs of experiment {name} "
                                      f"({tracker.tracking_uri}{which})")


def compare_table(tracker: MlflowTracker, runs: Sequence[str], out: str | Path,
                  experiment: str | None = None) -> tuple[RunTable, str]:
    """`mlm-pipeline compare`: the table of `compare_runs` (its figure written to `out`)
    and its title."""
    table, _ = compare_runs(tracker, runs, out, experiment)
    return table, f"{len(table.rows)} runs; loss against tokens seen: {out}"


def compare_runs(tracker: MlflowTracker, refs: Sequence[str], out: str | Path | None = None,
                 experiment: str | None = None) -> tuple[RunTable, Figure]:
    """The table and the loss-against-tokens figure of the runs `refs` (`resolve_runs`),
    the figure written as a PNG to `out` when given: two panels, `train/loss` and
    `eval/loss` (`compare_plot.compare_figure`), one line per run labelled with its name
    (`name (id[:8])` when two share one), 1200 x 500 pixels.

    Raises:
        ValueError: see `resolve_runs`; a run logged no loss or no `train/tokens_seen`.
        OSError: `out` cannot be written.
    """
    from mlm_pipeline.tracking.plots import DPI

    runs = resolve_runs(tracker, refs, experiment)
    names = [r.info.run_name or r.info.run_id for r in runs]
    labels = [n if names.count(n) == 1 else f"{n} ({r.info.run_id[:SHORT]})"
              for n, r in zip(names, runs)]
    fig = compare_figure([c for r, label in zip(runs, labels)
                          for c in run_curves(tracker.client, r, label)])
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI, format="png")
    return run_table(tracker, runs), fig
