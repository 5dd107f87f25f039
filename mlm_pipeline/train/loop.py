"""The pretraining loop, built from Stateful parts (STYLE rule 7).

`Parts` holds what a run is made of: model, optimizer, LR schedule, data cursor, masker,
metrics meter, train state (`step`, `tokens_seen`) and the RNG; `Parts.stateful()` hands
them to the `Checkpointer` under its fixed keys. `train_step` takes one optimizer step;
`run_steps` repeats it until `train.max_steps` or the `train.max_time_s` budget, hands the
meter's report to the sink every `train.log_every` steps and checkpoints every
`train.checkpoint_every` steps. `mlm_pipeline.train.stage.train` builds the parts.

The loop applies what the plain model leaves out (STYLE rule 4): bf16 autocast, the
`torch.compile` wrapper (`Parts.forward_model`; checkpoints hold the uncompiled module's
weights) and document attention (document ids from the [SEP] tokens of the unmasked rows).

Gradient accumulation weights each micro-batch by its share of the step's masked tokens,
so a step over k micro-batches computes the same gradient as one batch k times larger.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from mlm_pipeline.config import IGNORE_INDEX, TrainConfig
from mlm_pipeline.masking.maskers import Masker
from mlm_pipeline.sinks import MetricsSink
from mlm_pipeline.train.checkpoint import Checkpointer, RngState, Stateful
from mlm_pipeline.train.data import RowCursor, ShardDataset
from mlm_pipeline.train.meter import Meter
from mlm_pipeline.train.model import document_ids_from_sep

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters of the run: `step` (optimizer steps taken) and `tokens_seen` (rows *
    seq_len consumed)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        """`{"step": int, "tokens_seen": int}`."""
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters.

        Raises:
            KeyError: `step` or `tokens_seen` is missing.
        """
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass
class Parts:
    """The parts of one training run and the settings a step needs besides the config.

    Attributes:
        model: the `BertMLM` whose weights are trained and saved.
        forward_model: `model` or its `torch.compile` wrapper (shares the parameters).
        optimizer: AdamW over `model`'s parameter groups.
        lr_scheduler: the `LambdaLR` of `schedule.build_lr_scheduler`.
        dataset: the unmasked training rows.
        cursor: position in the shuffled row order.
        masker: turns rows into `(input_ids, labels)` (dynamic or precomputed).
        meter: interval loss sums, throughput, MFU and memory.
        train_state: `step` and `tokens_seen`.
        rng: the torch generators (dropout).
        device: the training device.
        precision: `fp32` or `bf16` (resolved from `train.precision`).
        autocast: context entered around each forward pass (bf16 autocast or a no-op).
        document_attention: pass document ids from [SEP] tokens to the model.
        compile_errors: exceptions of a failing `torch.compile` build (empty when eager).
    """

    model: torch.nn.Module
    forward_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: ShardDataset
    cursor: RowCursor
    masker: Masker
    meter: Meter
    train_state: TrainState
    rng: RngState
    device: torch.device
    precision: str
    autocast: contextlib.AbstractContextManager
    document_attention: bool = False
    compile_errors: tuple[type[BaseException], ...] = ()

    def stateful(self) -> dict[str, Stateful]:
        """The parts a checkpoint holds, under the `Checkpointer`'s fixed keys."""
        return {"model": self.model, "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler, "rng": self.rng,
                "train_state": self.train_state, "cursor": self.cursor,
                "masker": self.masker, "meter": self.meter}


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, ...]],
    autocast: contextlib.AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward every micro-batch, each weighted by its share of the step's
    masked tokens, so the accumulated gradient is that of one batch holding them all.

    Args:
        model: a `BertMLM` (or its compiled wrapper); its loss is the mean cross-entropy
            over a micro-batch's masked tokens.
        micro_batches: `(input_ids, labels)` pairs, int64 (b, L) each, or
            `(input_ids, labels, document_ids)` triples (document ids int32 (b, L), passed
            as the model's `document_ids`).
        autocast: context entered around each forward pass (None: none).

    Returns:
        (sum of per-token losses, number of masked tokens) over all micro-batches, as
        0-dim tensors on the model's device (no host sync).
    """
    autocast = contextlib.nullcontext() if autocast is None else autocast
    total = sum((batch[1] != IGNORE_INDEX).sum() for batch in micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    for input_ids, labels, *rest in micro_batches:
        with autocast:
            output = model(input_ids, labels=labels, document_ids=rest[0] if rest else None)
        # mean_i * n_i / n_total summed over micro-batches = the mean over all n_total tokens.
        (output.loss * (output.num_masked / total.clamp(min=1))).backward()
        loss_sum += output.loss.detach().float() * output.num_masked
    return loss_sum, total


def next_micro_batches(parts: Parts, count: int) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Read and mask the next `count` micro-batches of the cursor's order.

    Returns:
        (`(input_ids, labels)` int64 (b, L) pairs on the device, plus document ids int32
        (b, L) with document attention; the epoch of the last micro-batch).
    """
    micro, epoch = [], parts.cursor.epoch
    for _ in range(count):
        rows, epoch = parts.cursor.next_batch()
        input_ids = parts.dataset.get(rows).to(parts.device, non_blocking=True)
        row_index = torch.from_numpy(rows).to(parts.device)
        masked = parts.masker(input_ids, row_index, epoch)
        if parts.document_attention:
            masked = (*masked, document_ids_from_sep(input_ids))
        micro.append(masked)
    return micro, epoch


def train_step(parts: Parts, cfg: TrainConfig) -> tuple[torch.Tensor, int]:
    """One optimizer step: `grad_accum_steps` micro-batches, clipping, AdamW, schedule.

    Returns:
        (the global gradient L2 norm before clipping, float32 0-dim; the epoch of the step's
        last micro-batch).

    Raises:
        RuntimeError: `torch.compile` failed to build the model (names `train.compile`).
    """
    micro, epoch = next_micro_batches(parts, cfg.grad_accum_steps)
    try:
        loss_sum, masked = accumulate_gradients(parts.forward_model, micro, parts.autocast)
    except parts.compile_errors as exc:
        raise RuntimeError(
            f"train.compile={cfg.compile}: torch.compile failed to build the model on "
            f"{parts.device.type} ({type(exc).__name__}); set train.compile: off"
        ) from exc
    parts.meter.update(loss_sum, masked)
    clip = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip)
    parts.optimizer.step()
    parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.train_state.step += 1
    parts.train_state.tokens_seen += parts.meter.tokens_per_step
    return grad_norm, epoch


def run_steps(parts: Parts, cfg: TrainConfig, checkpointer: Checkpointer,
              sink: MetricsSink) -> tuple[dict[str, float], bool]:
    """Train from `parts.train_state.step` to `cfg.max_steps` (or until `cfg.max_time_s`).

    Every `cfg.log_every` steps, at the last step and when out of time, the meter's report
    goes to `sink`; every `cfg.checkpoint_every` steps before the last, `checkpointer`
    saves (the final checkpoint is the caller's).

    Returns:
        (the last metrics reported, empty when no step ran; whether `cfg.max_time_s` ended
        training before `cfg.max_steps`).

    Raises:
        RuntimeError: the interval loss is not finite, or `torch.compile` fails.
    """
    state, last_metrics, stopped_early = parts.train_state, {}, False
    run_start = time.perf_counter()
    parts.meter.start()
    parts.model.train()
    while state.step < cfg.max_steps:
        grad_norm, epoch = train_step(parts, cfg)
        out_of_time = (cfg.max_time_s is not None
                       and time.perf_counter() - run_start > cfg.max_time_s)
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps or out_of_time:
            last_metrics = parts.meter.report(
                step=state.step, lr=parts.lr_scheduler.get_last_lr()[0], grad_norm=grad_norm,
                epoch=epoch, tokens_seen=state.tokens_seen,
            )
            sink.log(last_metrics, state.step)
        if (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0
                and state.step < cfg.max_steps):
            checkpointer.save(state.step)
        if out_of_time:
            stopped_early = state.step < cfg.max_steps
            if stopped_early:
                logger.warning("train.max_time_s=%s reached: stopping at step %d of %d",
                               cfg.max_time_s, state.step, cfg.max_steps)
            break
    return last_metrics, stopped_early
