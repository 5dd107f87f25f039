"""What `mlm_pipeline_flows.prefect_private` (and the registry's MLflow tracking-URI helper)
rely on beyond the documented APIs still exists with the expected shape: a Prefect or MLflow
upgrade that removes it fails here, by name, before a user's `mlm-pipeline run` does."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from mlm_pipeline_flows import prefect_private


def test_prefect_create_app_takes_the_temporary_server_keywords():
    from prefect.server.api.server import create_app

    params = inspect.signature(create_app).parameters
    for name in ("ephemeral", "final"):
        assert name in params, f"prefect create_app lost its `{name}` keyword"
        assert params[name].default is False


def test_prefect_startup_timeout_setting_is_read_from_its_environment_variable(monkeypatch):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, Settings

    assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.name == (
        prefect_private.STARTUP_TIMEOUT_SETTING)
    monkeypatch.setenv(prefect_private.STARTUP_TIMEOUT_SETTING, "77")
    value = Settings().server.ephemeral.startup_timeout_seconds
    assert type(value) is int and value == 77
    assert prefect_private.startup_timeout_s() == 77.0


def test_startup_timeout_defaults_and_refuses_a_bad_value(monkeypatch):
    monkeypatch.delenv(prefect_private.STARTUP_TIMEOUT_SETTING, raising=False)
    assert prefect_private.startup_timeout_s() == prefect_private.STARTUP_TIMEOUT_S
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv(prefect_private.STARTUP_TIMEOUT_SETTING, bad)
        with pytest.raises(ValueError, match="PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
            prefect_private.startup_timeout_s()


def test_uvicorn_cli_has_the_options_of_the_server_command():
    from uvicorn.main import main as uvicorn_command  # the click command

    options = {o for p in uvicorn_command.params for o in p.opts}
    command = prefect_private.server_command(8123)
    used = {a for a in command if a.startswith("--")}
    assert used <= options, used - options
    factory = command[command.index("--factory") + 1]
    assert factory == "mlm_pipeline_flows.prefect_private:server_app"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_die_with_parent_arms_the_parent_death_signal():
    # The child reads back its parent-death signal (PR_GET_PDEATHSIG = 2, linux/prctl.h).
    code = ("import ctypes; s = ctypes.c_int(0); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, preexec_fn=prefect_private.die_with_parent)
    assert out.stdout.strip() == "15"  # SIGTERM
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, check=True)
    assert plain.stdout.strip() == "0"


def test_the_registry_restores_the_mlflow_tracking_uri_it_found(monkeypatch, tmp_path):
    """`tracking.registry._tracking_uri` (public MLflow API only): an unset URI is unset
    again after the block (not pinned to the default), a URI from the environment comes
    back with the environment variable."""
    import mlflow
    from mlflow.tracking import is_tracking_uri_set

    from mlm_pipeline.tracking.registry import _tracking_uri

    outer = mlflow.get_tracking_uri() if is_tracking_uri_set() else None
    inner = f"sqlite:///{tmp_path / 'inner.db'}"
    try:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        mlflow.set_tracking_uri(None)
        assert not is_tracking_uri_set()
        with _tracking_uri(inner):
            assert mlflow.get_tracking_uri() == inner
        assert not is_tracking_uri_set() and "MLFLOW_TRACKING_URI" not in os.environ

        env_uri = f"sqlite:///{tmp_path / 'env.db'}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
        with _tracking_uri(inner):
            assert mlflow.get_tracking_uri() == inner
        assert mlflow.get_tracking_uri() == env_uri == os.environ["MLFLOW_TRACKING_URI"]
    finally:
        mlflow.set_tracking_uri(outer)
