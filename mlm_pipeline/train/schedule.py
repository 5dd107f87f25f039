"""The learning-rate schedule: linear warm-up, then a linear, cosine or warmup-stable-decay
decay to `train.min_lr_ratio` of the peak at `train.max_steps`.

`build_lr_scheduler` wraps `lr_multiplier` in a `torch.optim.lr_scheduler.LambdaLR`, a
Stateful part of the loop (its `state_dict` is the step count and the last LRs; the factor
itself is recomputed from the config, so it is not saved).
"""

from __future__ import annotations

import math

import torch

from mlm_pipeline.config import TrainConfig


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, decay: str,
                  min_lr_ratio: float, decay_fraction: float = 0.2) -> float:
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


def build_lr_scheduler(optimizer: torch.optim.Optimizer,
                       cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `cfg` (`warmup`, `max_steps`, `decay`, `min_lr_ratio`,
    `decay_fraction`) as a multiplier of each parameter group's `lr`.

    Its `state_dict()` holds `last_epoch` (optimizer steps taken), `base_lrs` and
    `_last_lr`; the lambda is left out (it is not a callable object), so a checkpoint never
    stores code.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, warmup_steps=cfg.warmup, max_steps=cfg.max_steps, decay=cfg.decay,
        min_lr_ratio=cfg.min_lr_ratio, decay_fraction=cfg.decay_fraction))
