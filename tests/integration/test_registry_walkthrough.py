"""The manual's registry walk-through ("From MLflow: the run's model and the registry") as a
user runs it: the commands are read from docs/models.md (the ```bash block after "Three runs of
the tiny config on the test corpus") and run in order, each with `bash -c` in a fresh
process, from one temporary directory holding the test corpus at the path the block names.

The block's own lines are used: `export MLFLOW_TRACKING_URI=...` and `S="..."` before each
command, the three `mlm-pipeline run` lines with the `#   Decision: ...` comment under each,
`fill-mask` and `export` on `models:/mlm-pipeline-tiny@champion`. The runs use the
session's Prefect server (`prefect_api_url`).

Checked: each run prints the decision word of its comment in the page (`first`, `kept`,
`promoted`) in a sentence of the page's shape; three versions exist and the champion is
version 3; `fill-mask` and `export` exit 0, and the exported directory loads with
transformers' `AutoModelForMaskedLM`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "models.md"
BIN = Path(sys.executable).parent
#: A `Decision:` sentence of each kind, numbers as patterns (`app.decide`).
SHAPES = {
    "first": r"version \d+ is the first champion of '[\w-]+'",
    "kept": r"eval/loss \d+\.\d{4} >= champion version \d+'s \d+\.\d{4} on the same data: "
            r"champion stays",
    "promoted": r"eval/loss \d+\.\d{4} < champion version \d+'s \d+\.\d{4} on the same "
                r"data: version \d+ is champion",
}


def walkthrough_block() -> str:
    """The ```bash block after "Three runs of the tiny config on the test corpus"."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("## From MLflow: the run's model and the registry", 1)[1]
    after = section.split("Three runs of the tiny config on the test corpus", 1)[1]
    match = re.search(r"```bash\n(.*?)```", after, re.DOTALL)
    assert match, "docs/models.md: no ```bash block after the registry walk-through's intro"
    return match.group(1)


def walkthrough() -> tuple[str, list[tuple[str, str]], str, str]:
    """(the setup lines, [(run command, its decision comment in the page)], the fill-mask
    command, the export command), as written in the block."""
    lines = walkthrough_block().splitlines()
    joined, current = [], ""
    for line in lines:  # backslash continuations make one line
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            joined.append(current)
            current = ""
    setup = [line for line in joined if line.startswith(("export MLFLOW_TRACKING_URI=", "S="))]
    assert len(setup) == 2, setup
    runs = []
    for i, line in enumerate(joined):
        if line.startswith("mlm-pipeline run "):
            comment = joined[i + 1].strip()
            assert comment.startswith("#   Decision: "), comment
            runs.append((line.strip(), comment.removeprefix("#   Decision: ")))
    fill = [ln for ln in joined if ln.startswith("mlm-pipeline fill-mask models:/")]
    export = [ln for ln in joined if ln.startswith("mlm-pipeline export models:/")]
    assert len(runs) == 3 and len(fill) == 1 and len(export) == 1, joined
    return "\n".join(setup), runs, fill[0], export[0].split("#", 1)[0].strip()


def test_the_block_is_found_and_read():
    setup, runs, fill, export = walkthrough()
    assert [c.split(":", 1)[0] for _, c in runs] == ["first", "kept", "promoted"]
    assert all("$S" in command for command, _ in runs)
    assert "@champion" in fill and export.endswith("my-model")


@pytest.mark.full  # one slice of the landings in CI; the Quickstart test runs on every push
@pytest.mark.slow  # three runs of the tiny pipeline (60, 10 and 200 steps) in fresh processes
@pytest.mark.timeout(2700)  # about 15 minutes on 2 busy cores
def test_the_registry_walkthrough_works_as_printed(tmp_path, prefect_api_url):
    setup, runs, fill, export = walkthrough()
    (tmp_path / "tests" / "assets").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "assets" / "tiny_fr.txt", tmp_path / "tests" / "assets")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "MLM_PIPELINE"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env['PATH']}", PREFECT_API_URL=prefect_api_url,
               PREFECT_HOME=str(tmp_path / "prefect-home"), MLFLOW_DISABLE_TELEMETRY="true")

    def bash(command: str) -> str:
        done = subprocess.run(["bash", "-c", f"set -e\n{setup}\n{command}"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=1800)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{out[-4000:]}"
        return out

    for command, comment in runs:
        out = bash(command)
        word = comment.split(":", 1)[0]
        printed = re.findall(r"Decision: (\w+): (.*)", out)
        assert len(printed) == 1, out[-4000:]
        print(f"{command.split()[-1]}: Decision: {printed[0][0]}: {printed[0][1]}")
        assert printed[0][0] == word, (comment, printed, out[-3000:])
        assert re.fullmatch(SHAPES[word], printed[0][1].strip()), printed[0][1]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'mlm-pipeline-tiny'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]
    assert int(client.get_model_version_by_alias("mlm-pipeline-tiny", "champion").version) == 3
    assert len({v.run_id for v in versions}) == 3  # three runs, none continued another

    assert bash(fill).strip()  # the top 3 tokens
    bash(export)
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "my-model")
    assert model.config.hidden_size == 64  # the walk-through's model.hidden_size
