"""Every pool deployable, both servers behind a login: the stack's settings on real servers.

One Prefect server and one MLflow server per module, on loopback, each started with the
login infra/compose.yaml gives it (Prefect: `PREFECT_SERVER_API_AUTH_STRING`; MLflow: the
basic-auth app configured by infra/mlflow/basic_auth.ini and `MLFLOW_AUTH_ADMIN_*`). The
clients log in through the standard variables the stack hands its workers:
`PREFECT_API_AUTH_STRING`, `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`.
`prefect deploy --all` runs in a fresh process against the Prefect server, as an operator
runs it. No worker and no flow run: the deployment runs themselves are tests/deploy's
test_deployments.py.

Slow (two servers start in about 15 s): run with `pytest -m slow`.
"""

from __future__ import annotations

import configparser
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.servers import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
INFRA = ROOT / "infra"
# The kind of pool each pool name of prefect.yaml is: the compose workers' process pools,
# the Kubernetes pool from its template (infra/README.md).
POOL_TYPES = {"local-cpu": "process", "local-gpu": "process", "gpu-k8s": "kubernetes"}


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    return env


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A Prefect server and an MLflow server, each requiring a login; yields their URLs
    and credentials. Both stop at the module's end, also when a test fails."""
    tmp = tmp_path_factory.mktemp("logins")
    prefect_port, mlflow_port = free_port(), free_port()
    auth_string = f"admin:{secrets.token_hex(12)}"
    mlflow_user, mlflow_password = "mlm-admin", secrets.token_hex(12)
    # The shipped login settings, with the user store moved from the container's volume
    # to this test's folder (the only key changed).
    ini = configparser.ConfigParser()
    ini.read(INFRA / "mlflow" / "basic_auth.ini")
    ini["mlflow"]["database_uri"] = f"sqlite:///{tmp}/basic_auth.db"
    with (tmp / "basic_auth.ini").open("w") as f:
        ini.write(f)
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        procs.append(subprocess.Popen(args, cwd=tmp, env=env, stdout=(tmp / name).open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        return procs[-1]

    try:
        p = start("prefect.log", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                  "--port", str(prefect_port), "--analytics-off"],
                  {**_clean_env(tmp), "PREFECT_SERVER_API_AUTH_STRING": auth_string,
                   "PREFECT_UI_ENABLED": "false"})
        m = start("mlflow.log", [
            str(BIN / "mlflow"), "server", "--app-name", "basic-auth",
            "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
            "--artifacts-destination", str(tmp / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
            {**_clean_env(tmp), "MLFLOW_AUTH_CONFIG_PATH": str(tmp / "basic_auth.ini"),
             "MLFLOW_AUTH_ADMIN_USERNAME": mlflow_user,
             "MLFLOW_AUTH_ADMIN_PASSWORD": mlflow_password,
             "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        # Both health endpoints answer without a login (the compose healthchecks use them).
        wait_healthy(f"http://127.0.0.1:{prefect_port}/api/health", p, tmp / "prefect.log", 180)
        wait_healthy(f"http://127.0.0.1:{mlflow_port}/health", m, tmp / "mlflow.log", 180)
        yield {"tmp": tmp, "prefect_api": f"http://127.0.0.1:{prefect_port}/api",
               "auth_string": auth_string, "mlflow_uri": f"http://127.0.0.1:{mlflow_port}",
               "mlflow_user": mlflow_user, "mlflow_password": mlflow_password}
    finally:
        for proc in procs:
            stop(proc)


def _prefect_cli(servers, *args: str) -> subprocess.CompletedProcess:
    """The `prefect` CLI in a fresh process, logged in as the stack's workers are."""
    env = {**_clean_env(servers["tmp"]), "PREFECT_API_URL": servers["prefect_api"],
           "PREFECT_API_AUTH_STRING": servers["auth_string"], "PWD": str(ROOT)}
    return subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def _prefect_client(servers, auth_string: str | None):
    """A sync Prefect client of the test server, sending `auth_string` (None: none)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        temporary_settings,
    )

    updates = {PREFECT_API_URL: servers["prefect_api"]}
    if auth_string is not None:
        updates[PREFECT_API_AUTH_STRING] = auth_string
    restore = set() if auth_string is not None else {PREFECT_API_AUTH_STRING}
    settings = temporary_settings(updates=updates, restore_defaults=restore)
    return settings, get_client


def _read_deployments(servers, auth_string: str | None) -> list:
    settings, get_client = _prefect_client(servers, auth_string)
    with settings, get_client(sync_client=True) as client:
        return client.read_deployments()


# --------------------------------------------------------------------------- every pool
def test_every_deployment_registers_with_the_pool_it_names(servers):
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    expected = {d["name"]: (d["work_pool"]["name"], d["entrypoint"]) for d in spec["deployments"]}
    assert len(expected) == len(spec["deployments"]), "deployment names repeat"
    # the pools the compose workers poll are all targeted by some deployment
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    polled = {s["command"][s["command"].index("--pool") + 1]
              for s in compose["services"].values() if "--pool" in (s.get("command") or [])}
    assert polled <= {pool for pool, _ in expected.values()}, polled
    assert {pool for pool, _ in expected.values()} <= set(POOL_TYPES)

    for pool in sorted({pool for pool, _ in expected.values()}):
        args = ["work-pool", "create", pool, "--type", POOL_TYPES[pool], "--overwrite"]
        if POOL_TYPES[pool] == "kubernetes":
            args += ["--base-job-template", str(INFRA / "k8s" / "gpu-work-pool-template.json")]
        created = _prefect_cli(servers, *args)
        assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-2000:]

    out = _prefect_cli(servers, "--no-prompt", "deploy", "--all")
    print(f"\n$ prefect --no-prompt deploy --all   (exit {out.returncode})\n"
          f"{out.stdout}{out.stderr}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    registered = {d.name: (d.work_pool_name, d.entrypoint)
                  for d in _read_deployments(servers, servers["auth_string"])}
    print("registered (deployment: pool, entrypoint):")
    for name, (pool, entrypoint) in sorted(registered.items()):
        print(f"  {name}: {pool}, {entrypoint}")
    assert registered == expected


# --------------------------------------------------------------------------- logins
def test_prefect_refuses_a_call_without_the_login_and_accepts_it_with(servers):
    from prefect.exceptions import PrefectHTTPStatusError

    url = f"{servers['prefect_api']}/work_pools/filter"
    bare = httpx.post(url, json={}, timeout=30)
    wrong = httpx.post(url, json={}, timeout=30, auth=("admin", "not-the-password"))
    user, password = servers["auth_string"].split(":", 1)
    good = httpx.post(url, json={}, timeout=30, auth=(user, password))
    print(f"\nPrefect POST /api/work_pools/filter, no login: {bare.status_code} {bare.text}")
    print(f"Prefect POST /api/work_pools/filter, wrong password: {wrong.status_code}")
    print(f"Prefect POST /api/work_pools/filter, PREFECT_API_AUTH_STRING: {good.status_code}")
    assert (bare.status_code, wrong.status_code, good.status_code) == (401, 401, 200)

    # Prefect's own client: the auth string setting is the whole difference.
    with pytest.raises(PrefectHTTPStatusError) as refused:
        _read_deployments(servers, None)
    assert refused.value.response.status_code == 401
    accepted = _read_deployments(servers, servers["auth_string"])
    print(f"Prefect client read_deployments, no auth string: refused "
          f"({refused.value.response.status_code})")
    print(f"Prefect client read_deployments, with PREFECT_API_AUTH_STRING: "
          f"{len(accepted)} deployments")
    assert isinstance(accepted, list)


def test_mlflow_refuses_a_call_without_the_login_and_logs_a_metric_with_it(
        servers, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = servers["mlflow_uri"]
    url = f"{uri}/api/2.0/mlflow/experiments/search"
    bare = httpx.post(url, json={"max_results": 1}, timeout=30)
    good = httpx.post(url, json={"max_results": 1}, timeout=30,
                      auth=(servers["mlflow_user"], servers["mlflow_password"]))
    print(f"\nMLflow POST experiments/search, no login: {bare.status_code} {bare.text.strip()}")
    print(f"MLflow POST experiments/search, admin login: {good.status_code}")
    assert (bare.status_code, good.status_code) == (401, 200)

    client = MlflowClient(tracking_uri=uri)
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(MlflowException) as refused:
        client.create_experiment("refused-without-login")
    print(f"MLflow client create_experiment, no credentials: refused ({refused.value})"[:300])
    assert "401" in str(refused.value) or "Unauthorized" in str(refused.value)

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", servers["mlflow_user"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    with pytest.raises(MlflowException):
        client.create_experiment("refused-wrong-password")

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", servers["mlflow_password"])
    experiment_id = client.create_experiment("logins")
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "train/loss", 2.5, step=3)
    client.set_terminated(run.info.run_id)
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    print(f"MLflow client with MLFLOW_TRACKING_USERNAME/PASSWORD: experiment {experiment_id}, "
          f"run {run.info.run_id}, train/loss history {history}")
    assert history == [(3, 2.5)]
    assert client.get_experiment(experiment_id).name == "logins"


def test_mlflow_admin_password_rotates_as_infra_readme_says(servers):
    """The stored admin password outlives infra/.env: the README's rotation is a PATCH with
    the old login, after which only the new password logs in (then infra/.env follows)."""
    uri, user = servers["mlflow_uri"], servers["mlflow_user"]
    old, new = servers["mlflow_password"], secrets.token_hex(12)
    changed = httpx.patch(f"{uri}/api/2.0/mlflow/users/update-password", timeout=30,
                          auth=(user, old),
                          json={"username": user, "password": new, "current_password": old})
    assert changed.status_code == 200, changed.text
    servers["mlflow_password"] = new  # for any test after this one
    url = f"{uri}/api/2.0/mlflow/experiments/search"
    with_old = httpx.post(url, json={"max_results": 1}, timeout=30, auth=(user, old))
    with_new = httpx.post(url, json={"max_results": 1}, timeout=30, auth=(user, new))
    print(f"\nMLflow PATCH users/update-password with the old login: {changed.status_code}; "
          f"then old password: {with_old.status_code}, new password: {with_new.status_code}")
    assert (with_old.status_code, with_new.status_code) == (401, 200)
