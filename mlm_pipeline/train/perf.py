"""Device selection, precision and peak FLOP/s for model-FLOPs utilization (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the device (Chowdhery et al. 2022, PaLM,
appendix B). The peak comes from a table of vendor figures for known GPUs (dense, no
sparsity) and, on CPUs, from a short matmul measurement at the training dtype: CPU peaks
depend on the core count, the vector units and the clock, so no constant would be right.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)

#: Dense bf16 tensor-core peak FLOP/s by GPU name fragment (vendor data sheets, no sparsity).
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, matched first below
    "H100 PCIe": 756e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16 on Volta)
    "T4": 65e12,  # fp16
}


def resolve_device(setting: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU.

    Raises:
        RuntimeError: when `cuda` is requested and no CUDA device is available.
    """
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but torch sees no CUDA device")
    return torch.device(setting)


def resolve_precision(setting: str, device: torch.device) -> str:
    """`auto` -> `bf16` autocast on CUDA devices that support it, `fp32` otherwise.

    Raises:
        RuntimeError: when `bf16` is requested on a CUDA device without bf16 support.
    """
    if setting == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if setting == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError("train.precision=bf16 but this GPU does not support bf16")
    return setting


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name, or None when it is not in the table."""
    for key in sorted(GPU_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return GPU_PEAK_BF16_FLOPS[key]
    return None


@functools.lru_cache(maxsize=8)
def measure_cpu_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024,
                             seconds: float = 0.3) -> float:
    """Measured CPU matmul throughput in FLOP/s (n x n @ n x n, 2 n^3 FLOPs each), with the
    current torch thread count; about `seconds` of work, cached per process."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s used as the MFU denominator for `device` at `precision`.

    Returns:
        The table value for a known GPU, the measured matmul rate on a CPU, None for an
        unknown GPU (MFU is then not reported rather than reported wrongly).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is None:
            logger.warning("no peak FLOP/s known for GPU %r: MFU will not be reported", name)
        return peak
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measure_cpu_matmul_flops(dtype)
