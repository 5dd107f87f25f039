"""`benchmarks/gpu_check.py --smoke --tests auto` on the CPU: the GPU check's code paths at
a toy size (its dry run, one timed step per model), in a fresh interpreter where
`prefect`, `mlflow` and `pytest` cannot be imported (the GPU image has none of them); and
its plain test runner on a module of its own. This is also the benchmark's smoke test
(`tests/integration/test_benchmarks_smoke.py` runs the other scripts')."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tests

_BLOCKED_RUN = (
    "import runpy, sys\n"
    "for name in ('prefect', 'mlflow', 'pytest'):\n"
    "    sys.modules[name] = None  # import raises ImportError\n"
    "sys.argv = ['gpu_check.py', *sys.argv[1:]]\n"
    f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_check.py')!r}, run_name='__main__')\n"
)


@pytest.mark.slow  # 14-17 s: in the push tier, beside the README run's long wait
def test_dry_run_writes_json_and_markdown(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _BLOCKED_RUN, "--smoke", "--tests", "auto",
                           "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["ok"] is True
    assert report["imports_prefect_or_mlflow"] == []
    # without pytest the plain runner ran every gpu test, each skipped for want of CUDA
    assert report["tests_runner"] == "plain"
    names = {t["test"] for t in report["tests"]}
    assert {"test_gpu.py::test_fused_adamw_matches_cpu",
            "test_masking.py::test_cuda_matches_cpu[True-exact_k]"} <= names
    assert {t["outcome"] for t in report["tests"]} == {"skipped"}
    # both recipes: ours compile off and on, and the HF peer, at the toy shape
    rows = {(r["recipe"], r["model"], r["compile"]) for r in report["bench"]}
    assert rows == {("bert-base", "ours", False), ("bert-base", "ours", True),
                    ("bert-base", "BertForMaskedLM", False),
                    ("modern-base", "ours", False), ("modern-base", "ours", True),
                    ("modern-base", "ModernBertForMaskedLM", False)}
    for r in report["bench"]:
        # Exact by construction: each row records the step time and the peak it used (the
        # report's peak_tflops is rounded for reading), so no figure depends on the speed.
        assert r["tokens_per_s"] > 0 and r["seq_len"] == 32 and r["batch"] == 4
        assert r["tokens_per_s"] * r["step_ms"] / 1e3 == pytest.approx(4 * 32, rel=1e-12)
        assert r["peak_flops"] > 0
        assert round(r["peak_flops"] / 1e12, 3) == report["peak_tflops"]
        assert r["mfu_pct"] == pytest.approx(
            100 * (4 * 32 / (r["step_ms"] / 1e3)) * r["flops_per_token"] / r["peak_flops"],
            rel=1e-12)
    tiny = report["tiny_training"]
    assert tiny["steps"] == 60 and tiny["loss_falls"]
    assert tiny["last_loss"] <= 0.9 * tiny["first_loss"]
    md = (out / "gpu_check.md").read_text()
    assert md.count("\n| bert-base |") == 3 and md.count("\n| modern-base |") == 3
    assert "result: PASS" in md


def test_plain_runner_runs_marked_tests(tmp_path):
    module = tmp_path / "test_fake_gpu.py"
    module.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("a, b", [(1, 2), (2, 3)])
        @pytest.mark.parametrize("c", ["x"])
        def test_sum(a, b, c):
            assert b - a == 1 and c == "x"

        @pytest.mark.gpu
        def test_fails(tmp_path):
            assert tmp_path.is_dir()
            assert 1 == 2

        @pytest.mark.gpu
        @pytest.mark.skipif(True, reason="never here")
        def test_skipped():
            raise AssertionError

        @pytest.mark.gpu
        def test_needs_fixture(some_fixture):
            pass

        def test_not_gpu():
            raise AssertionError
    """))
    results = {r["test"]: r["outcome"] for r in gpu_tests.run_plain([module])}
    assert results == {"test_fake_gpu.py::test_sum[x-1-2]": "passed",
                       "test_fake_gpu.py::test_sum[x-2-3]": "passed",
                       "test_fake_gpu.py::test_fails": "failed",
                       "test_fake_gpu.py::test_skipped": "skipped",
                       "test_fake_gpu.py::test_needs_fixture": "skipped"}


def test_gpu_test_files_are_found():
    files = {p.name for p in gpu_tests.gpu_test_files()}
    assert {"test_gpu.py", "test_masking.py"} <= files
