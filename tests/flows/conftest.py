"""One Prefect test harness (a temporary local API and database) for the whole session."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield
