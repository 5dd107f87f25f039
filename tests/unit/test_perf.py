"""Precision, compile and optimizer decisions; peak memory."""

import sys

import pytest
import torch

from mlm_pipeline.train.perf import (
    adamw_impl,
    native_bf16_from_flags,
    peak_memory_mb,
    resolve_compile,
    resolve_precision,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "capability", "want"),
    [
        ({"sse4_2", "avx2", "avx512f", "avx512_bf16"}, "AVX512", True),  # Cooper Lake, Zen 4
        ({"avx512f", "amx_tile", "amx_bf16"}, "AVX512", True),  # Sapphire Rapids
        ({"avx512f", "avx512_vnni"}, "AVX512", False),  # Cascade Lake: no bf16
        ({"avx2", "fma"}, "AVX2", False),
        # bf16 hardware, but torch forced to a lower kernel set (ATEN_CPU_CAPABILITY=avx2)
        ({"avx512f", "avx512_bf16"}, "AVX2", False),
        ({"avx512_bf16"}, "DEFAULT", False),
        (set(), "AVX512", False),
    ],
)
def test_native_bf16_from_flags(flags, capability, want):
    assert native_bf16_from_flags(flags, capability) is want


def test_explicit_precision_is_kept_on_cpu():
    assert resolve_precision("fp32", CPU) == "fp32"
    assert resolve_precision("bf16", CPU) == "bf16"
    assert resolve_precision("auto", CPU) in ("fp32", "bf16")


def test_compile_auto_is_cuda_only():
    assert resolve_compile("auto", CPU) is False
    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("on", CPU) is True
    assert resolve_compile("off", torch.device("cuda")) is False


def test_adamw_impl_builds_a_working_optimizer():
    # The chosen implementation must exist in this torch and step a CPU parameter.
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, **adamw_impl(CPU))
    p.grad = torch.ones(3)
    opt.step()
    # first Adam step moves by lr * sign(grad) (m_hat / sqrt(v_hat) = 1), plus weight decay
    torch.testing.assert_close(p.detach(), torch.full((3,), 1 - 0.1 * 0.01 - 0.1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_peak_memory_is_the_peak_rss():
    _ = torch.ones(32 * 2**20 // 4)  # 32 MiB, so the peak is above the interpreter's base
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm_mb = int(line.split()[1]) / 1024
    assert peak_memory_mb(CPU) == pytest.approx(hwm_mb, rel=0.05)
