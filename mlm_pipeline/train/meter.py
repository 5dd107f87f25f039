"""`Meter`: the metrics and throughput part of the training loop (Stateful).

Per optimizer step it adds the step's summed per-token loss and masked-token count to the
running interval sums (on the training device, no host sync); at the end of a log interval
`report` turns them into one metrics dict and starts a new interval:

- `train/loss`: masked-token-weighted mean cross-entropy over the interval (nats),
- `train/lr`, `train/grad_norm` (of the interval's last step, before clipping),
- `train/tokens_per_s`: tokens (rows * seq_len, padding included) per second of loop time,
- `train/mfu_pct`: model FLOP utilization (Chowdhery et al. 2022, appendix B) in percent,
  against `perf.peak_flops` (left out when the peak is unknown), never above 100: an
  interval that achieves more FLOP/s than the peak raises the peak to its rate (a warning the
  first time only; `peak_source` becomes `achieved`),
- `train/peak_tflops`: that peak in TFLOP/s (10**12 FLOP/s), logged with the MFU,
- `train/masked_tokens`: tokens predicted (selected by masking) in the interval,
- `train/skipped_steps`, `train/empty_steps`: steps not applied so far (non-finite, or
  without a selected token; see `loop`),
- `train/epoch`, `train/tokens_seen`, `train/memory_mb` (`perf.peak_memory_mb`, MiB) and, on
  CUDA, `memory/max_reserved_gib` (GiB).

The interval sums and elapsed time are the meter's state, so a run resumed between two
reports logs the same `train/loss` as the uninterrupted run. Training time (`train_time_s`,
in the state too, so it spans every segment of a resumed run) is the loop's time: steps and
the checkpoints between them, not start-up nor periodic evaluation (`exclude`); tokens seen
divided by it is the run's mean throughput.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from mlm_pipeline.train.perf import peak_memory_mb
from mlm_pipeline.train.perf import peak_source as _peak_source

logger = logging.getLogger(__name__)


class Meter:
    """Interval loss sums, throughput, MFU and memory of the training loop.

    Args:
        device: the training device (sums live there; CUDA is synchronized before timing).
        tokens_per_step: tokens per optimizer step (global batch rows * seq_len).
        flops_per_token: model training FLOPs per token (`BertMLM.flops_per_token`).
        peak_flops: peak FLOP/s of the device at the training precision
            (`perf.peak_flops`); None leaves `train/mfu_pct` out.
        peak_source: where `peak_flops` comes from (`measured`, `declared`, `spec`);
            None: `perf.peak_source(device)`, or `unknown` without a peak.
    """

    def __init__(self, device: torch.device, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float | None, peak_source: str | None = None) -> None:
        self.device, self.tokens_per_step = device, tokens_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        #: `measured`, `declared`, `spec`, `achieved` (raised by `report`) or `unknown`.
        self.peak_source = peak_source or (_peak_source(device) if peak_flops else "unknown")
        #: float32 0-dim: sum over the interval of per-token losses (nats).
        self.loss_sum = torch.zeros((), device=device)
        #: int64 0-dim: masked (predicted) tokens in the interval.
        self.masked_sum = torch.zeros((), device=device, dtype=torch.long)
        #: optimizer steps in the interval.
        self.steps = 0
        #: int64 0-dim: first step with a non-finite loss or gradient norm, -1 if none.
        self._first_bad = torch.full((), -1, device=device, dtype=torch.long)
        self._carried_s = 0.0  # interval seconds before a resume
        self._start = time.perf_counter()
        #: seconds of the reported intervals, all segments (None: a checkpoint predates it).
        self._reported_s: float | None = 0.0

    def start(self) -> None:
        """Start (or, after `load_state_dict`, continue) the interval clock: call it just
        before the first step, so setup and checkpoint loading are not counted."""
        self._start = time.perf_counter() - self._carried_s
        self._carried_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of wall time (e.g. a periodic evaluation) out of the current
        interval's throughput and MFU."""
        self._start += seconds

    def update(self, loss_sum: torch.Tensor, masked: torch.Tensor,
               grad_norm: torch.Tensor | None = None, step: int | None = None) -> None:
        """Add one optimizer step (device ops only, no host sync).

        Args:
            loss_sum: float32 0-dim, the step's summed per-token loss (nats).
            masked: int64 0-dim, the step's masked tokens.
            grad_norm: float32 0-dim, the step's gradient norm; with `step`, a non-finite
                loss or norm records `step` as the first non-finite step (if none was).
            step: the step's number (1-based).
        """
        self.loss_sum += loss_sum
        self.masked_sum += masked
        self.steps += 1
        if step is not None:
            total = loss_sum.float() + (0.0 if grad_norm is None else grad_norm.float())
            bad = ~torch.isfinite(total) & (self._first_bad < 0)
            self._first_bad = torch.where(bad, step, self._first_bad)

    def first_nonfinite_step(self) -> int | None:
        """The first step whose loss or gradient norm was not finite, or None (a host read)."""
        bad = int(self._first_bad)
        return bad if bad >= 0 else None

    def report(self, *, step: int, lr: float, grad_norm: torch.Tensor | float, epoch: int,
               tokens_seen: int, skipped_steps: int = 0, empty_steps: int = 0
               ) -> dict[str, float]:
        """The metrics of the interval that ends at `step`, then a new interval.

        Args:
            step: optimizer steps taken (only named in errors).
            lr: learning rate of the next step.
            grad_norm: global gradient L2 norm of the last step, before clipping.
            epoch: epoch of the last batch read.
            tokens_seen: tokens consumed so far.
            skipped_steps, empty_steps: steps not applied so far (`loop.TrainState`).

        Returns:
            The metrics dict (keys in the module docstring; values are Python floats).

        Raises:
            RuntimeError: the interval's mean loss is not finite (the step is named).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._start
        loss = (self.loss_sum / self.masked_sum.clamp(min=1)).item()
        if not math.isfinite(loss):
            raise RuntimeError(f"training loss became {loss} at step {step}")
        if self._reported_s is not None:
            self._reported_s += elapsed
        tokens_per_s = self.steps * self.tokens_per_step / elapsed
        metrics = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": float(grad_norm),
            "train/tokens_per_s": tokens_per_s,
            "train/masked_tokens": float(self.masked_sum.item()),
            "train/skipped_steps": float(skipped_steps),
            "train/empty_steps": float(empty_steps), "train/epoch": float(epoch),
            "train/tokens_seen": float(tokens_seen),
        }
        if self.peak_flops:
            achieved = self.flops_per_token * tokens_per_s
            if achieved > self.peak_flops:
                # Once a run: later intervals that beat the raised peak only move it.
                log = logger.warning if self.peak_source != "achieved" else logger.debug
                log("step %d: %.4g TFLOP/s achieved, above the %s peak of %.4g TFLOP/s: the "
                    "peak is raised to the achieved rate (MFU 100 %%); declare the device's "
                    "peak with MLM_PIPELINE_PEAK_TFLOPS", step, achieved / 1e12,
                    self.peak_source, self.peak_flops / 1e12)
                self.peak_flops, self.peak_source = achieved, "achieved"
            # The ratio first: achieved <= peak makes it <= 1 exactly, so the percentage is
            # never above 100 (100 * a / a can round to 100.00000000000001).
            metrics["train/mfu_pct"] = 100.0 * (achieved / self.peak_flops)
            metrics["train/peak_tflops"] = self.peak_flops / 1e12
        metrics["train/memory_mb"] = peak_memory_mb(self.device)
        if self.device.type == "cuda":
            metrics["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.loss_sum.zero_()
        self.masked_sum.zero_()
        self.steps, self._start = 0, time.perf_counter()
        return metrics

    def train_time_s(self) -> float | None:
        """Seconds of training loop so far, every segment of the run (module docstring):
        the reported intervals plus the open one when it holds a step; None when the run
        resumed from a checkpoint written before the meter kept this time."""
        if self._reported_s is None:
            return None
        if self.steps == 0:
            return self._reported_s
        return self._reported_s + time.perf_counter() - self._start

    def state_dict(self) -> dict[str, Any]:
        """The open interval and the training time: `{"loss_sum": float (nats),
        "masked_sum": int, "steps": int, "elapsed_s": float (seconds), "reported_s": float
        (seconds of the reported intervals) or None}`, plain JSON values (one host sync)."""
        return {"loss_sum": self.loss_sum.item(),  # float32 -> Python float is exact
                "masked_sum": int(self.masked_sum.item()), "steps": self.steps,
                "elapsed_s": time.perf_counter() - self._start, "reported_s": self._reported_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the interval saved by `state_dict` (the sums are restored bit for bit;
        the clock resumes at `elapsed_s` when `start` is called) and the training time (a
        checkpoint without `reported_s` leaves it unknown, with a warning).

        Raises:
            KeyError: a key of `state_dict` is missing.
        """
        self.loss_sum.fill_(float(state["loss_sum"]))
        self.masked_sum.fill_(int(state["masked_sum"]))
        self.steps = int(state["steps"])
        self._carried_s = float(state["elapsed_s"])
        reported = state.get("reported_s")
        if "reported_s" not in state:
            logger.warning("the checkpoint predates the meter's training time: this run's "
                           "mean tokens/s will not be reported")
        self._reported_s = None if reported is None else float(reported)
