"""Atomic, self-describing checkpoints with keep-last-k and exact resume.

A checkpoint is a directory `step-00000123/` holding:

- `model.pt`: the model's `state_dict` (tensors only),
- `optimizer.pt`: optimizer and LR-scheduler state,
- `state.json`: train state (`step`, `tokens_seen`), data cursor, RNG seeds, the resolved
  pipeline config and the digests of the tokenizer and shards it was trained on,
- `rng.pt`: torch CPU (and CUDA) generator states, so dropout continues identically.

It is written under a temporary name and renamed, so a crash never leaves a partial
checkpoint that looks complete. Loading uses `torch.load(weights_only=True)`: a checkpoint
cannot execute code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint at optimizer step `step`."""
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (partial `.tmp` dirs excluded)."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / "state.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write a checkpoint atomically and prune all but the newest `keep_last`.

    Args:
        root: directory holding the step directories.
        step: optimizer steps taken.
        model, optimizer, scheduler: objects with `state_dict()`.
        state: JSON-able train state (step, tokens_seen, data cursor, config, digests).
        keep_last: complete checkpoints kept on disk.

    Returns:
        The checkpoint directory.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        tmp / "optimizer.pt",
    )
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint saved: %s", final)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The `state.json` of a checkpoint.

    Raises:
        FileNotFoundError: when `checkpoint` is not a complete checkpoint directory.
    """
    path = checkpoint / "state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a checkpoint (no state.json)")
    return json.loads(path.read_text())


def load_model_state(checkpoint: Path, map_location: str | torch.device = "cpu") -> dict:
    """The model `state_dict` of a checkpoint, loaded safely (`weights_only=True`).

    Raises:
        FileNotFoundError: when `model.pt` is missing.
    """
    return torch.load(checkpoint / "model.pt", map_location=map_location, weights_only=True)


def load_checkpoint(
    checkpoint: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG state in place; return the train state.

    Raises:
        FileNotFoundError: when a checkpoint file is missing.
        RuntimeError: when the model state does not match the model (from `load_state_dict`).
    """
    model.load_state_dict(load_model_state(checkpoint, map_location))
    opt = torch.load(checkpoint / "optimizer.pt", map_location=map_location, weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(checkpoint / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    logger.info("resumed from %s", checkpoint)
    return read_state(checkpoint)


def load_model(checkpoint: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Rebuild the `BertMLM` a checkpoint was trained as, with its weights, in eval mode.

    The architecture comes from the checkpoint's own `state.json` (resolved config,
    `vocab_size`, `seq_len`), so a checkpoint directory is enough to use the model.

    Raises:
        FileNotFoundError: when `checkpoint` is not a complete checkpoint directory.
    """
    from mlm_pipeline.config import ModelConfig
    from mlm_pipeline.train.model import BertMLM

    state = read_state(checkpoint)
    model_cfg = ModelConfig.model_validate(state["config"]["model"])
    model = BertMLM(model_cfg, state["vocab_size"], state["seq_len"])
    model.load_state_dict(load_model_state(checkpoint, "cpu"))
    return model.to(device).eval()
