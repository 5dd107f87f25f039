"""Finding, verifying and loading checkpoints: the one way every user of a checkpoint
(training's resume, evaluation, `fill-mask`, `export`) reads one.

A checkpoint directory (`step-XXXXXXXX/`, written by `train.checkpoint.Checkpointer`) is
*intact* when its `state.json` carries `state_sha256`, the sha256 of its own other fields
in canonical JSON (an edited `step` or a deleted `files` record no longer matches), and
every file in the state's `files` record has the size and sha256 recorded there.

Before a model is built (`load_verified`), the declared sizes must be those of the tensors
(`check_sizes`), so a declared `vocab_size` of 2,000,000,000 is refused before any memory
is allocated. A checkpoint without a digest or `files` record is refused
(`UnverifiedCheckpointError`) unless trusted; a trusted one is still bounded by its
tensors. Loading uses safetensors and `torch.load(weights_only=True)`: a checkpoint cannot
execute code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline import store

logger = logging.getLogger(__name__)

PREFIX = "step-"
STATE = "state.json"
WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "model.pt"
#: Key of `state.json` holding the sha256 of the state's other fields (`state_digest`).
STATE_DIGEST = "state_sha256"
#: Largest `seq_len` (tokens) a checkpoint may declare: with rotary positions no tensor
#: holds it, and the model's rotary tables take `seq_len * head_dim * 8` bytes.
MAX_SEQ_LEN = 1 << 18
#: How a user accepts a checkpoint that cannot be verified, named in the refusal.
TRUST_HINT = ("pass --trust-unverified (fill-mask, export) or set "
              "train.trust_unverified_checkpoint=true (training) to use it anyway")


class CheckpointError(ValueError):
    """A checkpoint directory is damaged or incomplete; the message names the file."""


class UnverifiedCheckpointError(CheckpointError):
    """A checkpoint records no digest to verify it against (written before digests, or its
    record removed); the message names the file and how to accept it anyway."""


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (partial `.tmp` dirs excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None (not verified: see
    `latest_intact_checkpoint`)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (read 1 MiB at a time)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def state_digest(state: dict[str, Any]) -> str:
    """Hex sha256 of `state` without its `STATE_DIGEST` key, as canonical JSON (sorted
    keys, no spaces): the same after a JSON round trip, different after any edit."""
    body = {k: v for k, v in state.items() if k != STATE_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with `STATE_DIGEST` set to its `state_digest` (what the writer stores)."""
    return {**{k: v for k, v in state.items() if k != STATE_DIGEST},
            STATE_DIGEST: state_digest(state)}


def _read_json(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / STATE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a checkpoint (no {STATE})")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return state


def verify_checkpoint(checkpoint: Path, trust_unverified: bool = False) -> dict[str, Any]:
    """Check `state.json` against its own digest and every file against the sizes and
    sha256 in `state.json` (the declared sizes are `check_sizes`').

    Args:
        checkpoint: a checkpoint directory (`.../step-XXXXXXXX`).
        trust_unverified: accept a checkpoint without a digest or `files` record (with a
            warning); a recorded digest that differs is refused all the same.

    Returns:
        The state (as `read_state` gives it).

    Raises:
        FileNotFoundError: `checkpoint` has no `state.json`.
        UnverifiedCheckpointError: no digest or no `files` record, and not trusted (the
            file is named, and how to accept it).
        CheckpointError: `state.json` is not valid JSON or differs from its digest, a
            listed file is missing or its size or sha256 differs (the file is named).
    """
    state = _read_json(checkpoint)
    path = checkpoint / STATE
    recorded = state.get(STATE_DIGEST)
    if recorded is not None and recorded != state_digest(state):
        raise CheckpointError(f"{path}: content differs from its digest ({STATE_DIGEST}): "
                              "edited or damaged")
    if recorded is None or not isinstance(state.get("files"), dict):
        missing = "no state digest" if recorded is None else "no files record"
        if not trust_unverified:
            raise UnverifiedCheckpointError(
                f"{path}: cannot be verified ({missing}: written before checkpoints were "
                f"verified, or its record removed); {TRUST_HINT}")
        logger.warning("%s: %s, used unverified (trusted by the user)", path, missing)
    for name, want in (state.get("files") or {}).items():
        file = checkpoint / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size != want["bytes"] or sha256_file(file) != want["sha256"]:
            raise CheckpointError(f"{file}: content differs from the sha256 in {STATE}")
    return _with_train_state(state)


def _with_train_state(state: dict[str, Any]) -> dict[str, Any]:
    if "format" not in state and "train_state" not in state and "step" in state:
        state["train_state"] = {"step": state["step"], "tokens_seen": state.get("tokens_seen", 0)}
    return state


def _stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape as the weights file stores it, without loading a tensor
    (safetensors header; a legacy `model.pt` through a memory map)."""
    if (checkpoint / WEIGHTS).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(checkpoint / WEIGHTS), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
                aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        except Exception as exc:  # safetensors raises its own error types on a bad header
            raise CheckpointError(f"{checkpoint / WEIGHTS}: unreadable header ({exc})") from exc
        for key, target in aliases.items():
            if target in shapes:
                shapes[key] = shapes[target]
        return shapes
    if (checkpoint / LEGACY_WEIGHTS).is_file():
        state = torch.load(checkpoint / LEGACY_WEIGHTS, map_location="cpu", weights_only=True,
                           mmap=True)
        return {k: tuple(v.shape) for k, v in state.items()}
    raise FileNotFoundError(f"{checkpoint}: no {WEIGHTS} (or {LEGACY_WEIGHTS})")


def check_sizes(checkpoint: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose declared sizes are not its tensors': the declared model is
    built on the `meta` device (no memory) and its names and shapes compared with the
    weights file's header.

    Raises:
        CheckpointError: a declared size is missing, not a positive integer, `seq_len` is
            above `MAX_SEQ_LEN`, the model config is invalid, or a tensor's shape (or
            presence) differs (`state.json` and the tensor are named).
    """
    from pydantic import ValidationError

    from mlm_pipeline.config import ModelConfig
    from mlm_pipeline.train.model import BertMLM

    path = checkpoint / STATE
    sizes = {k: state.get(k) for k in ("vocab_size", "seq_len")}
    for key, value in sizes.items():
        if type(value) is not int or value < 1:
            raise CheckpointError(f"{path}: {key} {value!r} is not a positive integer")
    if sizes["seq_len"] > MAX_SEQ_LEN:
        raise CheckpointError(f"{path}: seq_len {sizes['seq_len']} is above the largest "
                              f"a checkpoint may declare ({MAX_SEQ_LEN})")
    try:
        model_cfg = ModelConfig.from_record((state.get("config") or {}).get("model"))
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in
                    BertMLM(model_cfg, sizes["vocab_size"], sizes["seq_len"]).state_dict().items()}
    except (ValidationError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: config.model is not a valid model ({exc})") from exc
    have = _stored_shapes(checkpoint)
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            raise CheckpointError(
                f"{path}: the declared model (vocab_size {sizes['vocab_size']}, seq_len "
                f"{sizes['seq_len']}, config.model) needs {key} of shape {want.get(key)}, "
                f"the weights hold {have.get(key)}")


def latest_intact_checkpoint(root: Path, trust_unverified: bool = False) -> Path | None:
    """The newest checkpoint under `root` that passes `verify_checkpoint`, or None; every
    newer damaged one is reported with a warning. In the mirror of a URL work directory
    the store's checkpoints count too (downloaded when their turn comes).

    Raises:
        UnverifiedCheckpointError: the newest checkpoint that is not damaged cannot be
            verified, and `trust_unverified` is false (never skipped silently).
    """
    found, _ = _newest_intact(root, trust_unverified)
    return found


def _newest_intact(root: Path, trust: bool) -> tuple[Path | None, list[str]]:
    local = {p.name for p in list_checkpoints(root)}
    remote = {name for name in store.complete_children(root, STATE) if name.startswith(PREFIX)}
    refused: list[str] = []
    for name in sorted(local | remote, reverse=True):
        checkpoint = root / name
        fetched = name not in local and store.fetch_tree(checkpoint, last=STATE) > 0
        try:
            verify_checkpoint(checkpoint, trust)
        except UnverifiedCheckpointError:
            raise
        except CheckpointError as exc:
            logger.warning("checkpoint %s is damaged, trying an older one: %s",
                           checkpoint.name, exc)
            refused.append(str(exc))
            if fetched:
                shutil.rmtree(checkpoint, ignore_errors=True)
            continue
        return checkpoint, refused
    return None, refused


def find_checkpoint(path: Path, trust_unverified: bool = False) -> Path:
    """The checkpoint to use for `path`: `path` itself when it is a checkpoint directory
    (verified), else the newest intact checkpoint under the run directory `path` or its
    `checkpoints/` directory (newer damaged ones named in warnings).

    Raises:
        FileNotFoundError: `path` does not exist or holds no complete checkpoint.
        UnverifiedCheckpointError: the checkpoint cannot be verified and is not trusted.
        CheckpointError: the checkpoint is damaged, or every checkpoint of the run is
            (each named with its reason).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint or run directory")
    if (path / STATE).is_file():
        verify_checkpoint(path, trust_unverified)
        return path
    for root in (path, path / "checkpoints"):
        if not list_checkpoints(root):
            continue
        found, refused = _newest_intact(root, trust_unverified)
        if found is None:
            raise CheckpointError(f"{root}: no intact checkpoint; " + "; ".join(refused))
        return found
    raise FileNotFoundError(f"{path}: holds no complete checkpoint (no step-*/{STATE})")


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The `state.json` of a checkpoint, not verified (see `verify_checkpoint`); a
    format-1 one gets its `train_state` key.

    Raises:
        FileNotFoundError: when `checkpoint` is not a complete checkpoint directory.
        CheckpointError: `state.json` is not a JSON object.
    """
    return _with_train_state(_read_json(checkpoint))


def _load_weights(path: Path, map_location: str | torch.device) -> dict[str, torch.Tensor]:
    """Read what `Checkpointer` wrote as safetensors (aliases restored as the same tensor)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    for key, target in aliases.items():
        state[key] = state[target]
    return {k: v.to(map_location) for k, v in state.items()}


def load_model_state(checkpoint: Path, map_location: str | torch.device = "cpu") -> dict:
    """The model `state_dict` of a checkpoint, loaded safely (safetensors, or
    `torch.load(weights_only=True)` for an older one); not verified.

    Raises:
        FileNotFoundError: when neither `model.safetensors` nor `model.pt` exists.
    """
    if (checkpoint / WEIGHTS).is_file():
        return _load_weights(checkpoint / WEIGHTS, map_location)
    if (checkpoint / LEGACY_WEIGHTS).is_file():
        return torch.load(checkpoint / LEGACY_WEIGHTS, map_location=map_location,
                          weights_only=True)
    raise FileNotFoundError(f"{checkpoint}: no {WEIGHTS} (or {LEGACY_WEIGHTS})")


def load_model(checkpoint: Path, device: str | torch.device = "cpu",
               trust_unverified: bool = False) -> torch.nn.Module:
    """Rebuild the `BertMLM` a checkpoint was trained as, with its weights, in eval mode
    (`load_verified`'s model).

    Raises:
        The errors of `load_verified`.
    """
    return load_verified(checkpoint, device, trust_unverified)[0]


def load_verified(checkpoint: Path, device: str | torch.device = "cpu",
                  trust_unverified: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The `BertMLM` a checkpoint was trained as (from its own `state.json`), with its
    weights, in eval mode, and that state, once the checkpoint passes `verify_checkpoint`
    and `check_sizes` (before anything is allocated).

    Raises:
        FileNotFoundError: when `checkpoint` is not a complete checkpoint directory.
        UnverifiedCheckpointError: it cannot be verified and is not trusted.
        CheckpointError: it is damaged, or declares sizes its tensors do not have.
    """
    from mlm_pipeline.config import ModelConfig
    from mlm_pipeline.train.model import BertMLM

    state = verify_checkpoint(Path(checkpoint), trust_unverified)
    check_sizes(Path(checkpoint), state)
    model_cfg = ModelConfig.from_record(state["config"]["model"])
    model = BertMLM(model_cfg, state["vocab_size"], state["seq_len"])
    model.load_state_dict(load_model_state(checkpoint, "cpu"))
    return model.to(device).eval(), state
