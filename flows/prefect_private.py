"""The one place where the flows reach past Prefect's public API, each use behind one
function; `tests/flows/test_prefect_private.py` fails when a Prefect upgrade removes what
they rely on.

Why there is any: `mlm-pipeline run` without `PREFECT_API_URL` needs a local Prefect API
that (a) runs in its own session, so that the terminal's Ctrl-C reaches only the flow's
process (which then checkpoints and closes its MLflow run while the API still answers),
and (b) dies with that process, even when it is SIGKILLed. Prefect's own temporary server
(`SubprocessASGIServer` in `prefect/server/api/server.py`) offers neither: it is started in
the caller's process group, with no parent-death signal and no hook to add one. So `run`
starts the same server itself.

Every remaining reliance on something Prefect does not document, and why it stays:

1. `server_command` starts `uvicorn --factory` on `server_app` below, the command
   Prefect's temporary server runs (uvicorn's own CLI, public). `server_app` calls
   `prefect.server.api.server.create_app(ephemeral=True, final=True)`: a public module and
   documented keywords, passed directly instead of through the private environment
   variables `PREFECT__SERVER_EPHEMERAL` / `PREFECT__SERVER_FINAL` that Prefect's own
   launcher sets (no longer used here). What is not promised is that the temporary server
   stays "the app `create_app` builds, served by uvicorn": relied on, checked by the test.
   Upstream: no upstream issue found (for a public way to start the temporary server in
   its own session or with a parent-death signal).
2. `die_with_parent` is not Prefect's at all: Linux `prctl(PR_SET_PDEATHSIG, SIGTERM)`
   called through `ctypes` between fork and exec. Upstream: no upstream issue found (for
   Prefect's temporary server outliving a SIGKILLed parent).
3. The start-up wait reads Prefect's public setting
   `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (`server.ephemeral.
   startup_timeout_seconds`), from the environment only: importing `prefect.settings`
   before `PREFECT_API_URL` is set would freeze Prefect's settings without it (the flow
   would then start Prefect's own server). Unset, the wait is `STARTUP_TIMEOUT_S`
   (Prefect's default of 20 s is too short on a busy 2-core machine).

MLflow (in `mlm_pipeline.tracking.registry`, the only package that imports MLflow): no
private name; its `_tracking_uri` restores an unset tracking URI with the public
`mlflow.set_tracking_uri(None)`, a value MLflow handles (it unsets the URI and
$MLFLOW_TRACKING_URI) but does not document. No upstream issue found.

This module imports neither Prefect nor the library at import: `flows/console.py` uses it
before Prefect may be imported, and `server_app` runs in the server's own process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The public Prefect setting the start-up wait honours (seconds, an integer).
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
#: Seconds to wait for the local API when the setting is unset.
STARTUP_TIMEOUT_S = 180.0
#: `prctl` option: the signal this process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def startup_timeout_s() -> float:
    """Seconds to wait for the local API to answer: `PREFECT_SERVER_EPHEMERAL_STARTUP_
    TIMEOUT_SECONDS` from the environment, else `STARTUP_TIMEOUT_S`.

    Raises:
        ValueError: the variable is set but is not a positive number (it is named).
    """
    raw = os.environ.get(STARTUP_TIMEOUT_SETTING, "").strip()
    if not raw:
        return STARTUP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{STARTUP_TIMEOUT_SETTING}={raw!r}: expected a positive number "
                         "of seconds")
    return value


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies (`prctl`
    PR_SET_PDEATHSIG); a no-op where that fails. Runs in the child between fork and exec:
    it takes no lock a thread of the parent could hold."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_command(port: int) -> list[str]:
    """The command that serves the Prefect API on 127.0.0.1:`port` (UI off): uvicorn on
    `server_app`, as Prefect's temporary server does on its own factory. The import path
    starts at Prefect's installation (`--app-dir`), not the working directory, so a file
    there cannot shadow a module; Prefect is located, not imported."""
    site = Path(importlib.util.find_spec("prefect").origin).parent.parent
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(site), "--factory",
            f"{__name__}:server_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


def start_server(port: int) -> subprocess.Popen:
    """Start `server_command(port)` in its own session (Ctrl-C in the terminal does not
    reach it) and, on Linux, with `die_with_parent` (it never outlives this process).
    Output is discarded; the caller waits for `/api/health`.

    Raises:
        OSError: the interpreter cannot be started.
    """
    return subprocess.Popen(
        server_command(port), env={**os.environ, "PREFECT_UI_ENABLED": "0"},
        start_new_session=True, stdout=subprocess.DEVNULL,
        preexec_fn=die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509


def server_app() -> Any:
    """The ASGI app of the local API (uvicorn's `--factory` target, in the server's
    process): Prefect's `create_app` as a temporary server (`ephemeral=True`: no UI, the
    services a temporary server runs; `final=True`: the only app of the process)."""
    from prefect.server.api.server import create_app

    return create_app(ephemeral=True, final=True)
