"""Real servers on loopback for the slow tests: free ports, health waits, a stop that takes
the whole process group, and one Prefect server that many `mlm-pipeline run` processes share.

A `mlm-pipeline run` without `PREFECT_API_URL` starts its own local Prefect API on a fresh
database (10-20 s of migrations on two cores). Tests that are not about that local API give
their CLI processes `PREFECT_API_URL` of one server started here once per session instead
(`tests/conftest.py::prefect_api_url`); their `PREFECT_HOME` (result storage, so cache
records) stays per test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    """Poll `url` until it answers 200.

    Raises:
        RuntimeError: the process exited, or `url` did not answer within `timeout_s`
            seconds (with the end of the server's log).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url}: process exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL what is left (a worker started from a
    non-interactive shell may ignore the first signal; see shared notes)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


def start_prefect_server(home: Path, timeout_s: float = 180) -> tuple[str, subprocess.Popen]:
    """`prefect server start` on a free loopback port with its own `PREFECT_HOME`.

    Args:
        home: the server's home (database, log file `server.log`); created if missing.
        timeout_s: seconds to wait for `/api/health` (a busy two-core machine is slow).

    Returns:
        (API URL ending in `/api`, the server process, in its own process group: pass it
        to `stop`).

    Raises:
        RuntimeError: the server exited or did not answer in time.
    """
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false")
    log = home / "server.log"
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
         "--analytics-off"],
        cwd=home, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", proc, log, timeout_s)
    except BaseException:
        stop(proc)
        raise
    return f"http://127.0.0.1:{port}/api", proc
