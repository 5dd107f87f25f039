"""The wheel: what it installs, and that the installed command works outside the checkout.

The slow tests build the wheel from a copy of the sources the images copy (no `build/`
left over from an earlier build can slip in) and install it without its dependencies into
a fresh virtual environment that also sees this environment's packages (a `.pth` file
naming this environment's site-packages, after the venv's own; `--system-site-packages`
would give the base interpreter's, not this venv's). Which dependencies a plain install
brings is the README test's concern (tests/readme/test_quickstart.py); here the point is
that the wheel's own files work: `mlm-pipeline` runs from a directory with no `configs/`,
and the default flow runs a few steps there, model export and registration included.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from mlm_pipeline.config_files import load_config
from tests.small_run import small_run_args

ROOT = Path(__file__).resolve().parents[2]
#: What the wheel is built from (the worker images copy the same, plus prefect.yaml).
SOURCES = ("pyproject.toml", "README.md", "configs", "flows", "mlm_pipeline")
#: Installed name of each source folder that is not installed under its own name.
RENAMED = {"flows": "mlm_pipeline_flows", "configs": "mlm_pipeline/configs"}


def _package_folders() -> set[str]:
    """Dotted installed names of every package folder of the checkout."""
    names = {"mlm_pipeline_flows", "mlm_pipeline.configs"}
    for init in (ROOT / "mlm_pipeline").rglob("__init__.py"):
        names.add(".".join(init.parent.relative_to(ROOT).parts))
    return names


def test_pyproject_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib")
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(listed) == sorted(_package_folders())


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
          "--wheel-dir", str(tmp / "dist"), str(src)], timeout=300)
    (found,) = (tmp / "dist").glob("mlm_pipeline-*.whl")
    return found


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings; the Quickstart test installs plainly on every push
def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [n for n in names if n.startswith("flows/")], "generic top-level `flows`"
    assert {n.split("/")[0] for n in names if "/" in n and ".dist-info/" not in n} == {
        "mlm_pipeline", "mlm_pipeline_flows"}
    assert "mlm_pipeline/configs/tiny.yaml" in names
    expected = set()
    for folder in ("mlm_pipeline", "flows", "configs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                rel = path.relative_to(ROOT).as_posix()
                expected.add(RENAMED.get(folder, folder) + rel[len(folder):])
    assert sorted(expected - names) == []  # every module and shipped config is installed
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "mlm-pipeline = mlm_pipeline_flows.console:main" in text


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    inner = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                 timeout=60).stdout.strip()
    # after the venv's own site-packages (where the wheel goes): this environment's packages
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(inner) / "outer_environment.pth").write_text("".join(f"{p}\n" for p in outer))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
               PREFECT_HOME=str(tmp / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
          "--no-deps", "--no-index", str(wheel)], timeout=300, env=env)
    elsewhere = tmp / "elsewhere"  # no configs/, no flows/, no mlm_pipeline/ here
    elsewhere.mkdir()
    return {"bin": venv / "bin", "env": env, "cwd": elsewhere, "site": Path(inner)}


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings; the Quickstart test installs plainly on every push
def test_installed_modules_are_the_wheels(installed):
    code = ("import json, mlm_pipeline, mlm_pipeline_flows, torch; print(json.dumps("
            "[mlm_pipeline.__file__, mlm_pipeline_flows.__file__, torch.__file__]))")
    out = _run([str(installed["bin"] / "python"), "-c", code], timeout=300,
               env=installed["env"], cwd=installed["cwd"]).stdout
    package, flows, torch_file = (Path(p) for p in json.loads(out))
    assert package.is_relative_to(installed["site"]), package
    assert flows.is_relative_to(installed["site"]), flows
    # dependencies come from this environment, through the .pth file
    assert not Path(torch_file).is_relative_to(installed["site"])


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings; the Quickstart test installs plainly on every push
def test_installed_default_flow_runs_and_registers_its_model(installed):
    """The shipped `tiny` config on the test corpus with tiny shapes, a few steps, the model
    exported and logged (`tracking.log_model`, the default): the run finishes, from the
    wheel's files (no git commit tag: it does not run from a checkout)."""
    cwd = installed["cwd"]
    args = small_run_args(str(cwd / "work"), "wheel")
    proc = subprocess.run(
        [str(installed["bin"] / "mlm-pipeline"), "run", "tiny", *args,
         "--summary-json", str(cwd / "summary.json")],
        capture_output=True, text=True, timeout=900, check=False, env=installed["env"],
        cwd=cwd)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((cwd / "summary.json").read_text())
    assert summary["steps"] == 4
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")  # the default
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert "mlflow.source.git.commit" not in run.data.tags
    assert summary["registry"] is not None
    version = client.get_model_version(summary["registry"]["model"],
                                       str(summary["registry"]["version"]))
    assert version.run_id == run.info.run_id


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings; the Quickstart test installs plainly on every push
def test_installed_command_prints_the_shipped_config(installed, monkeypatch):
    out = _run([str(installed["bin"] / "mlm-pipeline"), "config", "tiny"], timeout=120,
               env=installed["env"], cwd=installed["cwd"]).stdout
    expected = load_config("tiny")
    assert yaml.safe_load(out) == expected.model_dump(mode="json")
    (installed["cwd"] / "my.yaml").write_text(out, encoding="utf-8")
    monkeypatch.chdir(installed["cwd"])
    assert load_config("my.yaml") == expected
    assert load_config("my.yaml").train.warmup == expected.train.warmup == 48  # 6 % of 800


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings; the Quickstart test installs plainly on every push
def test_installed_flows_import_without_the_checkout(installed):
    python = str(installed["bin"] / "python")
    code = ("import importlib.util, sys; import mlm_pipeline_flows.pretraining as p, "
            "mlm_pipeline_flows.console; assert importlib.util.find_spec('flows') is None; "
            "print(p.mlm_pretraining.name)")
    out = _run([python, "-c", code], timeout=300, env=installed["env"], cwd=installed["cwd"])
    assert out.stdout.strip() == "mlm-pretraining"
    # the library's own entry has no flow, and says which one has
    proc = subprocess.run([python, "-m", "mlm_pipeline.cli", "run", "tiny"], check=False,
                          capture_output=True, text=True, timeout=120, env=installed["env"],
                          cwd=installed["cwd"])
    assert proc.returncode == 2 and "mlm_pipeline_flows.console:main" in proc.stderr
