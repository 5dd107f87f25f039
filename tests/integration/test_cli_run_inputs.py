"""`mlm-pipeline run` checks local input paths before it starts Prefect; the library's own
`main` runs the flow only when the entry point hands it one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The console script's entry (installed as mlm_pipeline_flows.console), as the checkout has it.
CODE = """
import sys
from mlm_pipeline_flows.console import main
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


def test_run_without_a_flow_names_the_entry_point(capsys):
    from mlm_pipeline.cli import main

    assert main(["run", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "mlm_pipeline_flows.console:main" in err
    assert "python -m mlm_pipeline_flows.console run" in err


@pytest.fixture
def run_in_tmp(tmp_path, monkeypatch):
    """`main(["run", ...])` in this process: the config's relative `work_dir` (and so the
    run log, `<work_dir>/logs/`) lands under `tmp_path`, and the two handlers `run` puts on
    the root logger are taken off again (a CLI process exits with them; a test session
    would write every later record to this test's log)."""
    import logging

    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    before = list(root.handlers)
    yield tmp_path
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


def test_run_checks_the_config_then_calls_the_flow_it_was_given(capsys, run_in_tmp):
    from mlm_pipeline.cli import main

    calls = []

    def failing_flow(config: str, overrides: list[str]) -> dict:
        calls.append((config, overrides))
        raise RuntimeError("task train failed")

    assert main(["run", "tiny", "--set", "train.nope=1"], run_flow=failing_flow) == 2
    assert calls == []  # a config error never reaches the flow
    assert main(["run", "tiny", "--set", "train.max_steps=5"], run_flow=failing_flow) == 1
    assert calls == [("tiny", ["train.max_steps=5"])]
    err = capsys.readouterr().err
    assert "mlm-pipeline: error: task train failed" in err
    (log,) = (run_in_tmp / ".mlm-pipeline" / "logs").glob("run-*.log")
    assert f"traceback in {log}" in err and "RuntimeError: task train failed" in log.read_text()


def test_an_interrupted_run_says_how_to_continue_with_the_whole_command(capsys, run_in_tmp):
    from mlm_pipeline.cli import main
    from mlm_pipeline.errors import TrainingInterrupted

    def interrupted_flow(config: str, overrides: list[str]) -> dict:
        raise TrainingInterrupted(7, run_in_tmp / "step-00000007")

    argv = ["run", "tiny", "--set", "train.max_steps=5", "--summary-json", "my summary.json",
            "--fresh"]
    assert main(argv, run_flow=interrupted_flow) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"mlm-pipeline: interrupted at step 7, checkpoint {run_in_tmp}/step-00000007"
                    "; to continue, run the same command: mlm-pipeline run tiny --set "
                    "train.max_steps=5 --summary-json 'my summary.json'")  # --fresh would not
