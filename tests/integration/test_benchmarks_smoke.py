"""Every script under `benchmarks/` still runs: its `--smoke` mode (tiny shapes, the same
code path as the full benchmark) in a fresh process exits 0 and prints its table. No
figure is checked: a smoke run's timings mean nothing, only that the code still works
against the library's current API.

The scripts' processes are forked, one after the other, from one interpreter that has
imported what they all import (torch and its compiler, transformers' BERT classes,
scikit-learn, pyarrow, SentencePiece, the library): each script still starts from a fresh
state and its changes die with it, without paying ~4 s of imports each (the suite ran six
interpreters: 29 s, of which about 20 s imports). `bench_retrain.py` (slow) runs in its own
interpreter, as before.

`gpu_check.py --smoke` is run (with more checks) by `test_gpu_check.py`.
"""

from __future__ import annotations

import json
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
                          "| hf-modernbert |", "most-frequent-token baseline accuracy",
                          "equal steps (3), trained at 0.15 masking, evaluated at 0.15",
                          "equal wall clock (0.25 s), trained at 0.15 masking",
                          "downstream (first task; first seed, equal steps)",
                          "| model | probe | probe, random init | fine-tuned | from scratch |"],
    "bench_masking.py": ["B method", "HF DataCollatorForLM", "ours bernoulli",
                         "ours whole-word exact_k"],
    "bench_retrain.py": ["| version | run | parent | corpus | tokenizer | shards | steps |",
                         "| v1-scratch | - |", "| first |", "| eval/bits_per_char |",
                         "Runs v2-continue and v2-scratch evaluated on the same shards",
                         "Warm-start saving at step 6"],
    "bench_train.py": ["modern-fp32  (1 rounds x 1 steps", "modern-bf16  (1 rounds x 1 steps",
                       "bert-fp32  (1 rounds x 1 steps", "ours modern", "HF BertForMaskedLM",
                       "ratio ours/HF"],
    "sweep_lr.py": ["bert on tiny:", "| lr | warm-up | eval masked accuracy",
                    "| 0.0001 | 0.06 |", "| 0.001 | 0.06 |", "best: lr"],
    "bench_validation.py": ["the variants' training data are byte-identical: one model",
                            "| ingest.validation_dedup | validation docs / rows |",
                            "masked accuracy at 0.15", "| none |", "| lines |"],
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


#: The environment of the scripts: one OpenMP thread, as their smoke modes use for torch.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}

#: The interpreter the fast scripts are forked from: it imports what they import (never
#: running a torch operation, so no OpenMP thread pool exists to be forked), then for each
#: `[script, workdir]` of argv[1] forks a child that runs the script as `__main__` in
#: `workdir` (its TMPDIR too), stdout and stderr to files there, and writes its exit
#: status to `workdir/status`. One child at a time, as the scripts ran before.
_ZYGOTE = r"""
import json, os, runpy, sys, tempfile, traceback
import numpy, pyarrow, sentencepiece, sklearn.linear_model, torch, torch._dynamo
from transformers import BertForMaskedLM, ModernBertForMaskedLM
import mlm_pipeline.evaluate.stage, mlm_pipeline.train, mlm_pipeline.train.checkpoint
for script, workdir in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(workdir)
            os.environ["TMPDIR"] = workdir
            tempfile.tempdir = None  # gettempdir() reads TMPDIR again
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT), fd)
            sys.argv = [script, "--smoke"]
            sys.path[0] = os.path.dirname(script)  # as `python script`: its folder first
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(workdir, "status"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, Path]:
    """Run every fast script's smoke mode (forked from one interpreter, `_ZYGOTE`); the
    working directory of each (`stdout`, `stderr`, `status` inside)."""
    fast = sorted(set(EXPECTED) - SLOW)
    dirs = {s: tmp_path_factory.mktemp(s.removesuffix(".py")) for s in fast}
    jobs = [[str(BENCHMARKS / s), str(d)] for s, d in dirs.items()]
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(jobs)], env=ONE_THREAD,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dirs


@pytest.mark.parametrize("script", [
    pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in sorted(EXPECTED)])
def test_smoke_run_prints_its_table(script, tmp_path, request):
    if script in SLOW:
        env = {**ONE_THREAD, "TMPDIR": str(tmp_path)}  # a fresh interpreter of its own
        if script in PREFECT_API:
            env["PREFECT_API_URL"] = request.getfixturevalue("prefect_api_url")
        proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        workdir = request.getfixturevalue("smoke_runs")[script]
        status = workdir / "status"
        assert status.exists(), f"{script}: its forked process left no exit status"
        code = int(status.read_text())
        out, err = (workdir / "stdout").read_text(), (workdir / "stderr").read_text()
    assert code == 0, out[-3000:] + err[-3000:]
    missing = [line for line in EXPECTED[script] if line not in out]
    assert not missing, f"{script} --smoke did not print {missing}:\n{out[-3000:]}"
    if script == "bench_data.py":
        # `datasets` (the HF peer) is outside the dev extra: skipped with a note, not a failure
        try:
            import datasets  # noqa: F401
        except ImportError:
            assert "skipped: `datasets` is not installed" in out
