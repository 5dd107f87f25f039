"""`train/mfu_pct` never exceeds 100 % (issue 17, part 3): the CPU peak is the best of
several matmul timings, a declared peak (`MLM_PIPELINE_PEAK_TFLOPS`) wins, and a peak below
what an interval achieves is raised to it; the peak and its source are logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.train import train
from mlm_pipeline.train.meter import Meter
from mlm_pipeline.train.perf import (
    PEAK_TFLOPS_ENV,
    measure_cpu_matmul_flops,
    peak_flops,
    peak_source,
)

#: One busy process per core: numpy matmuls, single-threaded each, until killed.
_SPIN = ("import os, numpy as np\n"
         "a = np.random.default_rng(0).random((256, 256))\n"
         "while True:\n    a @ a\n")


def _records(manifest) -> list[dict]:
    return [json.loads(line)
            for line in manifest.file(manifest.metrics_log).read_text().splitlines()]


class _Unload:
    """A metrics sink that stops the background load once training has logged a step, so
    the rest of training runs faster than when the peak was measured (the case that gave
    MFU above 100 %)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    def log(self, metrics: dict[str, float], step: int) -> None:
        for proc in self.procs:
            proc.kill()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_mfu_stays_at_most_100_with_a_background_load(
        tmp_path, monkeypatch, tiny_model_config, tiny_shard_manifest,
        tiny_tokenizer_manifest):
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], env=env)
             for _ in range(os.cpu_count() or 1)]
    try:
        measure_cpu_matmul_flops.cache_clear()  # measured under the load, not earlier
        cfg = TrainConfig(micro_batch_size=8, max_steps=6, warmup_steps=2, log_every=1,
                          precision="fp32", seed=2)
        manifest = train(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                         tiny_tokenizer_manifest, tmp_path / "run", sink=_Unload(procs))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        measure_cpu_matmul_flops.cache_clear()
    records = _records(manifest)
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert 0 < r["train/mfu_pct"] <= 100.0, r
        assert r["train/peak_tflops"] > 0
    assert manifest.peak_source in ("measured", "achieved")
    assert manifest.peak_tflops == records[-1]["train/peak_tflops"]


def test_a_declared_peak_below_the_achieved_rate_is_raised(monkeypatch):
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "1e-12")  # 1 FLOP/s: any step achieves more
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32") == pytest.approx(1.0)
    assert peak_source(cpu) == "declared"
    meter = Meter(cpu, tokens_per_step=64, flops_per_token=1e3,
                  peak_flops=peak_flops(cpu, "fp32"))
    assert meter.peak_source == "declared"
    meter.start()
    meter.update(torch.tensor(8.0), torch.tensor(4))
    metrics = meter.report(step=1, lr=1e-3, grad_norm=1.0, epoch=0, tokens_seen=64)
    assert metrics["train/mfu_pct"] == pytest.approx(100.0)
    # The raised peak is the achieved rate: FLOPs per token times tokens/s.
    assert metrics["train/peak_tflops"] == pytest.approx(
        1e3 * metrics["train/tokens_per_s"] / 1e12)
    assert meter.peak_source == "achieved"


def test_a_declared_peak_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match=f"{PEAK_TFLOPS_ENV}='fast'"):
        peak_flops(torch.device("cpu"), "fp32")

