"""The pretraining loop: AdamW, warm-up then decay, clipping, accumulation, checkpoints.

`train()` builds the model, optimizer, schedule, data cursor and masker from the config,
resumes from the newest checkpoint in its output directory if there is one, and runs until
`train.max_steps` optimizer steps or the `train.max_time_s` wall-clock budget. Every
`train.log_every` steps it hands one metrics dict to the sink it was given (the loop never
talks to MLflow itself): `train/loss` (masked-token-weighted mean over the interval),
`train/lr`, `train/grad_norm`, `train/tokens_per_s`, `train/mfu_pct`, `train/epoch`,
`train/tokens_seen`, `train/memory_mb` (peak, see `perf.peak_memory_mb`) and, on CUDA,
`memory/max_reserved_gib`.

The loop applies what the plain model leaves out (STYLE rule 4): bf16 autocast
(`train.precision`), `torch.compile` (`train.compile`; checkpoints hold the uncompiled
module's weights), whole-word masking (`masking.whole_word`, word starts from the
tokenizer) and document attention (`train.document_attention`, document ids from the
[SEP] tokens of the unmasked rows).

Gradient accumulation weights each micro-batch by its share of the step's masked tokens,
so a step over k micro-batches computes the same gradient as one batch k times larger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline.config import IGNORE_INDEX, PipelineConfig
from mlm_pipeline.manifest import (
    ShardManifest,
    Stopwatch,
    TokenizerManifest,
    TrainManifest,
    compute_digest,
    write_manifest,
)
from mlm_pipeline.masking.maskers import Masker, build_masker
from mlm_pipeline.shards.format import verify_shards
from mlm_pipeline.sinks import JsonlSink, MetricsSink
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mlm_pipeline.train.data import PrecomputedShardDataset, RowCursor, ShardDataset
from mlm_pipeline.train.model import BertMLM, document_ids_from_sep
from mlm_pipeline.train.perf import (
    adamw_impl,
    compile_model,
    peak_flops,
    peak_memory_mb,
    resolve_compile,
    resolve_device,
    resolve_precision,
)

logger = logging.getLogger(__name__)


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, decay: str, min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    """Learning-rate factor for the optimizer step that follows `step` completed steps.

    Linear warm-up from `1 / warmup_steps` to 1 over `warmup_steps` steps (Goyal et al.
    2017; BERT uses 10k warm-up steps, Devlin et al. 2019 appendix A.2), then a decay to
    `min_lr_ratio` at `max_steps`:

    - `linear` and `cosine` (Loshchilov & Hutter 2017) span all steps after warm-up;
    - `wsd`, warmup-stable-decay (Hu et al. 2024, MiniCPM, §4): the factor stays 1 until
      `max_steps - D`, D = round(`decay_fraction` * `max_steps`) (at least 1), then falls
      linearly to `min_lr_ratio` at `max_steps` (a decay overlapping the warm-up starts
      where the warm-up ends).

    Raises:
        ValueError: for an unknown `decay`, or `decay_fraction` outside (0, 1] with `wsd`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "wsd":
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction {decay_fraction!r} must be in (0, 1]")
        decay_start = max(warmup_steps, max_steps - max(1, round(decay_fraction * max_steps)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay {decay!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, ...]],
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward every micro-batch, each weighted by its share of the step's
    masked tokens, so the accumulated gradient is that of one batch holding them all.

    Args:
        model: a `BertMLM` (or its compiled wrapper); its loss is the mean cross-entropy
            over a micro-batch's masked tokens.
        micro_batches: `(input_ids, labels)` pairs, int64 (b, L) each, or
            `(input_ids, labels, document_ids)` triples (document ids int32 (b, L), passed
            as the model's `document_ids`).
        autocast: context entered around each forward pass.

    Returns:
        (sum of per-token losses, number of masked tokens) over all micro-batches, as
        0-dim tensors on the model's device (no host sync).
    """
    total = sum((batch[1] != IGNORE_INDEX).sum() for batch in micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    for input_ids, labels, *rest in micro_batches:
        with autocast:
            output = model(input_ids, labels=labels, document_ids=rest[0] if rest else None)
        # mean_i * n_i / n_total summed over micro-batches = the mean over all n_total tokens.
        (output.loss * (output.num_masked / total.clamp(min=1))).backward()
        loss_sum += output.loss.detach().float() * output.num_masked
    return loss_sum, total


def build_train_masker(cfg: PipelineConfig, shards: ShardManifest,
                       tokenizer: TokenizerManifest) -> Masker:
    """`build_masker` for this run: the masked copies' reader in precomputed mode, the
    tokenizer's word starts (bool (V,), True where a piece begins a word) when
    `masking.whole_word` is set."""
    mc = cfg.masking
    copies = PrecomputedShardDataset(shards) if mc.mode == "precomputed" else None
    word_starts = None
    if mc.whole_word and mc.mode == "dynamic":
        word_starts = torch.from_numpy(Tokenizer.load(tokenizer).word_starts())
    return build_masker(mc, shards.vocab_size, shards, word_starts=word_starts, copies=copies)


def _truncate_metrics_log(path: Path, step: int) -> None:
    """Drop records logged after `step` (the checkpoint resumed from): the resumed run logs
    those steps again, and the log must hold each step once."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def train_digest(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                 run_key: str) -> str:
    """Identity of one training run: model, train and masking configs, inputs, run key."""
    return compute_digest(
        "train",
        {"model": cfg.model, "train": cfg.train, "masking": cfg.masking},
        {"shards": shards.digest, "tokenizer": tokenizer.digest, "run": run_key},
    )


def train(
    cfg: PipelineConfig,
    shards: ShardManifest,
    tokenizer: TokenizerManifest,
    out_dir: str | Path,
    sink: MetricsSink | None = None,
) -> TrainManifest:
    """Pretrain a `BertMLM` on the training shards (dynamic or precomputed masking).

    Args:
        cfg: the pipeline config (`model`, `train`, `masking` are used).
        shards: packed training rows.
        tokenizer: the tokenizer the shards were encoded with (recorded in checkpoints).
        out_dir: this run's directory; holds `checkpoints/`, `metrics.jsonl` and
            `manifest.json`. If it already holds a checkpoint, training resumes from it.
        sink: receives one metrics dict per log interval (besides `metrics.jsonl`).

    Returns:
        The `TrainManifest` (also written as `out_dir/manifest.json`).

    Raises:
        ValueError: when the training split has fewer rows than one micro-batch, with
            precomputed masking, the shards hold no copies made with this masking and seed,
            or (`train.verify_shards`) a shard is missing or its sha256 differs from the
            manifest (the file is named).
        RuntimeError: when CUDA or bf16 is requested but unavailable, when
            `train.compile=on` cannot compile (no C++ compiler on CPU, or the first
            compiled step fails to build), or the loss becomes non-finite (the step is
            named).
    """
    watch = Stopwatch()
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tc = cfg.train
    if tc.verify_shards:
        verify_shards(shards)
    device = resolve_device(tc.device)
    precision = resolve_precision(tc.precision, device)
    if tc.num_threads and device.type == "cpu":
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)

    dataset = ShardDataset(shards, "train")
    model = BertMLM(cfg.model, shards.vocab_size, shards.seq_len).to(device)
    # Forward passes go through `forward_model`; checkpoints save `model`, whose
    # state_dict keys carry no `_orig_mod.` prefix.
    compiled = resolve_compile(tc.compile, device)
    forward_model = compile_model(model, device) if compiled else model
    # Inductor builds C++/Triton code at the first step; a missing or broken toolchain
    # surfaces there, deep in a long traceback (empty tuple: nothing to catch).
    compile_errors = (torch._dynamo.exc.BackendCompilerFailed,) if compiled else ()
    optimizer = torch.optim.AdamW(
        model.param_groups(tc.weight_decay),
        lr=tc.lr,
        betas=tc.betas,
        eps=tc.eps,
        **adamw_impl(device),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s,
            warmup_steps=tc.warmup,
            max_steps=tc.max_steps,
            decay=tc.decay,
            min_lr_ratio=tc.min_lr_ratio,
            decay_fraction=tc.decay_fraction,
        ),
    )
    cursor = RowCursor(len(dataset), tc.micro_batch_size, tc.seed)
    masker = build_train_masker(cfg, shards, tokenizer)

    ckpt_root = out / "checkpoints"
    step, tokens_seen = 0, 0
    resume_from = latest_checkpoint(ckpt_root)
    if resume_from is not None:
        state = load_checkpoint(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
            map_location=device,
        )
        step, tokens_seen = state["step"], state["tokens_seen"]
        cursor.load_state_dict(state["cursor"])
        logger.info("resuming at step %d (%d tokens seen)", step, tokens_seen)

    if resume_from is not None:
        _truncate_metrics_log(out / "metrics.jsonl", step)
    jsonl = JsonlSink(out / "metrics.jsonl", append=True)
    sinks = [jsonl] + ([sink] if sink is not None else [])
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    flops_per_token = model.flops_per_token(shards.seq_len, cfg.masking.mlm_probability)
    peak = peak_flops(device, precision)
    tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * shards.seq_len
    clip = tc.grad_clip if tc.grad_clip is not None else float("inf")
    logger.info(
        "training %s parameters on %s (%s%s%s): %d steps of %d tokens, %d training rows",
        f"{model.num_parameters():,}", device, precision, ", compiled" if compiled else "",
        ", document attention" if tc.document_attention else "", tc.max_steps,
        tokens_per_step, len(dataset),
    )

    def snapshot_state() -> dict[str, Any]:
        return {
            "step": step,
            "tokens_seen": tokens_seen,
            "cursor": cursor.state_dict(),
            "config": cfg.model_dump(mode="json"),
            "vocab_size": shards.vocab_size,
            "seq_len": shards.seq_len,
            "tokenizer_digest": tokenizer.digest,
            "shards_digest": shards.digest,
        }

    last_metrics: dict[str, float] = {}
    loss_sum = torch.zeros((), device=device)
    masked_sum = torch.zeros((), device=device, dtype=torch.long)
    interval_steps, interval_start = 0, time.perf_counter()
    run_start = time.perf_counter()
    stopped_early = False
    epoch = cursor.epoch
    model.train()
    while step < tc.max_steps:
        micro = []
        for _ in range(tc.grad_accum_steps):
            rows, epoch = cursor.next_batch()
            input_ids = dataset.get(rows).to(device, non_blocking=True)
            row_index = torch.from_numpy(rows).to(device)
            masked = masker(input_ids, row_index, epoch)
            if tc.document_attention:
                masked = (*masked, document_ids_from_sep(input_ids))
            micro.append(masked)
        try:
            step_loss_sum, step_masked = accumulate_gradients(forward_model, micro, autocast)
        except compile_errors as exc:
            raise RuntimeError(
                f"train.compile={tc.compile}: torch.compile failed to build the model on "
                f"{device.type} ({type(exc).__name__}); set train.compile: off"
            ) from exc
        loss_sum += step_loss_sum
        masked_sum += step_masked
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        interval_steps += 1

        out_of_time = tc.max_time_s is not None and time.perf_counter() - run_start > tc.max_time_s
        if step % tc.log_every == 0 or step == tc.max_steps or out_of_time:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - interval_start
            loss = (loss_sum / masked_sum.clamp(min=1)).item()
            if not math.isfinite(loss):
                raise RuntimeError(f"training loss became {loss} at step {step}")
            tokens_per_s = interval_steps * tokens_per_step / elapsed
            last_metrics = {
                "train/loss": loss,
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": float(grad_norm),
                "train/tokens_per_s": tokens_per_s,
                "train/epoch": float(epoch),
                "train/tokens_seen": float(tokens_seen),
            }
            if peak:
                last_metrics["train/mfu_pct"] = 100.0 * flops_per_token * tokens_per_s / peak
            last_metrics["train/memory_mb"] = peak_memory_mb(device)
            if device.type == "cuda":
                last_metrics["memory/max_reserved_gib"] = (
                    torch.cuda.max_memory_reserved(device) / 2**30
                )
            for s in sinks:
                s.log(last_metrics, step)
            loss_sum.zero_()
            masked_sum.zero_()
            interval_steps, interval_start = 0, time.perf_counter()
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.max_steps:
            save_checkpoint(ckpt_root, step=step, model=model, optimizer=optimizer,
                            scheduler=scheduler, state=snapshot_state(),
                            keep_last=tc.keep_last_checkpoints)
        if out_of_time:
            stopped_early = step < tc.max_steps
            if stopped_early:
                logger.warning(
                    "train.max_time_s=%s reached: stopping at step %d of %d",
                    tc.max_time_s, step, tc.max_steps,
                )
            break

    final = save_checkpoint(ckpt_root, step=step, model=model, optimizer=optimizer,
                            scheduler=scheduler, state=snapshot_state(),
                            keep_last=tc.keep_last_checkpoints)
    for s in sinks:
        s.flush()
    jsonl.close()

    manifest = TrainManifest(
        stage="train",
        digest=train_digest(cfg, shards, tokenizer, out.name),
        output_dir=str(out),
        config={
            "model": cfg.model.model_dump(mode="json"),
            "train": tc.model_dump(mode="json"),
            "masking": cfg.masking.model_dump(mode="json"),
        },
        inputs={"shards": shards.digest, "tokenizer": tokenizer.digest},
        created_at=watch.created_at,
        wall_time_s=watch.elapsed,
        checkpoint_dir=str(final.relative_to(out)),
        steps=step,
        tokens_seen=tokens_seen,
        final_metrics=last_metrics,
        metrics_log="metrics.jsonl",
        stopped_early=stopped_early,
        device=device.type,
        precision=precision,
    )
    write_manifest(manifest)
    return manifest
