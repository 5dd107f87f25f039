"""The declared version floors hold: an install at the lowest versions pyproject.toml allows
runs the default flow end to end, the model export included.

uv (from this environment: the `dev` extra) installs the checkout into a fresh venv with
`--resolution lowest-direct`: every direct dependency at its declared floor, dependencies
of dependencies at their newest (what a user installing today would get with an old pin).
torch is the exception: no torch 2.6 CPU wheel is reachable here (PyPI's torch is the CUDA
build), so the install overrides torch with the CPU build of constraints.txt (a wheel in
MLM_FLOORS_WHEELS, default /opt/wheels, or the CPU index) and torch's floor is not tested.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.small_run import small_run_args

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("MLM_FLOORS_WHEELS", "/opt/wheels"))
UNTESTED = {"torch"}  # see the module docstring


def _floors() -> dict[str, str]:
    """{canonical name: lower bound} of pyproject.toml's `dependencies` (every `>=`)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    floors = {}
    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(text)
        (low,) = [s.version for s in req.specifier if s.operator == ">="]
        floors[canonicalize_name(req.name)] = low
    return floors


def _run(cmd, timeout, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def floor_env(tmp_path_factory) -> dict:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (the `dev` extra installs it)")
    torch_version = next(line.split("==")[1].strip() for line in
                         (ROOT / "constraints.txt").read_text().splitlines()
                         if line.startswith("torch=="))
    tmp = tmp_path_factory.mktemp("floors")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    (tmp / "override.txt").write_text(f"torch=={torch_version}+cpu\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith(("PREFECT_", "MLFLOW_"))}
    source = (["--find-links", str(WHEELS)] if WHEELS.is_dir() else
              ["--extra-index-url", "https://download.pytorch.org/whl/cpu"])
    _run([uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), *source,
          "--resolution", "lowest-direct", "--override", str(tmp / "override.txt"),
          "-e", str(ROOT)], timeout=900, env=env)
    home = tmp / "home"  # empty: no ~/.prefect, no ~/.cache of an earlier run
    cwd = tmp / "cwd"
    home.mkdir()
    cwd.mkdir()
    env.update(HOME=str(home), OMP_NUM_THREADS="1",
               PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    return {"bin": venv / "bin", "env": env, "cwd": cwd}


@pytest.mark.slow
@pytest.mark.full
def test_installed_versions_are_the_declared_floors(floor_env):
    code = ("import json, importlib.metadata as m; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = _run([str(floor_env["bin"] / "python"), "-c", code], timeout=120,
               env=floor_env["env"], cwd=floor_env["cwd"]).stdout
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    installed = {canonicalize_name(k): Version(v) for k, v in json.loads(out).items()}
    floors = {k: Version(v) for k, v in _floors().items() if k not in UNTESTED}
    assert {k: installed.get(k) for k in floors} == floors


@pytest.mark.slow
@pytest.mark.full
def test_default_flow_runs_and_exports_on_the_floors(floor_env):
    """`mlm-pipeline run tiny`, a few steps, the model exported and logged; then the
    exported Hugging Face model loads with the floor transformers and predicts."""
    cwd = floor_env["cwd"]
    args = small_run_args(str(cwd / "work"), "floors")
    _run([str(floor_env["bin"] / "mlm-pipeline"), "run", "tiny", *args,
          "--summary-json", str(cwd / "summary.json")], timeout=1200,
         env=floor_env["env"], cwd=cwd)
    summary = json.loads((cwd / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["registry"] is not None  # the exported model, logged and registered
    export = cwd / "export"
    _run([str(floor_env["bin"] / "mlm-pipeline"), "export", summary["mlflow_run_id"],
          str(export), "--tracking-uri", f"sqlite:///{cwd / 'mlflow.db'}"], timeout=600,
         env=floor_env["env"], cwd=cwd)
    code = ("import sys, torch, transformers as t; m = t.AutoModelForMaskedLM.from_pretrained("
            "sys.argv[1]); k = t.AutoTokenizer.from_pretrained(sys.argv[1]); "
            "x = k('Bonjour le monde', return_tensors='pt'); "
            "print(tuple(m(**x).logits.shape[-1:]), m.config.vocab_size)")
    out = _run([str(floor_env["bin"] / "python"), "-c", code, str(export)], timeout=300,
               env=floor_env["env"], cwd=cwd).stdout.split()
    assert out[-1] == "128" and out[-2] == "(128,)"
