"""`mlm-pipeline run` checks local input paths before it starts Prefect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CODE = """
import sys
from mlm_pipeline.cli import main
rc = main(["run", "tiny", "--set", sys.argv[1]])
print("rc", rc, "prefect", "prefect" in sys.modules)
"""


@pytest.mark.parametrize("case", ["missing", "glob", "unsupported", "directory"])
def test_bad_local_source_fails_before_prefect(case, tmp_path):
    (tmp_path / "notes.docx").write_bytes(b"PK")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.docx").write_bytes(b"PK")
    source, named = {
        "missing": (str(tmp_path / "nope.jsonl"), "nope.jsonl' matches no file"),
        "glob": (str(tmp_path / "*.txt"), "*.txt' matches no file"),
        "unsupported": (str(tmp_path / "notes.docx"), "notes.docx: unsupported file type"),
        "directory": (str(tmp_path / "docs"),
                      "docs' has no file of a supported type (.txt, .jsonl"),
    }[case]
    out = subprocess.run([sys.executable, "-c", CODE, f"ingest.sources=[{source!r}]"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert "rc 1 prefect False" in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("mlm-pipeline:")]
    assert len(errors) == 1 and named in errors[0], out.stderr
    assert "Traceback" not in out.stderr
