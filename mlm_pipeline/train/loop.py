"""The pretraining loop: AdamW, warm-up then decay, clipping, accumulation, checkpoints.

`train()` builds the model, optimizer, schedule, data cursor and masker from the config,
resumes from the newest checkpoint in its output directory if there is one, and runs until
`train.max_steps` optimizer steps or the `train.max_time_s` wall-clock budget. Every
`train.log_every` steps it hands one metrics dict to the sink it was given (the loop never
talks to MLflow itself): `train/loss` (masked-token-weighted mean over the interval),
`train/lr`, `train/grad_norm`, `train/tokens_per_s`, `train/mfu_pct`, `train/epoch`,
`train/tokens_seen` and, on CUDA, `memory/max_reserved_gib`.

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

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (
    ShardManifest,
    Stopwatch,
    TokenizerManifest,
    TrainManifest,
    compute_digest,
    write_manifest,
)
from mlm_pipeline.masking import build_masker
from mlm_pipeline.tracking import JsonlSink, MetricsSink
from mlm_pipeline.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mlm_pipeline.train.data import RowCursor, ShardDataset
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.perf import peak_flops, resolve_device, resolve_precision

logger = logging.getLogger(__name__)


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, decay: str, min_lr_ratio: float
) -> float:
    """Learning-rate factor for the optimizer step that follows `step` completed steps.

    Linear warm-up from `1 / warmup_steps` to 1 over `warmup_steps` steps (Goyal et al.
    2017; BERT uses 10k warm-up steps, Devlin et al. 2019 appendix A.2), then a linear or
    cosine (Loshchilov & Hutter 2017) decay to `min_lr_ratio` at `max_steps`.

    Raises:
        ValueError: for an unknown `decay`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
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
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward every micro-batch, each weighted by its share of the step's
    masked tokens, so the accumulated gradient is that of one batch holding them all.

    Args:
        model: a `BertMLM`; its loss is the mean cross-entropy over a micro-batch's
            masked tokens.
        micro_batches: `(input_ids, labels)` pairs, int64 (b, L) each.
        autocast: context entered around each forward pass.

    Returns:
        (sum of per-token losses, number of masked tokens) over all micro-batches, as
        0-dim tensors on the model's device (no host sync).
    """
    total = sum((labels != -100).sum() for _, labels in micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    for input_ids, labels in micro_batches:
        with autocast:
            output = model(input_ids, labels=labels)
        # mean_i * n_i / n_total summed over micro-batches = the mean over all n_total tokens.
        (output.loss * (output.num_masked / total.clamp(min=1))).backward()
        loss_sum += output.loss.detach().float() * output.num_masked
    return loss_sum, total


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
        ValueError: when the training split has fewer rows than one micro-batch, or with
            precomputed masking, the shards hold no copies made with this masking and seed.
        RuntimeError: when CUDA or bf16 is requested but unavailable, or the loss becomes
            non-finite (the step is named).
    """
    watch = Stopwatch()
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tc = cfg.train
    device = resolve_device(tc.device)
    precision = resolve_precision(tc.precision, device)
    if tc.num_threads and device.type == "cpu":
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)

    dataset = ShardDataset(shards, "train")
    model = BertMLM(cfg.model, shards.vocab_size, shards.seq_len).to(device)
    optimizer = torch.optim.AdamW(
        model.param_groups(tc.weight_decay),
        lr=tc.lr,
        betas=tc.betas,
        eps=tc.eps,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s,
            warmup_steps=tc.warmup_steps,
            max_steps=tc.max_steps,
            decay=tc.decay,
            min_lr_ratio=tc.min_lr_ratio,
        ),
    )
    cursor = RowCursor(len(dataset), tc.micro_batch_size, tc.seed)
    masker = build_masker(cfg.masking, shards.vocab_size, tc.seed, shards)

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
        "training %s parameters on %s (%s): %d steps of %d tokens, %d training rows",
        f"{model.num_parameters():,}", device, precision, tc.max_steps, tokens_per_step,
        len(dataset),
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
            micro.append(masker(input_ids, row_index, epoch))
        step_loss_sum, step_masked = accumulate_gradients(model, micro, autocast)
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
