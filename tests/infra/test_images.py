"""Each worker image installs what the flows it runs import.

Offline and static: the `pip install` lines of `infra/docker/*.Dockerfile` give what an
image installs (the project with its extras, plus named packages); `prefect.yaml` and
`infra/compose.yaml` give the flows each image runs (a deployment's work pool -> the worker
service or job image of that pool -> its Dockerfile); `ast` follows every import of those
flows through `flows/` and `mlm_pipeline/` (imports inside functions too: they run on some
path, e.g. `data.executor: dask`), and `importlib.metadata.packages_distributions()` maps
each third-party module to its distributions. A module is provided when one of them is a
base dependency, a requirement of an installed extra, or a package the Dockerfile names.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "infra" / "docker"
FIRST_PARTY = {"mlm_pipeline", "mlm_pipeline_flows", "flows"}
#: Flows an image runs besides the deployments of `prefect.yaml` mapped to its pools: the
#: compose `worker-gpu` serves the `local-gpu` pool, where infra/README.md moves any
#: deployment (the main flow included) to run it on the host's GPUs.
EXTRA_FLOWS = {"worker-cuda.Dockerfile": {"flows/pretraining.py"}}
#: (image, third-party module) pairs that an image may lack, each with why: only imports
#: guarded by `except ImportError` with a message naming the extra may be listed. None now.
ALLOWED_MISSING: dict[tuple[str, str], str] = {}
PIP_INSTALL = re.compile(r"pip install\b[^&;|\n]*")


def _pip_installs(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return PIP_INSTALL.findall(re.sub(r"\\\n", " ", "\n".join(lines)))


def image_installs(dockerfile: Path) -> tuple[bool, set[str], set[str]]:
    """(installs the project, its extras, other packages named) of a Dockerfile's
    `pip install` lines."""
    project, extras, named = False, set(), set()
    for cmd in _pip_installs(dockerfile.read_text(encoding="utf-8")):
        words = re.sub(r"(-c|--index-url|--extra-index-url)\s+\S+", " ", cmd).split()[2:]
        for word in (w.strip("\"'") for w in words if not w.startswith("-")):
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)
            if match:
                project = True
                extras |= set(filter(None, (match.group(1) or "").split(",")))
            else:
                named.add(canonicalize_name(Requirement(word).name))
    return project, extras, named


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def provided(extras: set[str], named: set[str]) -> set[str]:
    """Canonical distribution names an image installs directly: the base dependencies, the
    requirements of `extras`, and `named`."""
    project = _pyproject()
    unknown = extras - set(project["optional-dependencies"])
    assert not unknown, f"extras not in pyproject.toml: {sorted(unknown)}"
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {canonicalize_name(Requirement(r).name) for r in reqs} | named


@functools.cache
def flows_of_images() -> dict[str, frozenset[str]]:
    """Dockerfile name -> flow files (repository paths) it runs, from prefect.yaml's
    deployments and the worker images of their pools."""
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text(encoding="utf-8"))
    image_file: dict[str, str] = {}  # image tag -> Dockerfile name
    pool_file: dict[str, str] = {}  # process work pool -> Dockerfile name
    for service in compose["services"].values():
        build = service.get("build")
        if not isinstance(build, dict) or "dockerfile" not in build:
            continue
        name = Path(build["dockerfile"]).name
        image_file[service["image"]] = name
        command = service.get("command") or []
        if "--pool" in command:
            pool_file[command[command.index("--pool") + 1]] = name
    out: dict[str, set[str]] = {name: set(flows) for name, flows in EXTRA_FLOWS.items()}
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text(encoding="utf-8"))
    for dep in deployments["deployments"]:
        pool = dep["work_pool"]
        image = (pool.get("job_variables") or {}).get("image")
        name = image_file[image] if image else pool_file[pool["name"]]
        out.setdefault(name, set()).add(dep["entrypoint"].split(":", 1)[0])
    return {name: frozenset(flows) for name, flows in out.items()}


def _module_file(dotted: str) -> Path | None:
    """The checkout file of a first-party module (`mlm_pipeline.x.y`, `flows.x`,
    `mlm_pipeline_flows.x`), None when there is none."""
    parts = dotted.split(".")
    if parts[0] in ("flows", "mlm_pipeline_flows"):
        parts = ["flows", *parts[1:]]
    elif parts[0] == "mlm_pipeline" and parts[1:2] == ["configs"]:
        parts = ["configs", *parts[2:]]
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@functools.cache
def _imports(path: Path) -> tuple[str, ...]:
    """Absolute dotted names a file imports (relative ones resolved; `if TYPE_CHECKING:`
    blocks skipped; a name `from X import name` may be a submodule, so `X.name` is listed
    too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts if rel.name == "__init__" else rel.parts[:-1])
    if package and package[-1] == "__init__":
        package = package[:-1]
    names: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]
    return tuple(names)


def third_party_imports(flow_files: frozenset[str]) -> dict[str, set[str]]:
    """Top-level third-party module -> the checkout files importing it, over every module
    reachable from `flow_files`."""
    todo = [ROOT / f for f in sorted(flow_files)]
    seen: set[Path] = set()
    found: dict[str, set[str]] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            # the flows import each other as `mlm_pipeline_flows.x`, also when prefect.yaml
            # runs one as a script: a bare neighbour name would be found as third-party
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c imports a, a.b and a.b.c
                    target = _module_file(".".join(parts[:i]))
                    if target is not None:
                        todo.append(target)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed RECORD


def distributions(module: str) -> set[str]:
    """Canonical names of the installed distributions that provide a top-level module."""
    dists = _packages_distributions().get(module)
    assert dists, (f"{module}: no installed distribution provides it here, so it cannot be "
                   f"checked (install the dev environment)")
    return {canonicalize_name(d) for d in dists}


def test_images_and_their_flows_are_found():
    flows = flows_of_images()
    assert set(flows) == {"worker-cpu.Dockerfile", "worker-cuda.Dockerfile"}
    assert {"flows/pretraining.py", "flows/prepare_data.py",
            "flows/train_evaluate.py"} <= flows["worker-cpu.Dockerfile"]
    assert "flows/train_evaluate.py" in flows["worker-cuda.Dockerfile"]
    # the import walk sees through the flows into the library, lazy imports included
    cpu = third_party_imports(flows["worker-cpu.Dockerfile"])
    assert {"prefect", "torch", "mlflow", "transformers", "prefect_dask"} <= set(cpu)
    assert "mlm_pipeline/train/hf.py" in cpu["transformers"]


@pytest.mark.parametrize("dockerfile", sorted(flows_of_images()))
def test_image_installs_what_its_flows_import(dockerfile, capsys):
    project, extras, named = image_installs(DOCKER / dockerfile)
    assert project, f"{dockerfile}: does not pip install the project (`.`)"
    have = provided(extras, named)
    imports = third_party_imports(flows_of_images()[dockerfile])
    missing = {}
    for module, files in sorted(imports.items()):
        if not distributions(module) & have and (dockerfile, module) not in ALLOWED_MISSING:
            missing[module] = sorted(files)
    with capsys.disabled():
        print(f"\n{dockerfile}: extras {sorted(extras)} + {sorted(named)}; "
              f"flows import {sorted(imports)}")
    assert not missing, (f"{dockerfile} installs extras {sorted(extras)} and "
                         f"{sorted(named)}, but its flows import {missing}")


def test_image_parser_reads_extras_and_named_packages(tmp_path):
    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text('RUN pip install --index-url "$I" -c c.txt torch\n'
                          "# RUN pip install -c c.txt commented-out\n"
                          'RUN pip install -c c.txt ".[gpu,s3]" \\\n    boto3 && rm -rf x\n')
    assert image_installs(dockerfile) == (True, {"gpu", "s3"}, {"torch", "boto3"})
