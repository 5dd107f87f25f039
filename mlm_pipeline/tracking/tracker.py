"""The one place that talks to MLflow: the run lifecycle here (`MlflowTracker` and the
tracking-URI helpers), batched step metrics in `mlm_pipeline.tracking.sink` (`MlflowSink`).

`MlflowTracker` owns one `MlflowClient` and takes an explicit `run_id` everywhere: MLflow's
active run is per thread, and Prefect tasks may run in other threads. mlflow is imported
lazily; the client comes from `sink._mlflow_client` (telemetry off: see that module).

Artifacts with a SQLite backend: MLflow 3.17 puts a new experiment's artifacts under
`./mlruns/<experiment_id>` of whichever process creates it, scattering runs started from
different directories; `experiment_id` creates experiments on a SQLite URI with the
absolute artifact location `<db dir>/mlartifacts/<experiment name>` instead. Existing
experiments keep their location; on an http(s) server, new ones get the server's default.
An experiment created locally and later served keeps its local location (MLflow cannot
change it), so its runs' artifacts would bypass the server: `experiment_id` warns once.

Experiment kind: MLflow 3's UI opens an experiment on the view its tag `mlflow.experimentKind`
names (`custom_model_development`: runs and training curves; values from the UI bundle of
MLflow 3.17, `ExperimentKind`); without the tag it guesses, and shows an empty traces page.

Limits (MLflow 3.17 `mlflow/utils/validation.py`): 100 params or tags per `log_batch`, param
values up to 6000 characters, tag values up to 8000, keys as in `sinks.check_key`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import posixpath
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse
from urllib.request import pathname2url, url2pathname

from mlm_pipeline.config import TrackingConfig
from mlm_pipeline.sinks import check_key
from mlm_pipeline.tracking.sink import MlflowSink, _mlflow_client

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = ["MlflowTracker", "git_commit", "resolve_tracking_uri", "sqlite_db_path"]

logger = logging.getLogger(__name__)

MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
#: Experiment tag and value that open an experiment on the MLflow UI's training-runs view.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
#: Query that opens MLflow 3.17's UI in its "Model training" mode (runs, training curves)
#: whatever the browser stored: without it a fresh browser profile shows the GenAI view
#: (the sidebar toggle, kept in local storage as `mlflow.workflowType`, defaults to GenAI;
#: the UI reads `workflowType` from the URL first, see `WorkflowTypeProvider` in its bundle).
UI_TRAINING_QUERY = "?workflowType=machine_learning"
#: Where `mlflow ui` serves the UI by default.
LOCAL_UI = "http://127.0.0.1:5000"
#: (tracking URI, experiment id) already warned about a local artifact location.
_WARNED_LOCAL_LOCATIONS: set[tuple[str, str]] = set()


def resolve_tracking_uri(cfg: TrackingConfig) -> str:
    """The tracking URI: `cfg.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else
    `sqlite:///<absolute cwd>/mlflow.db` (MLflow 3's own default, made absolute so that
    workers in other directories reach the same database)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if env := os.environ.get("MLFLOW_TRACKING_URI"):
        return env
    return "sqlite:///" + pathname2url(str(Path.cwd().resolve() / "mlflow.db"))


def sqlite_db_path(tracking_uri: str) -> Path | None:
    """Absolute path of the database file of a `sqlite:///` URI; None for other URIs and
    in-memory databases."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    raw = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    if not raw or raw == ":memory:":
        return None
    return Path(url2pathname(raw)).resolve()  # url2pathname also undoes %-quoting


def git_commit() -> str | None:
    """Commit (40 hex) of the checkout this package runs from; None when the package is not
    the top of a git work tree's `mlm_pipeline/` (an installed wheel) or git is missing."""
    pkg = Path(__file__).resolve().parents[1]  # mlm_pipeline/ (this is tracking/__init__.py)
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=pkg,
                             capture_output=True, text=True, timeout=10, check=True,
                             ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    # A wheel installed in a venv inside some other repository must not report that commit.
    if len(out) != 2 or Path(out[0]).resolve() != pkg.parent:
        return None
    return out[1]


class MlflowTracker:
    """MLflow run lifecycle with an explicit `run_id` (no global active run).

    Args:
        tracking_uri: MLflow tracking URI (see `resolve_tracking_uri`).
        experiment_name: experiment to create runs in; created when missing.
        run_name: name of runs created by `start_run`; None lets MLflow pick one.
    """

    def __init__(
        self, tracking_uri: str, experiment_name: str = "mlm-pipeline", run_name: str | None = None,
        bookkeeping_tags: Mapping[str, str] | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        #: Tags set on every run this tracker starts or resumes (`from_config`: the
        #: `tracking.resume_run_id` and `tracking.resume` settings, never params).
        self.bookkeeping_tags = dict(bookkeeping_tags or {})
        self._client: MlflowClient | None = None
        self._experiment_ids: dict[str, str] = {}  # run_id -> experiment_id

    @classmethod
    def from_config(cls, cfg: TrackingConfig) -> MlflowTracker:
        """A tracker for `cfg` (URI resolved with `resolve_tracking_uri`) that tags the runs
        it starts or resumes with `tracking.resume_run_id` and `tracking.resume` (settings
        about which run goes on, not about what it computes: tags, not params)."""
        return cls(resolve_tracking_uri(cfg), cfg.experiment_name, cfg.run_name,
                   {"tracking.resume_run_id": str(cfg.resume_run_id),
                    "tracking.resume": str(cfg.resume)})

    @property
    def client(self) -> MlflowClient:
        """The `MlflowClient`, created on first use (no connection before that); with a
        SQLite URI, the store is opened once under `.<db name>.lock` beside the database."""
        if self._client is None:
            db = sqlite_db_path(self.tracking_uri)
            if db is None:
                self._client = _mlflow_client(self.tracking_uri)
                return self._client
            # Two processes creating a new database race in MLflow's schema migration (one
            # fails with "duplicate column name"): the client, whose constructor opens the
            # store (creating and migrating the database), is made under a lock file beside
            # the database, with the model registry's store, which checks its tables too.
            from filelock import FileLock

            db.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(db.with_name(f".{db.name}.lock"), thread_local=False):
                client = _mlflow_client(self.tracking_uri)
                client.search_registered_models(max_results=1)
            self._client = client
        return self._client

    def experiment_id(self) -> str:
        """Id of `experiment_name`, created if missing (artifacts next to a SQLite DB; on a
        server, its default location) and tagged `mlflow.experimentKind =
        custom_model_development` (the UI's runs view) when it lacks the tag. On an http(s) URI,
        an existing experiment with a local artifact location is warned about once.

        Raises:
            ValueError: the experiment exists but is deleted (restore it or pick a new name).
        """
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment_name)
        if exp is None:
            db = sqlite_db_path(self.tracking_uri)
            # A path component of the name: no separators, no `..`, no hidden directory.
            safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.experiment_name).lstrip(".") or "_"
            location = str(db.parent / "mlartifacts" / safe) if db else None
            try:
                return self.client.create_experiment(
                    self.experiment_name, location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException:  # another worker created it first
                exp = self.client.get_experiment_by_name(self.experiment_name)
                if exp is None:
                    raise
        if exp.lifecycle_stage != "active":
            raise ValueError(
                f"MLflow experiment {self.experiment_name!r} (id {exp.experiment_id}) is deleted:"
                f" `mlflow experiments restore --experiment-id {exp.experiment_id}` or set"
                " tracking.experiment_name")
        if EXPERIMENT_KIND_TAG not in exp.tags:
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG,
                                           EXPERIMENT_KIND)
        self._check_artifact_location(exp.experiment_id, exp.artifact_location)
        return exp.experiment_id

    def _check_artifact_location(self, experiment_id: str, location: str) -> None:
        """Warn once per process, URI and experiment when an http(s) server's experiment keeps a
        local artifact location (its runs' artifacts would go to this machine's disk)."""
        key = (self.tracking_uri, experiment_id)
        if (not self._served() or not location.startswith(("/", "file:"))
                or key in _WARNED_LOCAL_LOCATIONS):
            return
        _WARNED_LOCAL_LOCATIONS.add(key)
        logger.warning(
            "MLflow experiment %r (id %s) on %s keeps the local artifact location %s (it was"
            " created on a local store): its runs write their artifacts to this machine's"
            " disk, not through the server. Set tracking.experiment_name to a new name (the"
            " server creates it with its own artifact location), or rename the old"
            " experiment so the name is created anew: `MLFLOW_TRACKING_URI=%s mlflow"
            " experiments rename --experiment-id %s --new-name %s-local`.",
            self.experiment_name, experiment_id, self.tracking_uri, location,
            self.tracking_uri, experiment_id, self.experiment_name)

    def start_run(self, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                  run_name: str | None = None) -> str:
        """Create a run, log `params` and `tags`; returns the run id.

        Args:
            params: key -> value, e.g. `config_files.flatten(cfg)`; values are logged as `str(value)`,
                cut to 6000 characters with a warning.
            tags: key -> value, cut to 8000 characters with a warning; e.g. the code's
                commit as `mlflow.source.git.commit` (see `git_commit`), which the UI shows.
            run_name: the run's name; None uses the tracker's `run_name` (None: MLflow picks).

        Raises:
            ValueError: a param key is not MLflow-legal (see `check_key`), or the experiment
                is deleted.
        """
        for key in params:
            check_key(key)
        exp_id = self.experiment_id()
        run = self.client.create_run(exp_id, run_name=run_name or self.run_name)
        run_id = run.info.run_id
        self._experiment_ids[run_id] = exp_id
        try:
            self.log_params(run_id, params)
            self.set_tags(run_id, {**self.bookkeeping_tags, **(tags or {})})
        except BaseException:  # leave no run stuck in RUNNING
            self.end_run(run_id, "FAILED")
            raise
        logger.info("MLflow run %s in experiment %r (%s)", run_id, self.experiment_name,
                    self.run_url(run_id) or self.tracking_uri)
        return run_id

    def log_params(self, run_id: str, params: Mapping[str, object]) -> None:
        """Log params in batches of 100 (values stringified, cut to 6000 characters).

        Raises:
            ValueError: a key is not MLflow-legal (see `check_key`).
        """
        from mlflow.entities import Param

        items = []
        for key, value in params.items():
            check_key(key)
            items.append(Param(key, _truncate("param", key, str(value), MAX_PARAM_VALUE_LENGTH)))
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_inputs(self, run_id: str, datasets: list[Any]) -> None:
        """Log dataset inputs of the run (`mlflow.entities.DatasetInput`s, e.g.
        `lineage.shard_inputs`): the UI's dataset view, searchable by digest."""
        self.client.log_inputs(run_id, datasets=datasets)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Set tags in batches of 100 (values stringified, cut to 8000 characters)."""
        from mlflow.entities import RunTag

        items = [RunTag(k, _truncate("tag", k, str(v), MAX_TAG_VALUE_LENGTH))
                 for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def sink(self, run_id: str, flush_every: int = 50,
             flush_interval_s: float = 10.0) -> MlflowSink:
        """An `MlflowSink` for `run_id` on this tracker's URI."""
        return MlflowSink(run_id, self.tracking_uri, flush_every, flush_interval_s, self.client)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float],
                    step: int | None = None) -> None:
        """Log a few metrics at once (e.g. evaluation results); non-finite values are
        dropped with a warning. `step` None logs at step 0 (MLflow's default).

        Raises:
            ValueError: a key is not MLflow-legal (see `check_key`).
            TypeError: a value is not a number.
        """
        sink = self.sink(run_id, flush_every=1 << 30, flush_interval_s=math.inf)
        sink.log(dict(metrics), 0 if step is None else step)
        sink.close()

    def log_artifacts(self, run_id: str, local_path: str | os.PathLike[str],
                      artifact_path: str | None = None) -> None:
        """Copy a file, or a directory's files, into the run's artifacts under `artifact_path`.

        Raises:
            FileNotFoundError: `local_path` is neither a file nor a directory.
        """
        path = Path(local_path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        elif path.is_file():
            self.client.log_artifact(run_id, str(path), artifact_path)
        else:
            raise FileNotFoundError(
                f"log_artifacts: {local_path} is neither a file nor a directory")

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None:
        """Write `obj` as indented JSON to the run artifact `artifact_file` (e.g.
        `manifests/train.json`); non-JSON values (paths, ...) are written with `str`."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / posixpath.basename(artifact_file)
            text = json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n"
            path.write_text(text, encoding="utf-8")
            self.client.log_artifact(run_id, str(path), posixpath.dirname(artifact_file) or None)

    @contextlib.contextmanager
    def system_metrics(self, run_id: str, sampling_interval_s: float = 10.0) -> Iterator[None]:
        """While the block runs, sample system use every `sampling_interval_s` seconds into
        the run's `system/...` metrics (`system/cpu_utilization_percentage`,
        `system/system_memory_usage_megabytes`, `system/gpu_0_utilization_percentage`, ...;
        names, units and the GPU probe (`nvidia-ml-py`) are MLflow's `SystemMetricsMonitor`,
        which works on a run id); steps continue after those a continued run holds. One last
        sample is logged when the block ends, so a short block still has a point.
        `$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` overrides the interval. A monitor that
        fails to start or to log only warns: training never fails for its system metrics.
        """
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        try:
            monitor = SystemMetricsMonitor(run_id, sampling_interval=sampling_interval_s,
                                           resume_logging=True, tracking_uri=self.tracking_uri)
        except Exception as exc:  # noqa: BLE001 - psutil missing, the server unreachable
            logger.warning("MLflow system metrics are off for run %s: %s", run_id, exc)
            yield
            return
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()
            try:  # the samples since the last publication (the monitor drops them)
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                logger.warning("last system metrics sample of run %s not logged: %s",
                               run_id, exc)

    def end_run(self, run_id: str, status: RunStatus = "FINISHED") -> None:
        """Mark the run terminated with `status`.

        Raises:
            ValueError: `status` is not FINISHED, FAILED or KILLED.
        """
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"end_run: status {status!r} must be FINISHED, FAILED or KILLED")
        self.client.set_terminated(run_id, status)

    def run_url(self, run_id: str, experiment_id: str | None = None) -> str | None:
        """The run's page in the MLflow UI when the tracking URI is http(s), else None."""
        if not self._served():
            return None
        return ui_url(self.tracking_uri, self.run_experiment_id(run_id, experiment_id), run_id)

    def run_experiment_id(self, run_id: str, experiment_id: str | None = None) -> str:
        """The id of the experiment holding `run_id` (`experiment_id` when given)."""
        exp = experiment_id or self._experiment_ids.get(run_id)
        return exp if exp is not None else self.get_run(run_id).info.experiment_id

    def get_run(self, run_id: str) -> Run:
        """`MlflowClient.get_run` (params, metrics, tags, status)."""
        return self.client.get_run(run_id)

    def _served(self) -> bool:
        """Whether the tracking URI is an http(s) server."""
        return urlparse(self.tracking_uri).scheme in ("http", "https")


def _truncate(kind: str, key: str, value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    logger.warning("MLflow %s %r: value of %d characters cut to %d", kind, key, len(value), limit)
    return value[:limit]


def ui_url(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """A page of the MLflow UI served at `base`, in its "Model training" mode (routes and
    query parameters of MLflow 3.17's UI, checked in headless Chromium on a fresh profile).

    Args:
        base: the UI's address, e.g. `http://127.0.0.1:5000`.
        experiment_id: the experiment's id (a number as a string with a SQLite store).
        run_id: None: the experiment's runs beside their metric charts
            (`compareRunsMode=CHART`); else that run's metric charts (its `model-metrics`
            tab).
    """
    root = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
    if run_id:
        return f"{root}/{run_id}/model-metrics{UI_TRAINING_QUERY}"
    return f"{root}{UI_TRAINING_QUERY}&compareRunsMode=CHART"
