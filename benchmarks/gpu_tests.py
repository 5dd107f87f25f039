"""Run the `gpu`-marked tests for `gpu_check.py`: with pytest when it is installed, else as
plain functions (a GPU image may have torch but not pytest).

The plain runner imports each test module with a stand-in `pytest` module when the real
one is missing (marks, `raises`, `approx`, `importorskip`, `fixture`, `skip`: what the
modules use at import time and the GPU tests use in their bodies), then calls every
function marked `gpu`, once per `parametrize` combination, skipping those whose `skipif`
condition holds and those that need a fixture other than `tmp_path`.

On its own it prints a table of the outcomes:

    python benchmarks/gpu_tests.py [--runner auto|pytest|plain] [--out DIR]
    python benchmarks/gpu_tests.py --smoke     # the plain runner (no pytest process): seconds
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import math
import subprocess
import sys
import tempfile
import traceback
import types
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """Test modules under `root/tests` holding a `@pytest.mark.gpu` test, sorted."""
    return sorted(p for p in (root / "tests").rglob("test_*.py")
                  if "@pytest.mark.gpu" in p.read_text(encoding="utf-8"))


class _Mark:
    """`pytest.mark.<name>(...)` as pytest records it: `fn.pytestmark` gets a `_Mark`."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # applied to the test
            target = args[0]
            target.pytestmark = [*getattr(target, "pytestmark", []), self]
            return target
        return _Mark(self.name, args, kwargs)  # `mark.name(args)`: applied next


class _MarkGenerator:
    """`pytest.mark`: any attribute is a mark of that name."""

    def __getattr__(self, name: str) -> _Mark:
        return _Mark(name)


class _Skipped(Exception):
    """`pytest.skip()` / `importorskip` in the stand-in module."""


class _Approx:
    def __init__(self, expected, rel: float = 1e-6, abs: float = 1e-12) -> None:
        self.expected, self.rel, self.abs = expected, rel, abs

    def __eq__(self, actual) -> bool:
        exp = self.expected if isinstance(self.expected, (list, tuple)) else [self.expected]
        act = actual if isinstance(actual, (list, tuple)) else [actual]
        return len(exp) == len(act) and all(
            math.isclose(a, e, rel_tol=self.rel, abs_tol=self.abs) for a, e in zip(act, exp))


class _Raises:
    def __init__(self, exc, match: str | None = None) -> None:
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is None or not issubclass(kind, self.exc):
            raise AssertionError(f"did not raise {self.exc}")
        return True


def stand_in_pytest() -> types.ModuleType:
    """A minimal `pytest` module for importing test modules without pytest."""
    mod = types.ModuleType("pytest")
    mod.mark = _MarkGenerator()

    def skip(reason: str = "") -> None:
        raise _Skipped(reason)

    def importorskip(name: str, *_, **__):
        try:
            return __import__(name)
        except ImportError as exc:
            raise _Skipped(f"{name} not installed") from exc

    def fixture(*args, **_):
        return args[0] if len(args) == 1 and callable(args[0]) else (lambda fn: fn)

    mod.skip, mod.importorskip, mod.fixture = skip, importorskip, fixture
    mod.raises, mod.approx, mod.param = _Raises, _Approx, lambda *v, **_: v
    return mod


def _cases(marks: list) -> list[dict]:
    """Keyword arguments of every `parametrize` combination (one empty case without)."""
    grids = []
    for m in marks:
        if m.name != "parametrize":
            continue
        names = m.args[0].split(",") if isinstance(m.args[0], str) else list(m.args[0])
        names = [n.strip() for n in names]
        grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in m.args[1]])
    return [{k: v for d in combo for k, v in d.items()} for combo in itertools.product(*grids)]


def run_plain(files: list[Path]) -> list[dict]:
    """Run the `gpu` tests of `files` as plain functions.

    Returns:
        One `{"test", "outcome" (passed|failed|skipped), "detail"}` per test case.
    """
    if importlib.util.find_spec("pytest") is None or sys.modules.get("pytest", 0) is None:
        sys.modules["pytest"] = stand_in_pytest()
    results = []
    for path in files:
        spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 (reported, not raised)
            results.append({"test": path.name, "outcome": "failed", "detail": repr(exc)})
            continue
        for name, fn in vars(module).items():
            marks = getattr(fn, "pytestmark", [])
            if not name.startswith("test_") or not any(m.name == "gpu" for m in marks):
                continue
            skip = next((m for m in marks if m.name == "skipif" and m.args and m.args[0]), None)
            params = inspect.signature(fn).parameters
            for case in _cases(marks):
                test_id = f"{path.name}::{name}" + (
                    f"[{'-'.join(str(v) for v in case.values())}]" if case else "")
                results.append(_run_case(test_id, fn, case, params, skip))
    return results


def _run_case(test_id: str, fn, case: dict, params, skip) -> dict:
    missing = [p for p in params if p not in case and p != "tmp_path"]
    if skip is not None:
        return {"test": test_id, "outcome": "skipped", "detail": skip.kwargs.get("reason", "")}
    if missing:
        return {"test": test_id, "outcome": "skipped",
                "detail": f"needs pytest fixtures {missing}"}
    with tempfile.TemporaryDirectory() as tmp:
        kwargs = {**case, **({"tmp_path": Path(tmp)} if "tmp_path" in params else {})}
        try:
            fn(**kwargs)
        except _Skipped as exc:
            return {"test": test_id, "outcome": "skipped", "detail": str(exc)}
        except Exception:  # noqa: BLE001 (a failing test is reported)
            return {"test": test_id, "outcome": "failed",
                    "detail": traceback.format_exc(limit=-3)[-2000:]}
    return {"test": test_id, "outcome": "passed", "detail": ""}


def run_pytest(files: list[Path], out: Path) -> list[dict]:
    """Run `pytest -m gpu` on `files` in a subprocess; outcomes from its JUnit XML."""
    xml = out / "gpu_tests.junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *map(str, files)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if not xml.is_file():
        return [{"test": "pytest", "outcome": "failed", "detail": proc.stdout[-2000:]
                 + proc.stderr[-2000:]}]
    results = []
    for case in ET.parse(xml).iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = "failed", (child.get("message") or "")[:2000]
            elif child.tag == "skipped":
                outcome, detail = "skipped", child.get("message") or ""
        results.append({"test": f"{case.get('classname')}::{case.get('name')}",
                        "outcome": outcome, "detail": detail})
    return results


def run_gpu_tests(out: Path, runner: str = "auto") -> tuple[str, list[dict]]:
    """Run every `gpu`-marked test; `runner` is `pytest`, `plain` or `auto` (pytest when
    installed). Returns (the runner used, one result per test case)."""
    files = gpu_test_files()
    if runner == "auto":
        runner = "pytest" if importlib.util.find_spec("pytest") is not None else "plain"
    return runner, run_pytest(files, out) if runner == "pytest" else run_plain(files)


def main(argv: list[str] | None = None) -> int:
    """Run the `gpu` tests and print one table row per test case; exit 1 if one failed."""
    import argparse

    ap = argparse.ArgumentParser(description="Run the gpu-marked tests (see gpu_check.py).")
    ap.add_argument("--runner", choices=["auto", "pytest", "plain"], default="auto")
    ap.add_argument("--out", type=Path, default=None,
                    help="where pytest writes its JUnit XML (default: a temporary dir)")
    ap.add_argument("--smoke", action="store_true", help="the plain runner: seconds")
    args = ap.parse_args(argv)
    runner = "plain" if args.smoke else args.runner
    with tempfile.TemporaryDirectory() as tmp:
        used, results = run_gpu_tests(args.out or Path(tmp), runner)
    print(f"gpu tests ({used}):\n")
    print("| test | outcome |")
    print("|---|---|")
    for r in results:
        print(f"| {r['test']} | {r['outcome']} |")
    return 1 if any(r["outcome"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
