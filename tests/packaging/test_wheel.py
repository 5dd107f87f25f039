"""The wheel: what it installs, and that the installed command works outside the checkout.

The slow tests build the wheel from a copy of the sources the images copy (no `build/`
left over from an earlier build can slip in), install it into a fresh virtual environment
(torch first, so pip keeps the CPU build; the other dependencies from pip's cache or PyPI)
and run `mlm-pipeline` from a directory that has no `configs/`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from mlm_pipeline.config_files import load_config

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
    assert "mlm-pipeline = mlm_pipeline_flows.cli:main" in text


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _run([*pip, "torch==2.13.0"], timeout=600, env=env)  # first: pip keeps the CPU build
    _run([*pip, str(wheel)], timeout=900, env=env)
    elsewhere = tmp / "elsewhere"  # no configs/, no flows/, no mlm_pipeline/ here
    elsewhere.mkdir()
    return {"bin": venv / "bin", "env": env, "cwd": elsewhere}


@pytest.mark.slow
def test_installed_command_prints_the_shipped_config(installed, monkeypatch):
    out = _run([str(installed["bin"] / "mlm-pipeline"), "config", "tiny"], timeout=120,
               env=installed["env"], cwd=installed["cwd"]).stdout
    expected = load_config("tiny")
    assert yaml.safe_load(out) == expected.model_dump(mode="json")
    (installed["cwd"] / "my.yaml").write_text(out, encoding="utf-8")
    monkeypatch.chdir(installed["cwd"])
    assert load_config("my.yaml") == expected
    assert load_config("my.yaml").train.warmup == expected.train.warmup == 60


@pytest.mark.slow
def test_installed_flows_import_without_the_checkout(installed):
    python = str(installed["bin"] / "python")
    code = ("import importlib.util, sys; import mlm_pipeline_flows.pretraining as p, "
            "mlm_pipeline_flows.cli; assert importlib.util.find_spec('flows') is None; "
            "print(p.mlm_pretraining.name)")
    out = _run([python, "-c", code], timeout=300, env=installed["env"], cwd=installed["cwd"])
    assert out.stdout.strip() == "mlm-pretraining"
    # the library's own entry has no flow, and says which one has
    proc = subprocess.run([python, "-m", "mlm_pipeline.cli", "run", "tiny"], check=False,
                          capture_output=True, text=True, timeout=120, env=installed["env"],
                          cwd=installed["cwd"])
    assert proc.returncode == 2 and "mlm_pipeline_flows.cli:main" in proc.stderr
