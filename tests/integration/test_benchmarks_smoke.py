"""Every script under `benchmarks/` still runs: its `--smoke` mode (tiny shapes, the same
code path as the full benchmark) in a fresh process exits 0 and prints its table. No
figure is checked: a smoke run's timings mean nothing, only that the code still works
against the library's current API.

`gpu_check.py --smoke` is run (with more checks) by `test_gpu_check.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

#: script -> lines its smoke run must print (a table's header and a row of each part).
EXPECTED = {
    "bench_checkpoint.py": ["tiny: 15,616 parameters", "model.safetensors", "save"],
    "bench_data.py": ["tokenizer training, vocab 128:", "SentencePiece (ours)",
                      "HF tokenizers Unigram", "encode + pack + write, 1x corpus",
                      "ours, shards stage", "ours, ingest + shards", "encode-only floor",
                      "1x shards stage", "1x ingest + shards"],
    "bench_learning.py": ["| model | mlm accuracy | loss | steps | tokens seen | tokens/s |",
                          "| ours-bert |", "| ours-modern |", "| hf-bert |",
                          "| hf-modernbert |", "most-frequent-token baseline accuracy"],
    "bench_masking.py": ["B method", "HF DataCollatorForLM", "ours bernoulli",
                         "ours whole-word exact_k"],
    "bench_retrain.py": ["| version | run | parent | corpus | tokenizer | shards | steps |",
                         "| v1-scratch | - |", "| first |", "| eval/bits_per_char |",
                         "Runs v2-continue and v2-scratch evaluated on the same shards",
                         "Warm-start saving at step 6"],
    "bench_train.py": ["modern-fp32  (1 rounds x 1 steps", "modern-bf16  (1 rounds x 1 steps",
                       "bert-fp32  (1 rounds x 1 steps", "ours modern", "HF BertForMaskedLM",
                       "ratio ours/HF"],
    "gpu_tests.py": ["gpu tests (plain):", "| test | outcome |",
                     "| test_gpu.py::test_fused_adamw_matches_cpu |"],
}
#: Scripts whose smoke run takes minutes, not seconds: in the slow tier.
#: bench_retrain.py: five `mlm-pipeline run`s through Prefect and MLflow (registry,
#: model export), each a few seconds of overhead whatever the shapes.
SLOW = {"bench_retrain.py"}
#: Scripts that start a local Prefect API unless PREFECT_API_URL is set: given the session's
#: server instead (the API's own start is proved in tests/flows/test_local_api.py).
PREFECT_API = {"bench_retrain.py"}
#: Scripts whose smoke run another test module makes.
ELSEWHERE = {"gpu_check.py": "tests/integration/test_gpu_check.py"}


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(EXPECTED) | set(ELSEWHERE)


@pytest.mark.parametrize("script", [
    pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in sorted(EXPECTED)])
def test_smoke_run_prints_its_table(script, tmp_path, request):
    # A fresh process working in tmp_path, its temporary directories there too (TMPDIR);
    # one OpenMP thread, as the scripts' smoke modes use for torch.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    if script in PREFECT_API:
        env["PREFECT_API_URL"] = request.getfixturevalue("prefect_api_url")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    missing = [line for line in EXPECTED[script] if line not in out]
    assert not missing, f"{script} --smoke did not print {missing}:\n{out[-3000:]}"
    if script == "bench_data.py":
        # `datasets` (the HF peer) is outside the dev extra: skipped with a note, not a failure
        try:
            import datasets  # noqa: F401
        except ImportError:
            assert "skipped: `datasets` is not installed" in out
