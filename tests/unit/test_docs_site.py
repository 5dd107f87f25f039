"""The manual (`docs/`, `mkdocs.yml`) builds as a site with no warning.

`mkdocs build --strict` turns every warning into a failure, and `mkdocs.yml` asks it to
check links: a link to a page or an anchor that does not exist, a page missing from the
navigation, or a link out of `docs/` fails the build. Built in a fresh process into a
temporary directory, so nothing is written into the checkout.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (it is in the dev extra: "
                           "pip install -c constraints.txt -e '.[dev]')")
def test_the_docs_build_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name if p.parent != site else "index" for p in site.glob("**/index.html")}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"
    # the generated reference renders as tables (a broken table would be a paragraph)
    reference = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "<code>train.distributed.nproc_per_node</code></td>" in reference
