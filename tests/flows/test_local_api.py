"""`mlm-pipeline run` starts its own local Prefect API before Prefect is imported: Prefect
freezes its settings at import, and an import before PREFECT_API_URL is set would make the
flow start Prefect's ephemeral server (in the terminal's process group, no parent-death
signal) instead of ours."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import os, sys
os.environ.pop('PREFECT_API_URL', None)
os.environ['PREFECT_HOME'] = sys.argv[1]
import mlm_pipeline_flows.console as cli
api = cli.LocalPrefectApi()
api.start(180)
print('prefect imported:', 'prefect' in sys.modules)
import urllib.request
print('health:', urllib.request.urlopen(api.url + '/health', timeout=10).status)
api.stop()
print('stopped:', api.process is None)
"""


# A fresh database's migrations (10-20 s of server CPU): the push tier, on every push.
@pytest.mark.slow
def test_the_local_api_starts_without_importing_prefect(tmp_path):
    out = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "prefect")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prefect imported: False" in out.stdout
    assert "health: 200" in out.stdout and "stopped: True" in out.stdout
