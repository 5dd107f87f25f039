"""Atomic, self-describing checkpoints of the loop's Stateful parts, keep-last-k, exact resume.

The `Checkpointer` composes the parts of a run under fixed keys (`LAYOUT`); it knows
nothing about them but `state_dict()` / `load_state_dict()`. A checkpoint is a directory
`step-00000123/` holding:

- `model.safetensors`: the model's `state_dict` (safetensors; a tensor that shares memory
  with an earlier one, the tied decoder, is stored once and named in the metadata),
- `optimizer.pt`: `{"optimizer": ..., "scheduler": ...}`, the optimizer and LR schedule,
- `rng.pt`: torch CPU (and CUDA) generator states (`RngState`), so dropout continues
  identically,
- `state.json`: `format`, the JSON parts (`train_state`: step and tokens seen, `cursor`:
  data position, `masker`: masking identity, checked on resume, `meter`: the open log
  interval's sums) and what makes the directory self-describing: `config` (the `model`,
  `train` and `masking` sections), `vocab_size`, `seq_len` and the digests of the tokenizer
  and shards it was trained on, and `files`: the size and sha256 of every other file.

It is written under a temporary name (every file fsynced, `state.json` last) and renamed,
so a crash never leaves a partial checkpoint that looks complete. Loading verifies every
file against `files` first: a damaged or incomplete newest checkpoint is reported and the
newest intact one is used (`Checkpointer.latest`). A checkpoint is never written from
non-finite weights. Loading uses safetensors and `torch.load(weights_only=True)`: a
checkpoint cannot execute code. Checkpoints written before `format` 2 (the whole pipeline
config under `config`, `step`/`tokens_seen` at the top, no masker or meter state, weights
in `model.pt`) and format-2 ones without `files` still load, unverified.

With a URL work directory (`mlm_pipeline.store`) a saved checkpoint is uploaded to the
store (`state.json` last) with the run directory's other files (`metrics.jsonl`) and the
pruned ones removed from it, and the newest complete
one is downloaded when a run resumes on a machine whose mirror lacks it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mlm_pipeline import store

logger = logging.getLogger(__name__)

_PREFIX = "step-"
_JSON = "state.json"
#: Version of the checkpoint layout; 1 (no `format` key) is the layout before `LAYOUT`;
#: 3 stores the weights as safetensors and the files' sha256.
FORMAT = 3
_WEIGHTS = "model.safetensors"
#: Test hook: SIGKILL this process while writing the checkpoint of this step (after its
#: first file), so tests can kill a run mid-checkpoint-write from outside, in a fresh process.
_DIE_ENV = "MLM_PIPELINE_TEST_DIE_IN_CHECKPOINT"
_LEGACY_WEIGHTS = "model.pt"

#: Where each part's state lives: (file, key inside the file; None: the whole file).
LAYOUT: dict[str, tuple[str, str | None]] = {
    "model": (_WEIGHTS, None),
    "optimizer": ("optimizer.pt", "optimizer"),
    "lr_scheduler": ("optimizer.pt", "scheduler"),
    "rng": ("rng.pt", None),
    "train_state": (_JSON, "train_state"),
    "cursor": (_JSON, "cursor"),
    "masker": (_JSON, "masker"),
    "meter": (_JSON, "meter"),
}
#: Parts a format-1 checkpoint lacks: not restored (and not checked) when resuming one.
_NOT_IN_FORMAT_1 = ("masker", "meter")


@runtime_checkable
class Stateful(Protocol):
    """A part of the loop that a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]:
        """The part's state (tensors for `.pt` files, plain JSON values for `state.json`)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (and check) what `state_dict` returned."""
        ...


class RngState:
    """The torch CPU and (when available) CUDA generator states, as a Stateful part."""

    def state_dict(self) -> dict[str, Any]:
        """`{"cpu": uint8 tensor}` plus `"cuda"`: a list of uint8 tensors, one per device."""
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return rng

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the generators (CUDA only when saved and available)."""
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


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
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / _JSON).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None (not verified: see
    `latest_intact_checkpoint`)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


class CheckpointError(ValueError):
    """A checkpoint directory is damaged or incomplete; the message names the file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def verify_checkpoint(checkpoint: Path) -> None:
    """Check every file of a checkpoint against the sizes and sha256 in its `state.json`.

    Raises:
        CheckpointError: `state.json` is missing or not valid JSON, a listed file is missing
            or its size or sha256 differs (the file is named). Checkpoints written before
            the `files` record pass unverified.
    """
    try:
        state = json.loads((checkpoint / _JSON).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint / _JSON}: unreadable ({exc})") from exc
    for name, want in state.get("files", {}).items():
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: content differs from the sha256 in {_JSON}")


def latest_intact_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` that passes `verify_checkpoint`, or None; every
    newer damaged one is reported with a warning. In the mirror of a URL work directory
    the store's complete checkpoints count too: one the mirror lacks is downloaded when
    its turn comes (a run resumed on another machine), and removed again if damaged."""
    local = {p.name for p in list_checkpoints(root)}
    remote = {name for name in store.complete_children(root, _JSON) if name.startswith(_PREFIX)}
    for name in sorted(local | remote, reverse=True):
        checkpoint = root / name
        fetched = name not in local and store.fetch_tree(checkpoint, last=_JSON) > 0
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as exc:
            logger.warning("checkpoint %s is damaged, trying an older one: %s",
                           checkpoint.name, exc)
            if fetched:
                shutil.rmtree(checkpoint, ignore_errors=True)
            continue
        return checkpoint
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write a model `state_dict` as safetensors; tensors sharing memory with an earlier
    one (tied weights) are stored once and named in the `aliases` metadata.

    Raises:
        ValueError: a floating-point tensor holds a non-finite value (the key is named).
    """
    from safetensors.torch import save_file

    tensors, aliases, seen = {}, {}, {}
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"refusing to checkpoint non-finite weights: {key}")
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape))
        if ptr in seen:
            aliases[key] = seen[ptr]
            continue
        seen[ptr] = key
        tensors[key] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(path), metadata={"aliases": json.dumps(aliases)})


def _load_weights(path: Path, map_location: str | torch.device) -> dict[str, torch.Tensor]:
    """Read what `_save_weights` wrote (aliases restored as the same tensor)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    for key, target in aliases.items():
        state[key] = state[target]
    return {k: v.to(map_location) for k, v in state.items()}


class Checkpointer:
    """Saves and restores the Stateful parts of a run under the fixed keys of `LAYOUT`.

    Args:
        root: directory holding the step directories.
        parts: one Stateful object per `LAYOUT` key.
        meta: JSON values written into every `state.json` beside the parts (config, sizes,
            digests); read back by `read_state`, never restored.
        keep_last: complete checkpoints kept on disk (oldest removed first).
        is_writer: False on the ranks of a distributed run other than 0: `save` gathers
            every part's state (a collective under FSDP2) but writes nothing.
        barrier: called at the end of `save` so no rank runs ahead of the write (None:
            one process).

    Raises:
        ValueError: `parts` does not have exactly the keys of `LAYOUT`, or a `meta` key is
            `format` or a part's key.
    """

    def __init__(self, root: Path, parts: Mapping[str, Stateful], meta: Mapping[str, Any],
                 keep_last: int = 2, is_writer: bool = True,
                 barrier: Callable[[], None] | None = None) -> None:
        if set(parts) != set(LAYOUT):
            raise ValueError(f"checkpoint parts {sorted(parts)} must be {sorted(LAYOUT)}")
        clash = {"format", *LAYOUT} & set(meta)
        if clash:
            raise ValueError(f"checkpoint meta keys {sorted(clash)} are reserved")
        self.root, self.parts, self.meta, self.keep_last = root, dict(parts), dict(meta), keep_last
        self.is_writer, self.barrier = is_writer, barrier or (lambda: None)

    def latest(self) -> Path | None:
        """The newest intact checkpoint under `root` (`latest_intact_checkpoint`), or None."""
        return latest_intact_checkpoint(self.root)

    def save(self, step: int) -> Path:
        """Write every part's state atomically as `step-<step>` and prune all but the newest
        `keep_last` checkpoints.

        Returns:
            The checkpoint directory.

        Raises:
            ValueError: the model's weights are not finite (nothing is written).
        """
        files: dict[str, Any] = {_JSON: {"format": FORMAT, **self.meta}}
        for name, (file, key) in LAYOUT.items():
            state = self.parts[name].state_dict()
            if key is None:
                files[file] = state
            else:
                files.setdefault(file, {})[key] = state
        final = self.root / checkpoint_name(step)
        if self.is_writer:
            self._write(files, final)
        self.barrier()
        return final

    def _write(self, files: dict[str, Any], final: Path) -> None:
        """Write the gathered `files` as the checkpoint `final` (atomically) and prune."""
        step = int(final.name[len(_PREFIX):])
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        record = {}
        for file, content in files.items():
            if file == _JSON:
                continue
            if file == _WEIGHTS:
                _save_weights(content, tmp / file)
            else:
                torch.save(content, tmp / file)
            _fsync(tmp / file)
            if os.environ.get(_DIE_ENV) == str(step):  # test hook: a kill mid-write
                os.kill(os.getpid(), 9)
            record[file] = {"bytes": (tmp / file).stat().st_size, "sha256": _sha256(tmp / file)}
        files[_JSON]["files"] = record
        (tmp / _JSON).write_text(json.dumps(files[_JSON], indent=2, sort_keys=True) + "\n")
        _fsync(tmp / _JSON)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.root)
        for old in list_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        # A URL work directory: the checkpoints to the store, then the run directory's
        # other files (metrics.jsonl), so another machine resumes with the log up to here.
        store.sync_children(self.root, last=_JSON)
        store.publish(self.root.parent, changed_only=True)
        logger.info("checkpoint saved: %s", final)

    def load(self, checkpoint: Path, map_location: str | torch.device = "cpu") -> None:
        """Restore every part from `checkpoint`, the JSON parts (which check that they fit
        this run) first.

        Raises:
            FileNotFoundError: a checkpoint file is missing.
            CheckpointError: a file's size or sha256 differs from `state.json`'s record.
            ValueError: the checkpoint lacks a part's state, or a part refuses it (e.g. the
                data cursor or the masker of another configuration).
            RuntimeError: the model state does not match the model (`load_state_dict`).
        """
        store.fetch_tree(checkpoint, last=_JSON)  # a rank on a node without it: download
        verify_checkpoint(checkpoint)
        files: dict[str, Any] = {_JSON: read_state(checkpoint)}
        legacy = "format" not in files[_JSON]
        for name, (file, key) in sorted(LAYOUT.items(), key=lambda kv: kv[1][0] != _JSON):
            if file not in files:
                where = "cpu" if file == "rng.pt" else map_location
                files[file] = (load_model_state(checkpoint, where) if name == "model" else
                               torch.load(checkpoint / file, map_location=where,
                                          weights_only=True))
            content = files[file]
            if key is not None and key not in content:
                if legacy and name in _NOT_IN_FORMAT_1:
                    logger.warning("%s predates saved %s state: not restored", checkpoint, name)
                    continue
                raise ValueError(f"{checkpoint}: no {name!r} state in {file}")
            self.parts[name].load_state_dict(content if key is None else content[key])
        logger.info("resumed from %s", checkpoint)


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The `state.json` of a checkpoint; a format-1 one gets its `train_state` key.

    Raises:
        FileNotFoundError: when `checkpoint` is not a complete checkpoint directory.
    """
    path = checkpoint / _JSON
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a checkpoint (no {_JSON})")
    state = json.loads(path.read_text())
    if "format" not in state and "train_state" not in state:
        state["train_state"] = {"step": state["step"], "tokens_seen": state["tokens_seen"]}
    return state


def load_model_state(checkpoint: Path, map_location: str | torch.device = "cpu") -> dict:
    """The model `state_dict` of a checkpoint, loaded safely (safetensors, or
    `torch.load(weights_only=True)` for a checkpoint written before safetensors).

    Raises:
        FileNotFoundError: when neither `model.safetensors` nor `model.pt` exists.
    """
    if (checkpoint / _WEIGHTS).is_file():
        return _load_weights(checkpoint / _WEIGHTS, map_location)
    if (checkpoint / _LEGACY_WEIGHTS).is_file():
        return torch.load(checkpoint / _LEGACY_WEIGHTS, map_location=map_location,
                          weights_only=True)
    raise FileNotFoundError(f"{checkpoint}: no {_WEIGHTS} (or {_LEGACY_WEIGHTS})")


def load_model(checkpoint: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Rebuild the `BertMLM` a checkpoint was trained as, with its weights, in eval mode.

    The architecture comes from the checkpoint's own `state.json` (`config.model`,
    `vocab_size`, `seq_len`; both formats have them), so a checkpoint directory is enough
    to use the model.

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
