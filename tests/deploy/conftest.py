"""Real servers on loopback for the deployment tests: a Prefect server, an MLflow server
(SQLite backend, served artifacts) and a process worker. Every process is stopped at the
end of the session, also when a test fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# Re-exported: other slow tests import these from here too.
_wait_healthy, _stop = wait_healthy, stop


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children, MiB (from /proc)."""
    total = 0
    pids = [pid]
    try:
        pids += [int(p) for p in subprocess.run(["pgrep", "-g", str(os.getpgid(pid))],
                                                capture_output=True, text=True,
                                                check=False).stdout.split()]
    except ProcessLookupError:
        return 0.0
    for p in set(pids):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Start Prefect server, MLflow server and a process worker; yield their settings.

    Module-scoped: stopped when the module's tests are done, not at the session's end, so
    that three idle servers do not take CPU from the modules that run after them (the
    README test's training, on two cores).
    """
    tmp = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = free_port(), free_port()
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("PREFECT_")]:
        del env[key]
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="5",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        MLFLOW_TRACKING_URI=f"http://127.0.0.1:{mlflow_port}",
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        PWD=str(ROOT),
        MLM_PIPELINE_CACHE=os.environ.get("MLM_PIPELINE_CACHE", str(tmp / "cache")),
    )
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = tmp / f"{name}.log"
        procs[name] = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stopped as a whole
        )
        return procs[name]

    try:
        p = start("prefect-server", [str(BIN / "prefect"), "server", "start", "--host",
                                     "127.0.0.1", "--port", str(prefect_port), "--analytics-off"])
        m = start("mlflow-server", [
            str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
            "--artifacts-destination", str(tmp / "mlartifacts"), "--host", "127.0.0.1",
            "--port", str(mlflow_port), "--workers", "1"])
        _wait_healthy(f"http://127.0.0.1:{prefect_port}/api/health", p, tmp / "prefect-server.log")
        _wait_healthy(f"http://127.0.0.1:{mlflow_port}/health", m, tmp / "mlflow-server.log")
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", "local-cpu", "--type",
                        "process", "--overwrite"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        # Reset SIGINT before exec: background processes start with it ignored, and the
        # worker's SIGTERM handler re-sends SIGINT (shared notes).
        launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.argv[1], sys.argv[1:])")
        start("worker", [sys.executable, "-c", launcher, str(BIN / "prefect"), "worker", "start",
                         "--pool", "local-cpu", "--type", "process"])
        yield {"env": env, "tmp": tmp, "procs": procs, "root": ROOT, "bin": BIN,
               "rss_mib": rss_mib}
    finally:
        for proc in procs.values():
            _stop(proc)
