"""The terminal and the log file of `mlm-pipeline run`: its one-line errors and its summary.

Without this, a failed stage printed about 100 lines of Prefect's reports (tracebacks,
"Finished in state Failed") before the error. `run_logging` installs `RunConsole` and a
file handler on the root logger before the flow starts; a root with handlers of its own
makes Prefect's `setup_logging` leave it alone (prefect/logging/configuration.py drops the
`root` section of its config for a root with "user handlers") and add no console handler.
A deployment never calls this and logs as Prefect does. Neither prefect nor mlflow is
imported here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from mlm_pipeline import store


def versions() -> str:
    """`mlm-pipeline --version`: this package's installed version and those of torch,
    prefect and mlflow (`importlib.metadata`; `not installed` when missing)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"mlm-pipeline {of('mlm-pipeline')} (" + ", ".join(
        f"{name} {of(name)}" for name in ("torch", "prefect", "mlflow")) + ")"


def one_line(exc: BaseException) -> str:
    """`exc` as one line for the error message: its text with whitespace collapsed, after
    its type name unless it is a `ValueError`, `OSError` or `RuntimeError` (the library's
    errors for bad input, whose text names the file or field)."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, ValueError | OSError | RuntimeError) and text else (
        f"{type(exc).__name__}: {text}")


#: Messages of Prefect's flow and task engines that restate a failure the error line gives.
_FAILURE_REPORTS = ("Finished in state Failed", "Finished in state Crashed",
                    "Encountered exception during execution")
#: Loggers whose records the terminal shows at every level: ours, Prefect's (the stages'
#: task runs), the console entry's.
OWN_LOGGERS = ("mlm_pipeline", "prefect", "root")
#: Other libraries' records reach the terminal from this level on (all with `--verbose`).
THIRD_PARTY_LEVEL = logging.ERROR


def quiet_third_party() -> None:
    """Before the libraries are imported: transformers' and huggingface_hub's progress
    bars (`Loading weights`, `Writing model shards`) and advisory notes off, and MLflow's
    own console handler (it does not propagate to ours) at WARNING, unless the environment
    sets them (`HF_HUB_DISABLE_PROGRESS_BARS`, `TRANSFORMERS_VERBOSITY`,
    `MLFLOW_LOGGING_LEVEL`)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


class RunConsole(logging.StreamHandler):
    """The terminal's log handler of `mlm-pipeline run`, on the root logger (Prefect's API
    handler still sends every record, tracebacks included, to the Prefect server).

    Lines look like Prefect's (`12:00:00.123 | INFO    | Task run 'ingest-36b' - ...`).
    Unless `verbose`, records of Prefect's engines that report a failure (a traceback, a
    Failed/Crashed state) are left to the log file and the one error line that `run`
    prints, other records lose their traceback, and third-party libraries' records below
    ERROR (MLflow's system-metrics and signature notices, transformers' notes) are left to
    the log file (`THIRD_PARTY_LEVEL`). Writes to the `sys.stderr` of the moment
    (a live progress display may have replaced it).

    Attributes:
        failed_task: the name of the last task whose run ended Failed or Crashed, or None.
        reported: whether Prefect reported a failure (its traceback is in the log).
    """

    def __init__(self, verbose: bool) -> None:
        super().__init__(sys.stderr)
        self.verbose, self.failed_task, self.reported = verbose, None, False
        self.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d | %(levelname)-7s | "
                                            "%(where)s - %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` (see the class docstring)."""
        message = record.getMessage()
        failure = record.name.startswith("prefect.") and (
            record.exc_info is not None or any(m in message for m in _FAILURE_REPORTS))
        self.reported |= failure
        if failure and "Finished in state" in message and (name := getattr(
                record, "task_name", None)):
            self.failed_task = name
        if failure and not self.verbose:
            return
        if not self.verbose and record.levelno < THIRD_PARTY_LEVEL and not record.name.startswith(
                OWN_LOGGERS):
            return
        record = logging.makeLogRecord(record.__dict__)
        if not self.verbose:
            record.exc_info = record.exc_text = record.stack_info = None
        d = record.__dict__
        d["where"] = (f"Task run {d['task_run_name']!r}" if "task_run_name" in d else
                      f"Flow run {d['flow_run_name']!r}" if "flow_run_name" in d else record.name)
        self.stream = sys.stderr
        super().emit(record)


def run_logging(work_dir: str, verbose: bool) -> tuple[RunConsole, logging.FileHandler]:
    """Install `RunConsole` and a file handler keeping every record with its traceback
    (`<work_dir>/logs/run-<local time>-<pid>.log`, created on the first record) on the root
    logger; returns both.

    Raises:
        OSError: `<work_dir>/logs` cannot be created.
    """
    log = store.work_root(work_dir) / "logs" / (
        f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(log, encoding="utf-8", delay=True)
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = RunConsole(verbose)
    root = logging.getLogger()
    root.addHandler(console)
    root.addHandler(file)
    return console, file


def ui_lines(result: dict) -> list[str]:
    """Where to see the run in the MLflow UI (`tracker.ui_url`: the experiment's runs and
    the run's charts, in "Model training" mode); for a tracking URI that is not a server,
    first the `mlflow ui` command serving it on port 5000."""
    from mlm_pipeline.tracking.tracker import LOCAL_UI, ui_url

    uri, exp, run = (result["mlflow_tracking_uri"], result.get("mlflow_experiment_id"),
                     result["mlflow_run_id"])
    served = uri.startswith(("http://", "https://"))
    lines = [] if served else [f"Open the UI:   mlflow ui --backend-store-uri {uri} --port 5000"]
    if exp is not None:
        base = uri if served else LOCAL_UI
        lines += [f"Runs, charts:  {ui_url(base, exp)}", f"Run page:      {ui_url(base, exp, run)}"]
    return lines


def print_summary(result: dict, experiment: str) -> None:
    """Print the end of a successful `run` on stdout: a table of the final metrics, then
    where everything is (run id, tracking URI, run page, checkpoint, tokenizer), the
    training figures, the reused stages, an early stop and the registry's decision.

    Args:
        result: the run summary (`mlm_pipeline.app.summary.summary`).
        experiment: the MLflow experiment's name.
    """
    from rich.console import Console
    from rich.table import Table

    from mlm_pipeline.app.summary import registry_lines, training_lines

    console = Console()
    table = Table(title=f"MLflow run {result['mlflow_run_id']} (experiment {experiment})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(result["metrics"]):
        value = result["metrics"][key]
        table.add_row(key, f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4f}")
    console.print(table)
    lines = [f"MLflow run id: {result['mlflow_run_id']}",
             f"Tracking URI:  {result['mlflow_tracking_uri']}", *ui_lines(result),
             f"Checkpoint:    {result['checkpoint']}",
             f"Tokenizer:     {result['tokenizer_model']}", *training_lines(result)]
    if result.get("reused_stages"):
        lines.append("Reused:        " + ", ".join(result["reused_stages"])
                     + " (outputs of an earlier run with the same config and inputs)")
    if result.get("stop_reason", "max_steps") != "max_steps":
        lines.append(f"WARNING: training stopped early ({result['stop_reason']}) after "
                     f"{result['steps']:,} steps; the metrics are those of a shorter run")
    if reg := result.get("registry"):
        lines += registry_lines(reg)
    for line in lines:  # paths and commands must stay copyable: never wrap them
        console.print(line, soft_wrap=True, highlight=False)


def tell_after_interrupt(line: str) -> None:
    """Print `line` on stderr after Ctrl-C, also behind `| tee` or `2>&1 | tee`.

    The terminal's SIGINT reaches the pipe's reader too, which exits: writing to the pipe
    then raises BrokenPipeError, and flushing it at exit turns the exit status into 120.
    So a stream whose reader is gone is pointed at /dev/null (the recipe of the Python
    docs, "Note on SIGPIPE"), and a line that cannot go to stderr goes to the controlling
    terminal, where the user pressed Ctrl-C.
    """
    def broken(stream) -> bool:
        try:
            stream.flush()
            return False
        except (BrokenPipeError, ValueError):  # ValueError: already closed
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            return True

    broken(sys.stdout)
    if not broken(sys.stderr):
        try:
            print(line, file=sys.stderr, flush=True)
            return
        except BrokenPipeError:
            broken(sys.stderr)
    with contextlib.suppress(OSError), open("/dev/tty", "w", encoding="utf-8") as tty:
        tty.write(line + "\n")


def print_sweep_summary(result: dict) -> None:
    """Print the end of a successful sweep (`mlm-pipeline run --sweep`): the parent run, its
    children's table (`app.compare.experiment_runs` with the parent) and how to compare them.

    Args:
        result: the sweep flow's record (`app.sweep.finish_parent`, with
            `mlflow_tracking_uri`).
    """
    from rich.console import Console

    from mlm_pipeline.app.compare import experiment_runs
    from mlm_pipeline.tracking.tracker import MlflowTracker

    parent = result["parent"]
    table, title = experiment_runs(MlflowTracker(result["mlflow_tracking_uri"]), parent=parent)
    console = Console()
    console.print(table.rich(title))
    lines = [f"Sweep run id:  {parent} ({len(result['children'])} runs)",
             f"Tracking URI:  {result['mlflow_tracking_uri']}",
             f"Best run:      {result['best_run']} (eval/loss {result['best_eval_loss']:.4f})"
             if result.get("best_run") else "Best run:      none logged eval/loss",
             f"Compare them:  mlm-pipeline compare {parent} --tracking-uri "
             f"{result['mlflow_tracking_uri']}"]
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)
