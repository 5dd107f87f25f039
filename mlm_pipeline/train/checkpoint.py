"""Atomic, self-describing checkpoints of the loop's Stateful parts, keep-last-k, exact resume.

The `Checkpointer` composes the parts of a run under fixed keys (`LAYOUT`); it knows
nothing about them but `state_dict()` / `load_state_dict()`. A checkpoint is a directory
`step-00000123/` holding `model.safetensors` (a tensor sharing memory with an earlier one,
the tied decoder, is stored once and named in the metadata), `optimizer.pt` (optimizer and
LR schedule), `rng.pt` (torch CPU and CUDA generators, so dropout continues identically)
and `state.json`: `format`, the JSON parts (`train_state`, `cursor`, `masker`, `meter`),
what makes the directory self-describing (`config`, `vocab_size`, `seq_len`, the
tokenizer and shard digests) and `files`, the size and sha256 of every other file.

It is written under a temporary name (`.step-XXXXXXXX.<host>.<pid>.tmp`, every file
fsynced, `state.json` last, sealed with the digest of its own fields) and renamed, so a
crash never leaves a partial checkpoint that looks complete; the temporary directories of
writers that died on this host are removed by the next save. A checkpoint is never
written from non-finite weights. Finding, verifying and loading checkpoints is
`train.verified`'s (re-exported here). With a URL work directory (`mlm_pipeline.store`) a
saved checkpoint is uploaded with the run directory's other files and the pruned ones
removed from the store.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mlm_pipeline import store
from mlm_pipeline.train.verified import (  # noqa: F401  (re-exported: the public API)
    PREFIX, STATE_DIGEST, WEIGHTS, CheckpointError, UnverifiedCheckpointError,
    find_checkpoint, latest_checkpoint, latest_intact_checkpoint, list_checkpoints,
    load_model, load_model_state, read_state, seal_state, sha256_file, verify_checkpoint,
)

logger = logging.getLogger(__name__)

_JSON = "state.json"
#: A writer's temporary directory: `.step-XXXXXXXX.<host>.<pid>.tmp` (`<host>.` absent
#: in names written before hosts were recorded).
_TEMP = re.compile(r"^\.step-\d{8}\.(?:(?P<host>.+)\.)?(?P<pid>\d+)\.tmp$")
#: Version of the checkpoint layout; 1 (no `format` key) is the layout before `LAYOUT`;
#: 3 stores the weights as safetensors and the files' sha256.
FORMAT = 3

#: Where each part's state lives: (file, key inside the file; None: the whole file).
LAYOUT: dict[str, tuple[str, str | None]] = {
    "model": (WEIGHTS, None),
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (and check) what `state_dict` returned."""


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
    return f"{PREFIX}{step:08d}"


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
        barrier: called at the end of `save` so no rank runs ahead of the write (None: none).
        trust_unverified: resume from a checkpoint that cannot be verified (no digest);
            False refuses it (`UnverifiedCheckpointError`).

    Raises:
        ValueError: `parts` does not have exactly the keys of `LAYOUT`, or a `meta` key is
            `format` or a part's key.
    """

    def __init__(self, root: Path, parts: Mapping[str, Stateful], meta: Mapping[str, Any],
                 keep_last: int = 2, is_writer: bool = True,
                 barrier: Callable[[], None] | None = None,
                 trust_unverified: bool = False) -> None:
        if set(parts) != set(LAYOUT):
            raise ValueError(f"checkpoint parts {sorted(parts)} must be {sorted(LAYOUT)}")
        clash = {"format", *LAYOUT} & set(meta)
        if clash:
            raise ValueError(f"checkpoint meta keys {sorted(clash)} are reserved")
        self.root, self.parts, self.meta, self.keep_last = root, dict(parts), dict(meta), keep_last
        self.is_writer, self.barrier = is_writer, barrier or (lambda: None)
        self.trust_unverified = trust_unverified

    def latest(self) -> Path | None:
        """The newest intact checkpoint under `root` (`latest_intact_checkpoint`), or None.

        Raises:
            UnverifiedCheckpointError: the newest undamaged checkpoint cannot be verified
                and this checkpointer does not trust it.
        """
        return latest_intact_checkpoint(self.root, self.trust_unverified)

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
        self.root.mkdir(parents=True, exist_ok=True)
        remove_dead_writers(self.root)
        tmp = self.root / f".{final.name}.{socket.gethostname()}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        record = {}
        for file, content in files.items():
            if file == _JSON:
                continue
            if file == WEIGHTS:
                _save_weights(content, tmp / file)
            else:
                torch.save(content, tmp / file)
            _fsync(tmp / file)
            record[file] = {"bytes": (tmp / file).stat().st_size, "sha256": sha256_file(tmp / file)}
        files[_JSON]["files"] = record
        sealed = seal_state(files[_JSON])  # last: the digest covers every field above
        (tmp / _JSON).write_text(json.dumps(sealed, indent=2, sort_keys=True) + "\n")
        _fsync(tmp / _JSON)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.root)
        for old in list_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        # A URL work directory: the run directory's other files (metrics.jsonl) first, then
        # the checkpoints (each `state.json` last). A kill in between leaves the store with
        # a log reaching past its newest complete checkpoint (cut back on resume), never a
        # checkpoint whose log lacks the steps up to it (another machine would lose them).
        store.publish(self.root.parent, changed_only=True, exclude=(self.root.name,))
        store.sync_children(self.root, last=_JSON)
        logger.info("checkpoint saved: %s", final)

    def load(self, checkpoint: Path, map_location: str | torch.device = "cpu") -> None:
        """Restore every part from `checkpoint`, the JSON parts (which check that they fit
        this run) first.

        Raises:
            FileNotFoundError: a checkpoint file is missing.
            CheckpointError: `state.json` differs from its digest, a file's size or sha256
                from `state.json`'s record, or a declared size from the tensors'.
            UnverifiedCheckpointError: no digest to verify it against, and not trusted.
            ValueError: the checkpoint lacks a part's state, or a part refuses it (e.g. the
                data cursor or the masker of another configuration).
            RuntimeError: the model state does not match the model (`load_state_dict`).
        """
        store.fetch_tree(checkpoint, last=_JSON)  # a rank on a node without it: download
        files: dict[str, Any] = {_JSON: verify_checkpoint(checkpoint, self.trust_unverified)}
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


def remove_dead_writers(root: Path) -> list[Path]:
    """Remove the temporary directories under `root` of checkpoint writers that died on
    this host (`.step-XXXXXXXX.<host>.<pid>.tmp`, a name without a host counting as this
    host's); another host's, and a live process's, are kept.

    Returns:
        The directories removed.
    """
    removed, here = [], socket.gethostname()
    for p in root.iterdir() if root.is_dir() else ():
        m = _TEMP.match(p.name)
        if m is None or not p.is_dir() or (m["host"] not in (None, here)):
            continue
        if int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            logger.info("removed %s: its writer (pid %s) is dead", p, m["pid"])
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
