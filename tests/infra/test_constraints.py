"""One set of tested versions: `constraints.txt` pins what CI installs (`.ci/run`), what the
images install (infra/docker/*.Dockerfile) and what the README's reproducible install uses;
pyproject.toml keeps ranges. Offline checks of the files, plus (under CI=true, where
`.ci/run` installed with the constraints) that the running environment is that set.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
CI_RUN = ROOT / ".ci" / "run"
DOCKERFILES = sorted((ROOT / "infra" / "docker").glob("*.Dockerfile"))
# Extras the constraints need not pin: benchmark-only packages, never installed by CI or
# an image.
UNPINNED_EXTRAS = {"bench"}
PIP_INSTALL = re.compile(r"pip install\b[^&;|\n]*")


def _pins() -> dict[str, str]:
    """Canonical package name -> exact version, from constraints.txt; every line is
    `name==version` (comments and blank lines aside)."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.!+_-]+)", line)
        assert m, f"constraints.txt:{n}: {raw!r} is not an exact `name==version` pin"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _pyproject_requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for the dependencies and every optional group but the
    benchmarks'."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for group, items in project["optional-dependencies"].items():
        if group not in UNPINNED_EXTRAS:
            reqs += [(f"[{group}]", Requirement(r)) for r in items]
    return reqs


def _pip_installs(text: str) -> list[str]:
    """Every `pip install ...` command in a shell script or Dockerfile (continuation lines
    joined, comments dropped)."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return PIP_INSTALL.findall(re.sub(r"\\\n", " ", "\n".join(lines)))


def test_every_pyproject_dependency_is_pinned_within_its_range():
    pins = _pins()
    for where, req in _pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject {where}: {req} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject {where}: {req}")


def test_torch_is_pinned_by_version_only():
    # CI and the CPU image take the CPU build (2.13.0+cpu), the CUDA image PyPI's build:
    # a local label in the pin would refuse one of them.
    torch = _pins()["torch"]
    assert Version(torch).local is None, torch


def test_ci_and_every_image_install_only_through_constraints_txt():
    """Versions come from one file: every pip install in CI and the Dockerfiles reads
    constraints.txt and names no version of its own (no `==`, no *_VERSION build arg)."""
    sources = {".ci/run": CI_RUN.read_text()}
    sources |= {f"infra/docker/{d.name}": d.read_text() for d in DOCKERFILES}
    assert len(sources) == 4
    for where, text in sources.items():
        installs = _pip_installs(text)
        assert installs, f"{where}: no pip install"
        for cmd in installs:
            target = re.search(r"-c\s+(\S+)", cmd)
            assert target, f"{where}: `{cmd.strip()}` does not read the constraints"
            assert Path(target.group(1)).name == "constraints.txt", f"{where}: {cmd}"
            assert "==" not in cmd and not re.search(r"[<>]=?", cmd), (
                f"{where}: `{cmd.strip()}` pins a version itself (put it in constraints.txt)")
        assert not re.search(r"ARG \w*_VERSION", text), f"{where}: a version build arg"
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert re.search(r"^COPY constraints\.txt ", text, re.MULTILINE), dockerfile.name
        copied = re.search(r"^COPY constraints\.txt (\S+)", text, re.MULTILINE).group(1)
        dest = copied if copied.endswith(".txt") else "constraints.txt"
        for cmd in _pip_installs(text):
            assert re.search(r"-c\s+(\S+)", cmd).group(1) == dest, (dockerfile.name, cmd)


def test_images_install_only_pinned_packages():
    """Besides the project itself, an image names only packages the constraints pin (so
    none floats)."""
    pins = _pins()
    for dockerfile in DOCKERFILES:
        for cmd in _pip_installs(dockerfile.read_text()):
            words = re.sub(r"(-c|--index-url|--extra-index-url)\s+\S+", " ", cmd).split()[2:]
            names = [w.strip("\"'") for w in words if not w.startswith("-")]
            for name in names:
                if name.startswith("."):  # the project, its extras pinned via pyproject
                    continue
                assert canonicalize_name(name) in pins, f"{dockerfile.name}: {name} unpinned"


def test_servers_and_prefect_yaml_run_the_pinned_versions():
    pins = _pins()
    services = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())["services"]
    prefect_tag = services["prefect-server"]["image"].rpartition(":")[2].split("-")[0]
    mlflow_tag = services["mlflow"]["image"].rpartition(":")[2]
    assert prefect_tag == pins["prefect"]
    assert mlflow_tag == pins["mlflow"]
    prefect_yaml = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert prefect_yaml["prefect-version"] == pins["prefect"]


def test_readme_install_lines_use_the_constraints():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    installs = [c for c in _pip_installs(quickstart) if "-e" in c.split()]
    assert len(installs) == 2, installs
    for cmd in installs:
        assert "-c constraints.txt" in cmd, cmd



def _index_options(cmd: str) -> list[str]:
    """The index options of a pip command (`--index-url URL`, `--extra-index-url URL`)."""
    return re.findall(r"--(?:extra-)?index-url\s+\S+", cmd)


def test_ci_installs_torch_as_the_readme_does():
    """The same torch: the README's Quickstart torch install and CI's name the same
    constraints and the same package index (PyTorch's CPU build)."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    ours = [c for c in _pip_installs(quickstart) if re.search(r"\storch(\s|$)", c)]
    ci = [c for c in _pip_installs(CI_RUN.read_text()) if re.search(r"\storch(\s|$)", c)]
    assert ours and len(ci) == 1, (ours, ci)
    for cmd in ours:
        assert _index_options(cmd) == _index_options(ci[0]), (cmd, ci[0])
        assert _index_options(cmd) == [
            "--extra-index-url https://download.pytorch.org/whl/cpu"], cmd


@pytest.mark.skipif(os.environ.get("CI") != "true",
                    reason="only CI installs with the constraints (.ci/run)")
def test_ci_environment_is_the_pinned_set():
    pins = _pins()
    differ = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and Version(Version(dist.version).public) != Version(pins[name]):
            differ[name] = (pins[name], dist.version)
    assert not differ, f"installed versions differ from constraints.txt: {differ}"
