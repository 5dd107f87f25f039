"""Device selection, precision, compilation, peak FLOP/s (MFU) and peak memory.

MFU = achieved model FLOP/s / peak FLOP/s of the device (Chowdhery et al. 2022, PaLM,
appendix B). The peak (`peak_flops`) and its source (`peak_source`) are, in this order:
`declared` in the environment variable `MLM_PIPELINE_PEAK_TFLOPS` (TFLOP/s, any device),
`spec`: a table of vendor figures for known GPUs (dense, no sparsity), or `measured` on
CPUs: the best of several short matmul timings at the training dtype (CPU peaks depend on
the core count, the vector units and the clock, so no constant would be right). A
measurement on a busy machine can still be too low: the `Meter` then raises the peak to the
rate it achieved (source `achieved`), so MFU never exceeds 100 %.

Precision `auto` means bf16 autocast on CUDA devices with bf16 support and on CPUs with
native bf16 instructions (`/proc/cpuinfo` on Linux), fp32 elsewhere: without native
instructions bf16 matmuls are emulated and slower than fp32.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Dense bf16 tensor-core peak FLOP/s by GPU name fragment (vendor data sheets, no sparsity).
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, matched first below
    "H100 PCIe": 756e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "A10G": 70e12,
    "A10": 125e12, "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
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


#: `/proc/cpuinfo` flags of native bf16 arithmetic (Linux kernel names): AVX-512 BF16
#: (Cooper Lake and later, Zen 4) and AMX-BF16 (Sapphire Rapids and later).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16_from_flags(flags: Iterable[str], capability: str) -> bool:
    """Whether a CPU with these `/proc/cpuinfo` flags runs bf16 natively under torch.

    Args:
        flags: the CPU's feature flags (`/proc/cpuinfo` `flags` line, split).
        capability: `torch.backends.cpu.get_cpu_capability()`, e.g. `AVX512`, `AVX2`,
            `DEFAULT`; torch's vectorized kernels only use the bf16 instructions from its
            AVX-512 builds, so a lower capability (e.g. forced by `ATEN_CPU_CAPABILITY`)
            counts as not native.

    Returns:
        True when a bf16 flag is present and the capability is an AVX-512 one.
    """
    return bool(CPU_BF16_FLAGS & set(flags)) and capability.upper().startswith("AVX512")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU has native bf16 instructions torch uses (cached).

    Linux only (`/proc/cpuinfo`); macOS and other systems report False (fp32 is kept).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return native_bf16_from_flags(flags, torch.backends.cpu.get_cpu_capability())


def resolve_precision(setting: str, device: torch.device) -> str:
    """`auto` -> `bf16` autocast on CUDA devices that support it and on CPUs with native
    bf16 (`cpu_has_native_bf16`), `fp32` otherwise; an explicit setting is kept.

    Raises:
        RuntimeError: when `bf16` is requested on a CUDA device without bf16 support.
    """
    if setting == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"
    if setting == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError("train.precision=bf16 but this GPU does not support bf16")
    return setting


def resolve_compile(setting: str, device: torch.device) -> bool:
    """`train.compile`: `auto` -> compile on CUDA only (on CPU, compiling takes tens of
    seconds and needs a C++ compiler, which short CPU runs do not repay); `on`/`off` kept."""
    if setting == "auto":
        return device.type == "cuda"
    return setting == "on"


#: Compiled versions dynamo keeps of one function before it runs that function eagerly for
#: inputs none of them fits (`torch.compile`'s `recompile_limit`; torch's own default is 8).
#: A run needs at most 2 a function: batches are always `micro_batch_size` rows of `seq_len`
#: (`RowCursor` yields full batches only), and the one size that varies, bernoulli
#: masking's count of predicted tokens after the head's `nonzero` graph break, is compiled
#: once static and once symbolic (dynamo's automatic dynamic shapes; `exact_k` masking has
#: a static head and compiles once). 4 leaves room for one change nobody foresaw and stops
#: a shape leak after 4 compilations (each tens of seconds or more) instead of 8.
COMPILE_RECOMPILE_LIMIT = 4


def compile_model(model: torch.nn.Module, device: torch.device, backend: str = "inductor",
                  recompile_limit: int = COMPILE_RECOMPILE_LIMIT) -> torch.nn.Module:
    """`torch.compile(model)`, after checking what the backend needs up front.

    Compilation happens at the first forward pass (the loop turns a build failure there
    into an error naming `train.compile`). The wrapper shares its parameters with `model`;
    save `model`, whose state_dict keys have no `_orig_mod.` prefix. Its compiled versions
    count against `recompile_limit` on their own (`isolate_recompiles`): another compiled
    model in the process neither uses up nor shares it. Past the limit dynamo runs the
    function eagerly; the loop warns once (`recompile_limit_hits`).

    Args:
        model: the module to compile.
        device: its device.
        backend: the `torch.compile` backend; `inductor` generates code (C++ on CPU,
            Triton on CUDA), `eager` and `aot_eager` only capture graphs (tests).
        recompile_limit: compiled versions kept of one function (`COMPILE_RECOMPILE_LIMIT`).

    Raises:
        RuntimeError: inductor on CPU when no C++ compiler is found (`$CXX`, `g++`,
            `clang++` or `c++` on the PATH): it compiles generated C++ code.
    """
    if backend == "inductor" and device.type == "cpu" and not (
        os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "clang++", "c++"))
    ):
        raise RuntimeError(
            "train.compile=on needs a C++ compiler on CPU (none of $CXX, g++, clang++, c++ "
            "found): install one, or set train.compile: off"
        )
    return torch.compile(model, backend=backend, recompile_limit=recompile_limit,
                         isolate_recompiles=True)


def recompile_limit_hits() -> int:
    """How many times, in this process so far, dynamo hit a recompile limit and left a
    function to run eagerly (once per function: it does not try again).

    Private torch API, kept to this one function: torch 2.13 has no public hook for the
    fallback; it counts it in `torch._dynamo.utils.counters["unimplemented"]` under a
    message starting `Dynamo recompile limit exceeded` (torch/_dynamo/convert_frame.py),
    next to the warning it logs. A torch that renames it makes this 0 (no warning, no tag),
    which tests/integration/test_compile_recompiles.py catches.
    """
    from torch._dynamo.utils import counters

    return sum(n for key, n in counters.get("unimplemented", {}).items()
               if key.startswith("Dynamo recompile limit exceeded"))


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """AdamW keyword selecting its implementation: the fused kernel on CUDA and CPU.

    On CPU (torch >= 2.4) the fused step was measured 4-8x faster than `foreach` for a
    5.3M-parameter model on 2 cores (2.7 ms vs 10-22 ms per step), so it is used there too.
    """
    return {"fused": device.type in ("cuda", "cpu")}


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB (2**20 bytes).

    CUDA: `torch.cuda.max_memory_allocated` (tensors only). CPU: the peak resident set size
    of the process (`getrusage` `ru_maxrss`: KiB on Linux, bytes on macOS), which includes
    the Python interpreter and libraries.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # POSIX only; imported here so the module still loads elsewhere

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name, or None when it is not in the table."""
    for key in sorted(GPU_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return GPU_PEAK_BF16_FLOPS[key]
    return None


#: Environment variable declaring the MFU peak in TFLOP/s (10**12 FLOP/s); wins over the
#: GPU table and the CPU measurement.
PEAK_TFLOPS_ENV = "MLM_PIPELINE_PEAK_TFLOPS"


@functools.lru_cache(maxsize=8)
def measure_cpu_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024,
                             seconds: float = 0.3, repeats: int = 6) -> float:
    """Measured CPU matmul throughput in FLOP/s (n x n @ n x n, 2 n^3 FLOPs each), with the
    current torch thread count: the best of `repeats` timings of about `seconds / repeats`
    each (at least one matmul each), cached per process. The maximum, not the mean: other
    processes only ever slow a timing down. The matrices come from a private generator:
    the measurement never moves the global torch RNG, so dropout masks do not depend on
    whether (or when) it ran in this process.
    """
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up
    best = 0.0
    for _ in range(max(repeats, 1)):
        reps, start = 0, time.perf_counter()
        while reps == 0 or time.perf_counter() - start < seconds / max(repeats, 1):
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def declared_peak_flops() -> float | None:
    """The peak FLOP/s declared in `MLM_PIPELINE_PEAK_TFLOPS` (TFLOP/s), or None when unset.

    Raises:
        ValueError: the variable is not a positive finite number (its value is named).
    """
    value = os.environ.get(PEAK_TFLOPS_ENV, "").strip()
    if not value:
        return None
    try:
        tflops = float(value)
    except ValueError:
        tflops = float("nan")
    if not (tflops > 0 and tflops != float("inf")):
        raise ValueError(f"{PEAK_TFLOPS_ENV}={value!r}: expected a positive number of "
                         "TFLOP/s (e.g. 1.5)")
    return tflops * 1e12


def peak_source(device: torch.device) -> str:
    """Where `peak_flops(device, ...)` takes its value: `declared` (`MLM_PIPELINE_PEAK_TFLOPS`
    is set), `spec` (the GPU table) on CUDA, `measured` elsewhere."""
    if os.environ.get(PEAK_TFLOPS_ENV, "").strip():
        return "declared"
    return "spec" if device.type == "cuda" else "measured"


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s used as the MFU denominator for `device` at `precision` (its source:
    `peak_source`).

    Returns:
        The declared peak when `MLM_PIPELINE_PEAK_TFLOPS` is set; else the table value for
        a known GPU, the measured matmul rate on a CPU (`measure_cpu_matmul_flops`), None for
        an unknown GPU (MFU is then not reported rather than reported wrongly).

    Raises:
        ValueError: `MLM_PIPELINE_PEAK_TFLOPS` is set but not a positive number.
    """
    declared = declared_peak_flops()
    if declared is not None:
        logger.info("MFU peak: %.4g TFLOP/s declared in %s", declared / 1e12, PEAK_TFLOPS_ENV)
        return declared
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is None:
            logger.warning("no peak FLOP/s known for GPU %r: MFU will not be reported (declare "
                           "it with %s=<TFLOP/s>)", name, PEAK_TFLOPS_ENV)
        return peak
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak = measure_cpu_matmul_flops(dtype)
    logger.info("MFU peak: %.4g TFLOP/s measured (best of several %s matmuls); declare it with "
                "%s=<TFLOP/s>", peak / 1e12, precision, PEAK_TFLOPS_ENV)
    return peak
