"""The generated configuration reference (`docs/configuration.md`).

The page is written by `mlm-pipeline config-reference --out PATH` from the config models.
Checked: the committed page is what the command writes now (run in a fresh process into a
temporary directory), so a new or changed config field cannot leave the docs stale; and
the page has a row for every key a default config holds, found here by walking
`PipelineConfig().model_dump()` (the values, not the fields the generator walks).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from mlm_pipeline.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
REFRESH = "mlm-pipeline config-reference --out docs/configuration.md"


def _dotted_keys(value: object, prefix: str = "") -> set[str]:
    """Every dotted key of a dumped config: sections are dicts, `eval.probes` a list of
    dicts whose keys are spelled `eval.probes[].text`."""
    keys = set()
    if isinstance(value, dict):
        for name, inner in value.items():
            key = f"{prefix}{name}"
            keys.add(key)
            keys |= _dotted_keys(inner, f"{key}.")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                keys |= _dotted_keys(item, f"{prefix.rstrip('.')}[].")
    return keys


def test_the_committed_page_is_what_the_command_writes(tmp_path):
    out = tmp_path / "configuration.md"
    done = subprocess.run([sys.executable, "-m", "mlm_pipeline.cli", "config-reference",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert PAGE.exists(), f"docs/configuration.md is missing: run `{REFRESH}`"
    assert out.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8"), (
        f"docs/configuration.md is stale (the config models changed): run `{REFRESH}` "
        "and commit the page")


def test_the_page_has_a_row_for_every_key_of_a_config():
    rows = set(re.findall(r"^\| `([\w.\[\]]+)` \|", PAGE.read_text(encoding="utf-8"), re.M))
    keys = _dotted_keys(PipelineConfig().model_dump(mode="json"))
    assert {"data.executor", "train.distributed.nproc_per_node", "tracking.keep_last_runs",
            "eval.probes[].answers"} <= keys
    assert not keys - rows, f"keys without a row: {sorted(keys - rows)}"
