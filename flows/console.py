"""The `mlm-pipeline` console script: `run` gets the `mlm-pretraining` flow, `alerts` its
Prefect automations (`mlm_pipeline_flows.alerts`), every other command goes to
`mlm_pipeline.cli.main` as it is (the library never imports the flows, so they are handed in
here). Prefect is imported only when `run` starts the flow, so the other commands start as
fast as the library does.

`run` executes the flow in this process, recorded on `PREFECT_API_URL` when set. Without
it, `run` starts a local Prefect API itself (`LocalPrefectApi`) rather than leaving it to
Prefect's ephemeral server: in its own session, so the terminal's Ctrl-C reaches only this
process (the flow can then checkpoint and close its MLflow run while the API is still
there), with a parent-death signal, so it never outlives this process (not even a SIGKILL),
and with a start-up wait that tolerates a busy machine
(`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`, default 180 s). What of Prefect it
relies on beyond the public API: `mlm_pipeline_flows.prefect_private`.

Progress: in a terminal, one live `rich` line per stage (`progress_display.display`);
otherwise log lines at a bounded rate. Ctrl-C or SIGTERM during training checkpoints the
step reached, closes the MLflow run KILLED, and `run` prints how to continue and exits 130
(`mlm_pipeline.app.training_run.stop_on_signals`); a second signal stops at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlm_pipeline import cli

from mlm_pipeline_flows.prefect_private import start_server, startup_timeout_s


class LocalPrefectApi:
    """A Prefect API server on a free loopback port for the lifetime of one `run`
    (`prefect_private.start_server`: its own session, a parent-death signal on Linux;
    elsewhere only `stop` ends it)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        """Start the server and wait until `/api/health` answers, holding
        `<PREFECT_HOME>/.local-api-start.lock` meanwhile: servers of concurrent runs share
        the database in PREFECT_HOME, and two migrating a new one at once fail (alembic
        "table already exists"); the next one starts on the migrated database.

        Raises:
            RuntimeError: it exited or did not answer within `timeout_s` seconds (the
                message says what to do).
        """
        from filelock import FileLock

        # Not from prefect.settings: importing prefect before PREFECT_API_URL is set would
        # freeze its settings without it, and the flow would start Prefect's own ephemeral
        # server (no session of its own, no parent-death signal) instead of this one.
        home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
        home.mkdir(parents=True, exist_ok=True)
        with FileLock(home / ".local-api-start.lock", thread_local=False):
            self._start(timeout_s)

    def _start(self, timeout_s: float) -> None:
        """Start the server and wait for its health check (`start`)."""
        self.process = start_server(self.port)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"{self.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
            time.sleep(0.5)
        code = self.process.poll()
        self.stop()
        if code is not None:
            raise RuntimeError(
                f"the local Prefect API server exited with status {code} before it answered "
                "(its error is printed above: often a Prefect release that does not work with "
                "the installed FastAPI/pydantic; see pyproject.toml's prefect floor)")
        raise RuntimeError(
            f"the local Prefect API did not start within {timeout_s:.0f} s on this machine; "
            "retry when it is less busy, raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, "
            "or run a server (`prefect server start`) and set PREFECT_API_URL")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def _config_param(config: str) -> dict[str, str]:
    """`{"config": name}` for a shipped config, else `{"config_file": resolved path}` (a
    YAML path, or `./configs/NAME.yaml`, which wins over a shipped config of that name)."""
    from mlm_pipeline.config_files import resolve_config_path, shipped_configs

    found, shipped = resolve_config_path(config), shipped_configs()
    if config in shipped and str(found) == str(shipped[config]):
        return {"config": config}
    return {"config_file": str(found)}


def _max_steps(params: Any) -> int | None:
    """`train.max_steps` of the run (the `train` line's total); None when the config does
    not load (the flow then fails on it)."""
    from mlm_pipeline.config_files import load_config

    try:
        return load_config(*params.resolved()).train.max_steps
    except Exception:  # noqa: BLE001 - reported by the flow itself
        return None


def _no_view_links(record: logging.LogRecord) -> bool:
    """A logging filter: False for the flow engine's `View at <url>` lines."""
    return not record.getMessage().startswith("View at ")


def run_pretraining(config: str, overrides: list[str],
                    sweep: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Run the `mlm-pretraining` flow in this process (with `sweep`, the `mlm-sweep` flow).

    Args:
        config: config name (`tiny`) or YAML path.
        overrides: dotted `key=value` overrides applied after the file.
        sweep: config key -> values to train every combination of (`app.sweep`).

    Returns:
        The run summary (MLflow run id, metrics, manifest paths, wall times). A failing
        task's exception propagates (Prefect has logged its traceback), an interruption
        too (`TrainingInterrupted`, `KeyboardInterrupt`: `mlm_pipeline.cli.run` says how
        to continue).
    """
    # Settings read when prefect is imported: route our library logs through Prefect's
    # handlers and silence the temporary server's analytics (harmless "database is
    # locked" tracebacks otherwise; see shared notes).
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "mlm_pipeline")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    if not os.environ.get("PREFECT_API_URL"):
        api = LocalPrefectApi()
        api.start(startup_timeout_s())
        os.environ["PREFECT_API_URL"] = api.url
        # Registered before prefect is imported, so it runs after Prefect's own exit
        # handlers have delivered the last logs and events to the API (atexit is LIFO).
        atexit.register(api.stop)
        # The engine's "View at <url>" lines would link to this server, gone when the
        # command ends: say so once instead.
        logging.getLogger("prefect.flow_runs").addFilter(_no_view_links)
    from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
    from mlm_pipeline_flows.progress_display import display

    logging.getLogger("mlm_pipeline").setLevel(logging.INFO)
    if _no_view_links in logging.getLogger("prefect.flow_runs").filters:
        log = logging.getLogger(__name__)  # not a flow-run logger: terminal and log file
        log.setLevel(logging.INFO)
        log.info("Prefect: a temporary local server for this command only (its UI ends with "
                 "it); for a lasting UI, run `prefect server start` and set PREFECT_API_URL")
    params = PretrainParams.model_validate({**_config_param(config),
                                            "overrides": list(overrides)})
    with display(_max_steps(params)):
        if sweep:
            from mlm_pipeline_flows.sweep import mlm_sweep

            return mlm_sweep(params, sweep)
        return mlm_pretraining(params)


def alerts(**kwargs: Any) -> list[str]:
    """`mlm-pipeline alerts`: `mlm_pipeline_flows.alerts.alerts`, imported when it runs."""
    from mlm_pipeline_flows.alerts import alerts as install_or_remove

    return install_or_remove(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mlm-pipeline` console script; returns the exit status."""
    return cli.main(argv, run_flow=run_pretraining, flow_verbs={"alerts": alerts})


if __name__ == "__main__":
    sys.exit(main())
