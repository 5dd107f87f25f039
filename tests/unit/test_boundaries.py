"""House rules that the import graph and module sizes must keep (STYLE rules 1, 3 and 4)."""

import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlm_pipeline

ALL_MODULES = sorted(
    m.name for m in pkgutil.walk_packages(mlm_pipeline.__path__, prefix="mlm_pipeline.")
)
CHEAP_MODULES = [
    "mlm_pipeline.config",
    "mlm_pipeline.manifest",
    "mlm_pipeline.ingest.stage",
    "mlm_pipeline.ingest.readers",
    "mlm_pipeline.ingest.sources",
    "mlm_pipeline.ingest.cleaning",
    "mlm_pipeline.ingest.corpora",
    "mlm_pipeline.ingest.page_text",
    "mlm_pipeline.tokenizer.stage",
    "mlm_pipeline.ingest.documents",
    "mlm_pipeline.tracking.tracker",
    "mlm_pipeline.tracking.sink",
    "mlm_pipeline.tracking.records",
    "mlm_pipeline.cli",
]


def _imported_after(module: str) -> set[str]:
    code = (
        f"import sys, json, importlib; importlib.import_module({module!r}); "
        "print(json.dumps(sorted(k.split('.')[0] for k in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_every_module_is_found():
    # The list the other tests iterate over must not be empty or stale.
    for name in ("mlm_pipeline.masking.keyed", "mlm_pipeline.train.loop", "mlm_pipeline.evaluate.stage"):
        assert name in ALL_MODULES


@pytest.mark.parametrize("module", ALL_MODULES)
def test_library_never_imports_prefect(module):
    assert "prefect" not in _imported_after(module)


@pytest.mark.parametrize("module", CHEAP_MODULES)
def test_cheap_modules_import_neither_torch_nor_mlflow(module):
    imported = _imported_after(module)
    assert "torch" not in imported
    assert "mlflow" not in imported


#: STYLE rule 4: "modules stay under ~400 lines"; the margin is for docstrings.
MAX_MODULE_LINES = 460


@pytest.mark.parametrize("module", ALL_MODULES)
def test_modules_stay_short(module):
    spec = importlib.util.find_spec(module)
    lines = len(Path(spec.origin).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{spec.origin}: {lines} lines; split it (STYLE rule 4)"
