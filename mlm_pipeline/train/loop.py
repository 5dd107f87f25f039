"""The pretraining loop, built from Stateful parts (STYLE rule 7).

`Parts` holds what a run is made of; `Parts.stateful()` hands it to the `Checkpointer`.
`train_step` takes one optimizer step; `run_steps` repeats it until `train.max_steps` or
`train.max_time_s`, logging every `train.log_every` and checkpointing every
`train.checkpoint_every` steps. `mlm_pipeline.train.stage.train` builds the parts.

The loop applies what the plain model leaves out (STYLE rule 4): bf16 autocast, the
`torch.compile` wrapper (checkpoints hold the uncompiled module's weights; hitting the
recompile limit is warned once and recorded in `Parts.compile_fallback`) and document
attention (document ids from the [SEP] tokens of the unmasked rows). Gradient
accumulation weights each micro-batch by its share of the step's masked tokens, so k
micro-batches give the gradient of one batch k times larger.

With several ranks (`Parts.world`) gradients are synchronized on the last micro-batch
only and clock or signal decisions are agreed by all ranks each step; every rank calls the
checkpointer (FSDP2 gathers the full state), rank 0 alone writes, evaluates and logs.

A step without a selected token is not applied and is counted (`train/empty_steps`); a
non-finite step fails the run (`train.nonfinite: stop`; on CUDA the check is a device-side
flag read at log and checkpoint steps, so nothing past it is ever saved) or is dropped
and counted (`skip`, `train/skipped_steps`). `step` counts applied steps only. The
periodic evaluator reads no global RNG, so a run with and without it trains
bit-identically; its time is left out of `train/tokens_per_s`. Sinks are flushed before
every checkpoint, so a checkpoint never declares steps whose metrics were not delivered.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mlm_pipeline.config import IGNORE_INDEX, SEP_ID, TrainConfig
from mlm_pipeline.errors import (  # noqa: F401 - raised here, importable from here too
    CompileError, NonFiniteLossError, TrainingInterrupted)
from mlm_pipeline.masking.maskers import Masker
from mlm_pipeline.sinks import MetricsSink
from mlm_pipeline.train.checkpoint import Checkpointer, RngState, Stateful
from mlm_pipeline.train.data import RowCursor, ShardDataset
from mlm_pipeline.train.distributed import World, local_grad_norm
from mlm_pipeline.train.meter import Meter
from mlm_pipeline.train.model import document_ids_from_sep
from mlm_pipeline.train.perf import recompile_limit_hits

logger = logging.getLogger(__name__)

#: `warn_not_learning`: a held-out loss above this share of ln(vocab_size) after the
#: warm-up has not fallen from where an untrained model starts.
NOT_LEARNING_SHARE = 0.99


class StopSignal:
    """A request to stop one training run early (the flows' SIGINT/SIGTERM handler sets it):
    the loop checkpoints the step it reached and raises `TrainingInterrupted`. Thread-safe:
    set from any thread or a signal handler. Two runs in one process have two signals."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def request(self) -> None:
        """Ask the run to stop at the end of its current step."""
        self._event.set()

    def clear(self) -> None:
        """Forget a request (the loop does once it honoured it)."""
        self._event.clear()

    @property
    def requested(self) -> bool:
        """True after `request()` until the loop honours it (or `clear()`)."""
        return self._event.is_set()


class Evaluator(Protocol):
    """Periodic held-out evaluation during training (`mlm_pipeline.evaluate.periodic`).

    Attributes:
        every_steps: evaluate after every this many applied optimizer steps.
    """

    every_steps: int

    def __call__(self, model: torch.nn.Module, step: int, precision: str) -> dict[str, float]:
        """Evaluate `model` (in eval mode, under no_grad) at optimizer step `step`.

        Args:
            model: the uncompiled `BertMLM` being trained (on its training device).
            step: optimizer steps applied so far.
            precision: `fp32` or `bf16` (the run's resolved precision).

        Returns:
            Metrics (`eval/...` keys, floats) logged at `step`.
        """


@dataclass
class TrainState:
    """Counters of the run: `step` (optimizer steps applied), `tokens_seen` (rows * seq_len),
    `skipped_steps` (non-finite, dropped), `empty_steps` (no selected token) and
    `skipped_in_a_row`."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    empty_steps: int = 0
    skipped_in_a_row: int = 0

    def state_dict(self) -> dict[str, int]:
        """The five counters as `{name: int}`."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters (those a checkpoint predates start at 0).

        Raises:
            KeyError: `step` or `tokens_seen` is missing.
        """
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        for name in ("skipped_steps", "empty_steps", "skipped_in_a_row"):
            setattr(self, name, int(state.get(name, 0)))


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
        sep_id: the id of [SEP] in the run's tokenizer (the document boundaries).
        compile_errors: exceptions of a failing `torch.compile` build (empty when eager).
        evaluator: periodic held-out evaluation (`Evaluator`), or None.
        masked_per_row: passed to the model's forward (a static head size) when it is
            compiled and the masking bounds the labels per row (`exact_k`); None otherwise,
            and always when eager, whose results it would change in the last bits.
        world: this process's rank among the data-parallel ranks (`World.single()`: one).
        recompile_limit: compiled versions `forward_model` keeps of one function; None when
            eager.
        compile_fallback: `recompile_limit` once dynamo hit that limit and left part of the
            forward pass to run eagerly (recorded as `mlm.compile_fallback`); None until then.
        warned_not_learning: `warn_not_learning` has warned in this run.
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
    sep_id: int = SEP_ID
    compile_errors: tuple[type[BaseException], ...] = ()
    masked_per_row: int | None = None
    evaluator: Evaluator | None = None
    world: World = field(default_factory=World.single)
    recompile_limit: int | None = None
    compile_fallback: str | None = None
    warned_not_learning: bool = False
    #: Stateful overrides of `stateful()` entries (FSDP2: full-state gatherers).
    state_parts: dict[str, Stateful] = field(default_factory=dict)

    def stateful(self) -> dict[str, Stateful]:
        """The parts a checkpoint holds, under the `Checkpointer`'s fixed keys."""
        return {"model": self.model, "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler, "rng": self.rng,
                "train_state": self.train_state, "cursor": self.cursor,
                "masker": self.masker, "meter": self.meter, **self.state_parts}


def accumulate_gradients(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, ...]],
                         autocast: contextlib.AbstractContextManager | None = None,
                         masked_per_row: int | None = None, world: World | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward every micro-batch, each weighted by its share of the step's
    masked tokens, so the accumulated gradient is that of one batch holding them all.

    Args:
        model: a `BertMLM` (or its compiled wrapper); its loss is the mean cross-entropy
            over a micro-batch's masked tokens.
        micro_batches: `(input_ids, labels)` pairs, int64 (b, L) each, or triples with
            the model's `document_ids` (int32 (b, L)) third.
        autocast: context entered around each forward pass (None: none).
        masked_per_row: the model's static head size (`BertMLM.forward`), or None.
        world: the data-parallel ranks (None: one process); `model` is then `World.wrap`'s
            wrapper, and the weights use the step's masked tokens over all ranks.

    Returns:
        (sum of per-token losses, number of masked tokens) over all micro-batches of all
        ranks, as 0-dim tensors on the model's device (no host sync with one process).
    """
    autocast = contextlib.nullcontext() if autocast is None else autocast
    world = world or World.single()
    total = world.all_reduce_sum(sum((batch[1] != IGNORE_INDEX).sum() for batch in micro_batches))
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    last = len(micro_batches) - 1
    for i, (input_ids, labels, *rest) in enumerate(micro_batches):
        with world.gradient_sync(i == last):
            with autocast:
                output = model(input_ids, labels=labels,
                               document_ids=rest[0] if rest else None,
                               masked_per_row=masked_per_row)
            # mean_i * n_i / n_total summed over micro-batches (and ranks) = the mean over
            # all n_total tokens; x world_size undoes the ranks' gradient averaging.
            (output.loss * (output.num_masked * world.world_size / total.clamp(min=1))).backward()
        loss_sum += output.loss.detach().float() * output.num_masked
    return world.all_reduce_sum(loss_sum), total


def next_micro_batches(parts: Parts, count: int) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Read and mask the next `count` micro-batches of the cursor's order.

    Returns:
        (`(input_ids, labels)` int64 (b, L) pairs on the device, plus document ids int32
        (b, L) with document attention; the epoch of the last micro-batch).
    """
    micro, epoch, step = [], parts.cursor.epoch, parts.train_state.step
    for _ in range(count):
        rows, epoch = parts.cursor.next_batch()
        input_ids = parts.dataset.get(rows).to(parts.device, non_blocking=True)
        row_index = torch.from_numpy(rows).to(parts.device)
        masked = parts.masker(input_ids, row_index, epoch, step)
        if parts.document_attention:
            masked = (*masked, document_ids_from_sep(input_ids, parts.sep_id))
        micro.append(masked)
    return micro, epoch


def train_step(parts: Parts, cfg: TrainConfig) -> tuple[torch.Tensor, int, bool]:
    """One optimizer step: `grad_accum_steps` micro-batches, clipping, AdamW, schedule;
    not applied when no token was selected or (`nonfinite: skip`) the step is not finite.

    Returns:
        (the global gradient L2 norm before clipping, float32 0-dim; the epoch of the step's
        last micro-batch; whether the step was applied).

    Raises:
        RuntimeError: `torch.compile` failed to build the model (names `train.compile`).
        NonFiniteLossError: with `nonfinite: skip`, more than `max_skipped_steps` in a row.
        ValueError: more than `max_skipped_steps` steps in a row selected no token.
    """
    state, step = parts.train_state, parts.train_state.step + 1
    micro, epoch = next_micro_batches(parts, cfg.grad_accum_steps)
    watch = parts.recompile_limit is not None and parts.compile_fallback is None
    hits = recompile_limit_hits() if watch else 0
    try:
        loss_sum, masked = accumulate_gradients(parts.forward_model, micro, parts.autocast,
                                                parts.masked_per_row, parts.world)
    except parts.compile_errors as exc:
        raise CompileError(
            f"train.compile={cfg.compile}: torch.compile failed to build the model on "
            f"{parts.device.type} ({type(exc).__name__}); set train.compile: off"
        ) from exc
    if watch and recompile_limit_hits() > hits:
        parts.compile_fallback = "recompile_limit"
        logger.warning(
            "step %d: torch.compile hit its recompile limit (%d compiled versions of one "
            "function): its input shapes or other guards kept changing, so that part of the "
            "forward pass now runs eagerly (slower) for the rest of the run; recorded as "
            "mlm.compile_fallback=recompile_limit (TORCH_LOGS=recompiles names the changing "
            "guard; train.compile: off avoids compiling)", step, parts.recompile_limit)
    clip = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
    grad_norm = local_grad_norm(torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip))
    if int(masked) == 0:  # host read: a step without targets must not move the weights
        state.empty_steps += 1
        state.skipped_in_a_row += 1
        parts.optimizer.zero_grad(set_to_none=True)
        if state.skipped_in_a_row > cfg.max_skipped_steps:
            raise ValueError(f"{state.skipped_in_a_row} steps in a row selected no token to "
                             "predict: raise masking.mlm_probability")
        return grad_norm, epoch, False
    if cfg.nonfinite == "skip" and not math.isfinite(float(loss_sum + grad_norm)):
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        parts.optimizer.zero_grad(set_to_none=True)
        logger.warning("step %d: non-finite loss or gradient norm, batch skipped (%d in a row)",
                       step, state.skipped_in_a_row)
        if state.skipped_in_a_row > cfg.max_skipped_steps:
            raise NonFiniteLossError(
                f"{state.skipped_in_a_row} non-finite batches in a row at step {step} "
                f"(train.max_skipped_steps={cfg.max_skipped_steps}); lower train.lr or set "
                "train.grad_clip", step, None)
        return grad_norm, epoch, False
    state.skipped_in_a_row = 0
    parts.meter.update(loss_sum, masked, grad_norm, step)
    parts.optimizer.step()
    parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    state.step = step
    state.tokens_seen += parts.meter.tokens_per_step
    return grad_norm, epoch, True


def _check_finite(parts: Parts, checkpointer: Checkpointer) -> None:
    """Raise `NonFiniteLossError` if a step since the last check was not finite (one sync)."""
    bad = parts.meter.first_nonfinite_step()
    if bad is not None:
        last = checkpointer.latest()
        raise NonFiniteLossError(
            f"training loss or gradient norm became non-finite at step {bad}; last good "
            f"checkpoint: {last or 'none'} (lower train.lr, set train.grad_clip, or "
            "train.nonfinite: skip)", bad, last)


def _evaluate(parts: Parts, sink: MetricsSink, warmup_steps: int = 0) -> None:
    """Run and log the periodic evaluator (its time left out of the meter's interval)."""
    started = time.perf_counter()
    parts.model.eval()
    try:
        metrics = parts.evaluator(parts.model, parts.train_state.step, parts.precision)
    finally:
        parts.model.train()
    sink.log(metrics, parts.train_state.step)
    warn_not_learning(parts, metrics.get("eval/loss"), warmup_steps)
    parts.meter.exclude(time.perf_counter() - started)


def warn_not_learning(parts: Parts, eval_loss: float | None, warmup_steps: int) -> bool:
    """Warn once per run (`Parts.warned_not_learning`) when, after the warm-up, the
    held-out loss is still above `NOT_LEARNING_SHARE` of ln V (V = vocabulary size), the
    loss of a uniform guess, where a freshly initialized model starts: a model that learns
    even the token frequencies falls well below it, so its learning rate is off.

    Args:
        parts: the run (its `model.vocab_size`, `train_state.step`, warning flag).
        eval_loss: the held-out masked-token loss in nats at this step (None: none).
        warmup_steps: the run's warm-up (`TrainConfig.warmup`); nothing is said before.

    Returns:
        True when this call warned.
    """
    if (parts.warned_not_learning or eval_loss is None
            or parts.train_state.step < warmup_steps):
        return False
    uniform = math.log(parts.model.vocab_size)
    if eval_loss <= NOT_LEARNING_SHARE * uniform:
        return False
    parts.warned_not_learning = True
    logger.warning(
        "step %d: the held-out loss %.4f has not fallen after the warm-up (%d steps): it is "
        "still that of a uniform guess, ln(vocab_size) = %.4f, so the model is not "
        "learning; check train.lr (%s) against the model's recipe (train.lr: auto picks "
        "one per model.preset)", parts.train_state.step, eval_loss, warmup_steps, uniform,
        parts.optimizer.param_groups[0].get("initial_lr", "?"))
    return True


def _save(parts: Parts, checkpointer: Checkpointer, sink: MetricsSink) -> Path:
    """Checkpoint the current step after the finiteness check and a sink flush."""
    _check_finite(parts, checkpointer)
    sink.flush()
    return checkpointer.save(parts.train_state.step)


def run_steps(parts: Parts, cfg: TrainConfig, checkpointer: Checkpointer,
              sink: MetricsSink, stop: StopSignal | None = None
              ) -> tuple[dict[str, float], str]:
    """Train from `parts.train_state.step` to `cfg.max_steps` (or until `cfg.max_time_s`),
    logging every `cfg.log_every` steps (and at the last one) and checkpointing every
    `cfg.checkpoint_every` steps or `cfg.checkpoint_interval_s` seconds before the last
    (the final checkpoint is the caller's).

    Returns:
        (the last metrics reported, empty when no step ran; the stop reason: `max_steps`
        or `time_cap`).

    Raises:
        NonFiniteLossError: a step was not finite (module docstring).
        TrainingInterrupted: `stop` was requested; the step reached is checkpointed.
        RuntimeError: `torch.compile` fails.
    """
    stop = stop or StopSignal()
    state, last_metrics = parts.train_state, {}
    run_start = last_save = time.perf_counter()
    parts.meter.start()
    parts.model.train()
    every_step = parts.device.type == "cpu"  # a host read per step costs nothing there
    while state.step < cfg.max_steps:
        grad_norm, epoch, applied = train_step(parts, cfg)
        now = time.perf_counter()
        out_of_time = cfg.max_time_s is not None and now - run_start > cfg.max_time_s
        interval = cfg.checkpoint_interval_s
        late = interval is not None and now - last_save >= interval
        # Every rank must take the same branch (one tiny all_reduce; no-op with one rank).
        out_of_time, late, stopping = parts.world.any([out_of_time, late, stop.requested],
                                                      parts.device)
        if every_step:
            _check_finite(parts, checkpointer)
        if applied and (state.step % cfg.log_every == 0 or state.step == cfg.max_steps
                        or out_of_time):
            _check_finite(parts, checkpointer)
            last_metrics = parts.meter.report(
                step=state.step, lr=parts.lr_scheduler.get_last_lr()[0], grad_norm=grad_norm,
                epoch=epoch, tokens_seen=state.tokens_seen,
                skipped_steps=state.skipped_steps, empty_steps=state.empty_steps)
            # The rate the step just applied masked at (`masking.mlm_probability`, a
            # constant or a schedule of the completed steps before it).
            last_metrics["train/mlm_probability"] = parts.masker.mlm_probability_at(
                state.step - 1)
            sink.log(last_metrics, state.step)
        if (applied and parts.evaluator is not None and state.step < cfg.max_steps
                and state.step % parts.evaluator.every_steps == 0 and parts.world.is_main):
            _evaluate(parts, sink, cfg.warmup)
        if stopping:
            stop.clear()
            raise TrainingInterrupted(state.step, _save(parts, checkpointer, sink))
        due = applied and cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0
        if (due or late) and state.step < cfg.max_steps and not out_of_time:
            _save(parts, checkpointer, sink)
            last_save = time.perf_counter()
        if out_of_time:
            if state.step < cfg.max_steps:
                logger.warning("train.max_time_s=%s reached: stopping at step %d of %d "
                               "(stop reason: time_cap)", cfg.max_time_s, state.step,
                               cfg.max_steps)
                return last_metrics, "time_cap"
            break
    _check_finite(parts, checkpointer)
    return last_metrics, "max_steps"
