"""House rules that the import graph and module sizes must keep (STYLE rules 1, 3 and 4;
DESIGN, "Rules of the house").

Rules checked here, one test each:

1. No module under `mlm_pipeline/` imports `prefect`.
2. No module under `mlm_pipeline/` imports the flows (`flows` or `mlm_pipeline_flows`):
   `mlm-pipeline run` gets the flow from the console script's entry, `flows/console.py`.
3. Only `mlm_pipeline/tracking/` and `mlm_pipeline/app/` import `mlflow`.
4. No module imports a level above its own. Levels, lowest first: the ground floor
   (`mlm_pipeline/__init__.py`, `config`, `config_files`, `errors`, `locks`, `manifest`,
   `progress`, `sinks`, `store`), then the stages `ingest`, `tokenizer`, `masking`,
   `shards`, `train`, `evaluate`, `tracking`, then the application layer `app` (the
   verbs), then the command line `cli`. A module may import its own
   level and the levels below it, so the ground floor imports no stage, no stage imports
   `app` and nothing but the command line imports it.
5. Every file and folder under `mlm_pipeline/` has a level in rule 4 (a new top-level
   module must be placed before it can be imported).
6. Importing any `mlm_pipeline` module in a fresh interpreter leaves `prefect` out of
   `sys.modules` (what rules 1 and 2 miss: an import through a third-party package).
7. Importing a cheap module in a fresh interpreter leaves `torch` and `mlflow` out of
   `sys.modules`. Cheap: the package itself, `config`, `config_files`, `manifest`, `cli`,
   and every module of `ingest/`, `tokenizer/`, `tracking/` and `app/`
   (mlflow and torch are imported lazily there).
8. No module is longer than 600 lines; past 400 a warning asks for the seam (STYLE rule 4).
9. `mlm_pipeline/tracking/` talks to MLflow and nothing else: none of its modules imports
   `train` or `evaluate`, not even inside a function (work that needs a model and MLflow,
   re-scoring the champion or resolving a warm-start parent, is composed in `app/`).
10. No import circle between modules of `mlm_pipeline` (every import that runs counted,
   module level and inside functions; one under `if TYPE_CHECKING:` never runs, and a
   module importing its own package's `__init__` is not a circle).
11. Every module and sub-package of a package is named (in backquotes) in its package's
   room list, the docstring of its `__init__.py`: a newcomer finds every room from there.

Rules 6 and 7 hold for each module iff they hold for all of them imported together, so
each imports all its modules in one fresh interpreter; only when that one sees a forbidden
name does it import each module in an interpreter of its own, to name the offenders.

Rules 1-4 read every import statement of every module with `ast`: module level and inside
functions, `import x` and `from x import y` (`y` counted as the module `x.y` too), relative
imports resolved against the module's package, and `importlib.import_module("x")` /
`__import__("x")` with a literal name.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

import mlm_pipeline

PACKAGE_DIR = Path(mlm_pipeline.__file__).resolve().parent
#: Every module file under mlm_pipeline/ (from the file system, not `pkgutil`, which skips
#: the modules of a package whose `__init__` fails to import).
FILES = {p: p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
         for p in sorted(PACKAGE_DIR.rglob("*.py"))}
ALL_MODULES = sorted(
    ".".join(parts[:-1] if parts[-1] == "__init__" else parts) for parts in FILES.values()
)
GROUND_FLOOR = ("config", "config_files", "errors", "locks", "manifest", "progress", "sinks",
                "store")
STAGES = ("ingest", "tokenizer", "masking", "shards", "train", "evaluate", "tracking")
#: The application layer: the verbs, composed from the stages, for the CLI and the flows.
APP = ("app",)
TOP = ("cli",)
#: Level of each top-level name under `mlm_pipeline` (rule 4); `None` = the package itself.
LEVELS = {
    None: 0,
    **{name: 0 for name in GROUND_FLOOR},
    **{name: 1 + i for i, name in enumerate(STAGES)},
    **{name: 1 + len(STAGES) for name in APP},
    **{name: 2 + len(STAGES) for name in TOP},
}
CHEAP_MODULES = sorted(
    m for m in ALL_MODULES
    if m.split(".")[1:2] in ([], ["config"], ["config_files"], ["errors"], ["manifest"], ["cli"],
                             ["ingest"], ["tokenizer"], ["tracking"], ["app"])
)


class Import(NamedTuple):
    """One module name an import statement brings in."""

    importer: str  # dotted name of the importing module
    line: int
    target: str  # dotted name imported
    typing_only: bool = False  # under `if TYPE_CHECKING:` (never run)

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def imports_in(source: str, module: str, is_package: bool) -> Iterator[Import]:
    """Every module name that `source` (the code of `module`) imports, anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name, id(node) in typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            hint = id(node) in typing_only
            yield Import(module, node.lineno, base, hint)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(module, node.lineno, f"{base}.{alias.name}", hint)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)):
                yield Import(module, node.lineno, first.value)


def _all_imports() -> list[Import]:
    found = []
    for path, parts in FILES.items():
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        found += imports_in(path.read_text(encoding="utf-8"), module, is_package)
    return found


IMPORTS = _all_imports()


def _top(name: str) -> str:
    return name.split(".")[0]


def _level(module: str) -> int | None:
    """Rule-4 level of an `mlm_pipeline` module; None outside the package or for a name
    that is not a module (`from mlm_pipeline import __version__`)."""
    parts = module.split(".")
    if parts[0] != "mlm_pipeline":
        return None
    return LEVELS.get(parts[1] if len(parts) > 1 else None)


def test_the_scanner_sees_every_kind_of_import():
    source = (
        "import prefect\n"
        "from .. import flows\n"
        "from .stage import x\n"
        "def f():\n"
        "    from mlm_pipeline.tracking import records\n"
        "    import importlib; importlib.import_module('mlflow.tracking')\n"
        "if TYPE_CHECKING:\n"
        "    from mlm_pipeline.train import loop\n"
    )
    found = list(imports_in(source, "mlm_pipeline.ingest.sources", False))
    assert {i.target for i in found if i.typing_only} == {"mlm_pipeline.train",
                                                          "mlm_pipeline.train.loop"}
    got = {i.target for i in found}
    assert {"prefect", "mlm_pipeline.flows", "mlm_pipeline.ingest.stage.x",
            "mlm_pipeline.tracking.records", "mlflow.tracking"} <= got
    got = {i.target for i in imports_in("from . import corpora", "mlm_pipeline.ingest", True)}
    assert got == {"mlm_pipeline.ingest", "mlm_pipeline.ingest.corpora"}
    assert len(IMPORTS) > 100 and any(i.importer == "mlm_pipeline.cli" for i in IMPORTS)


def test_rule_1_no_prefect():
    bad = [str(i) for i in IMPORTS if _top(i.target) == "prefect"]
    assert not bad, "the library never imports Prefect (STYLE rule 1):\n" + "\n".join(bad)


def test_rule_2_no_flows():
    bad = [str(i) for i in IMPORTS if _top(i.target) in ("flows", "mlm_pipeline_flows")]
    assert not bad, ("the library never imports the flows; `run` gets its flow from the "
                     "console script (flows/console.py):\n" + "\n".join(bad))


def test_rule_3_mlflow_only_in_tracking_and_app():
    bad = [str(i) for i in IMPORTS if _top(i.target) == "mlflow"
           and _level(i.importer) not in (LEVELS["tracking"], LEVELS["app"])]
    assert not bad, ("only mlm_pipeline/tracking/ and mlm_pipeline/app/ talk to MLflow:\n"
                     + "\n".join(bad))


def _imports_above(i: Import) -> bool:
    """True when `i` imports a module of a level above its importer's (rule 4)."""
    mine, theirs = _level(i.importer), _level(i.target)
    return theirs is not None and mine is not None and theirs > mine


def test_rule_4_places_app_between_the_stages_and_the_command_line():
    # The layers as a newcomer reads them: stages < app < cli; a stage importing app is
    # refused, app may import a stage, the command line may import app, app not the CLI.
    assert _imports_above(Import("mlm_pipeline.tracking.records", 1, "mlm_pipeline.app.gc"))
    assert _imports_above(Import("mlm_pipeline.train.loop", 1, "mlm_pipeline.app"))
    assert _imports_above(Import("mlm_pipeline.app.gc", 1, "mlm_pipeline.cli"))
    assert not _imports_above(Import("mlm_pipeline.app.gc", 1, "mlm_pipeline.tracking.tracker"))
    assert not _imports_above(Import("mlm_pipeline.cli", 1, "mlm_pipeline.app.gc"))


def test_rule_4_no_import_of_a_stage_above():
    bad = [str(i) for i in IMPORTS if _imports_above(i)]
    order = " < ".join(["ground floor", *STAGES, *APP, *TOP])
    assert not bad, f"a module imports a level above its own ({order}):\n" + "\n".join(bad)


def test_rule_5_every_module_has_a_level():
    names = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE_DIR.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert names <= set(LEVELS), f"place these in LEVELS: {sorted(names - set(LEVELS))}"


def test_rule_9_tracking_imports_neither_train_nor_evaluate():
    bad = [str(i) for i in IMPORTS if i.importer.startswith("mlm_pipeline.tracking")
           and i.target.split(".")[1:2] in (["train"], ["evaluate"])]
    assert not bad, ("tracking/ only talks to MLflow; compose model work in app/:\n"
                     + "\n".join(bad))


def _module_graph() -> dict[str, set[str]]:
    """Importer -> the `mlm_pipeline` modules it imports (a `from x import y` counts as
    `x.y` when that is a module, else as `x`), edges to an importer's own package left out."""
    graph: dict[str, set[str]] = {m: set() for m in ALL_MODULES}
    for i in IMPORTS:
        if i.typing_only:
            continue
        target = i.target if i.target in graph else i.target.rpartition(".")[0]
        if target in graph and target != i.importer and not i.importer.startswith(
                target + "."):
            graph[i.importer].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_rule_10_no_import_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
    found = _cycle(_module_graph())
    assert found is None, "an import circle: " + " -> ".join(found or [])


PACKAGES = sorted({p.parent for p in FILES if p.name == "__init__.py"})


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_rule_11_every_room_is_in_its_package_room_list(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    named = {part for name in re.findall(r"`([\w.]+)`", doc or "") for part in name.split(".")}
    rooms = {p.stem if p.suffix == ".py" else p.name for p in package.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert rooms <= named, (f"{package / '__init__.py'}: name these rooms in its docstring: "
                            f"{sorted(rooms - named)}")


def _imported_by(modules: list[str]) -> frozenset[str]:
    """Top-level names in `sys.modules` after importing every module of `modules`, in order,
    in one fresh interpreter.

    Raises:
        AssertionError: an import failed (its traceback is in the message).
    """
    code = (
        f"import sys, json, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, f"import of {modules} failed:\n{out.stderr[-2000:]}"
    return frozenset(json.loads(out.stdout))


def _offenders(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """`modules` whose import brings in a name of `forbidden`, as lines naming each module
    and what it brings in: one fresh interpreter for all of them, then (only when that one
    sees a forbidden name) one per module, to name the culprits."""
    if not set(forbidden) & _imported_by(modules):
        return []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        seen = dict(zip(modules, pool.map(lambda m: _imported_by([m]), modules)))
    return [f"{m} imports {', '.join(sorted(set(forbidden) & names))}"
            for m, names in seen.items() if set(forbidden) & names]


def test_every_module_is_found():
    # The lists the other tests iterate over must not be empty or stale.
    for name in ("mlm_pipeline.masking.keyed", "mlm_pipeline.train.loop",
                 "mlm_pipeline.evaluate.stage", "mlm_pipeline.config_files"):
        assert name in ALL_MODULES
    for name in ("mlm_pipeline.cli", "mlm_pipeline.ingest.stage", "mlm_pipeline.tracking.records",
                 "mlm_pipeline.app.consumers"):
        assert name in CHEAP_MODULES


def test_rule_6_library_never_imports_prefect():
    bad = _offenders(ALL_MODULES, ("prefect",))
    assert not bad, ("importing these modules in a fresh interpreter imports Prefect "
                     "(STYLE rule 1):\n" + "\n".join(bad))


def test_rule_7_cheap_modules_import_neither_torch_nor_mlflow():
    bad = _offenders(CHEAP_MODULES, ("torch", "mlflow"))
    assert not bad, ("cheap modules import neither torch nor mlflow at import time "
                     "(STYLE rule 3):\n" + "\n".join(bad))


def test_the_fresh_interpreter_check_names_the_offender(tmp_path, monkeypatch):
    # Three stand-in modules: `h4_dirty` imports `h4_forbidden`, `h4_clean` does not. The
    # check over both sees the forbidden name, and the per-module pass names `h4_dirty` alone.
    (tmp_path / "h4_forbidden.py").write_text("")
    (tmp_path / "h4_clean.py").write_text("import os\n")
    (tmp_path / "h4_dirty.py").write_text("import h4_forbidden\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    assert _offenders(["h4_clean", "h4_dirty"], ("h4_forbidden",)) == [
        "h4_dirty imports h4_forbidden"]
    assert _offenders(["h4_clean"], ("h4_forbidden",)) == []


#: STYLE rule 4: past ~400 lines look for the seam, past 600 split along it.
WARN_MODULE_LINES = 400
MAX_MODULE_LINES = 600


@pytest.mark.parametrize("module", ALL_MODULES)
def test_rule_8_modules_stay_short(module):
    spec = importlib.util.find_spec(module)
    lines = len(Path(spec.origin).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{spec.origin}: {lines} lines; split it along a seam (STYLE rule 4)"
    if lines > WARN_MODULE_LINES:
        import warnings
        warnings.warn(f"{spec.origin}: {lines} lines; past {WARN_MODULE_LINES}, look for the seam "
                      "(STYLE rule 4)", stacklevel=1)
