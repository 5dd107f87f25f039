"""One Prefect test harness (a temporary local API and database) for the whole session.

Prefect reads `PREFECT_HOME` (where cache records and results are stored) from the
environment: it is pointed at a fresh directory when this file is imported, before any
test module imports prefect, so no session reads another session's cache records.
"""

import os
import shutil
import tempfile

import pytest

_HOME = tempfile.mkdtemp(prefix="prefect-home-")
os.environ["PREFECT_HOME"] = _HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    # 60 s timed out on a loaded two-core machine (the CLI's own local API allows 180 s).
    with prefect_test_harness(server_startup_timeout=180):
        yield
    shutil.rmtree(_HOME, ignore_errors=True)
