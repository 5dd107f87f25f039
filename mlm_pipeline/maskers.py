"""Stateful maskers the training loop calls: dynamic (keyed by epoch) or precomputed; and
the writer of the precomputed copies (`write_masked_copies`, called by the shards stage).

Both produce exactly what `mlm_pipeline.masking.mask_tokens` gives for (seed, epoch, row):
the dynamic masker computes it on the training device, the precomputed one reads the
copies the shards stage wrote with it. `build_masker` is the single dispatch point on
`MaskingConfig.mode`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mlm_pipeline.config import NUM_SPECIAL, MaskingConfig
from mlm_pipeline.manifest import FileEntry, ShardManifest
from mlm_pipeline.masking import MASKING_ALGORITHM, mask_tokens
from mlm_pipeline.shard_io import open_shard, write_arrow

if TYPE_CHECKING:
    from mlm_pipeline.tokenizer import Tokenizer
    from mlm_pipeline.train.data import PrecomputedShardDataset

logger = logging.getLogger(__name__)


@runtime_checkable
class Masker(Protocol):
    """Turns a batch of token ids into (input_ids, labels); stateful for checkpoints."""

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """Corrupt `input_ids` (B, L) for rows `row_index` (B,) in `epoch`; see `mask_tokens`."""
        ...

    def state_dict(self) -> dict:
        """Everything needed to reproduce the masks after a resume."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        ...


def _as_word_starts(word_starts: Tensor | np.ndarray, vocab_size: int) -> Tensor:
    """`word_starts` as a CPU bool tensor (vocab_size,).

    Raises:
        ValueError: it is not shaped (vocab_size,).
    """
    starts = torch.as_tensor(word_starts).to("cpu", torch.bool)
    if starts.shape != (vocab_size,):
        raise ValueError(
            f"masking: word_starts has shape {tuple(starts.shape)}, expected ({vocab_size},)"
        )
    return starts


class DynamicMasker:
    """Dynamic masking (RoBERTa, Liu et al. 2019, §4.1): a fresh mask per epoch, keyed.

    Stateless apart from the seed: the mask of a row is a pure function of
    (seed, epoch, row index, row ids), so a resume reproduces it without any RNG state.

    Args:
        cfg: masking probabilities, `selection` and `whole_word`.
        vocab_size: number of ids, the special tokens included.
        seed: masking seed.
        word_starts: bool (vocab_size,) tensor or array, True where an id begins a word
            (`Tokenizer.word_starts()`); required when `cfg.whole_word`, ignored otherwise.

    Raises:
        ValueError: `vocab_size <= NUM_SPECIAL`, `cfg.whole_word` without `word_starts`, or
            `word_starts` not shaped (vocab_size,).
    """

    mode = "dynamic"

    def __init__(
        self, cfg: MaskingConfig, vocab_size: int, seed: int,
        word_starts: Tensor | np.ndarray | None = None,
    ) -> None:
        if vocab_size <= NUM_SPECIAL:
            raise ValueError(
                f"masking: vocab_size {vocab_size} must exceed NUM_SPECIAL={NUM_SPECIAL}"
            )
        if cfg.whole_word and word_starts is None:
            raise ValueError(
                "masking: masking.whole_word is set but no word_starts were given "
                "(pass Tokenizer.word_starts())"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.seed = seed
        self._word_starts: dict[torch.device, Tensor] = {}
        if cfg.whole_word:
            starts = _as_word_starts(word_starts, vocab_size)
            self._word_starts[starts.device] = starts

    def _starts_on(self, device: torch.device) -> Tensor | None:
        """The word starts on `device` (copied once per device), or None for tokens."""
        if not self._word_starts:
            return None
        if device not in self._word_starts:
            self._word_starts[device] = next(iter(self._word_starts.values())).to(device)
        return self._word_starts[device]

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """Corrupt a batch; see `mask_tokens` for shapes, dtypes and errors.

        Args:
            input_ids: token ids (B, L), integer dtype; not modified.
            row_index: int64 (B,) global row ids.
            epoch: epoch number.

        Returns:
            `(input_ids, labels)`, int64 (B, L).
        """
        return mask_tokens(
            input_ids,
            vocab_size=self.vocab_size,
            row_index=row_index,
            seed=self.seed,
            epoch=epoch,
            mlm_probability=self.cfg.mlm_probability,
            mask_replace_prob=self.cfg.mask_replace_prob,
            random_replace_prob=self.cfg.random_replace_prob,
            selection=self.cfg.selection,
            word_starts=self._starts_on(input_ids.device),
        )

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size", "selection", "whole_word", "algorithm"}`
        (plain Python values)."""
        return {"mode": self.mode, "seed": self.seed, "vocab_size": self.vocab_size,
                "selection": self.cfg.selection, "whole_word": self.cfg.whole_word,
                "algorithm": MASKING_ALGORITHM}

    def load_state_dict(self, state: dict) -> None:
        """Restore the seed.

        Raises:
            ValueError: the state comes from another masking mode, vocabulary size,
                selection, whole-word setting or masking algorithm version.
        """
        mine = self.state_dict()
        differ = {k: state.get(k) for k in mine if k != "seed" and state.get(k) != mine[k]}
        if differ:
            raise ValueError(
                f"masking: checkpoint masking state {differ} does not match this run's "
                f"{ {k: mine[k] for k in differ} }"
            )
        self.seed = int(state["seed"])


class PrecomputedMasker:
    """Precomputed (static) masking (BERT, Devlin et al. 2019): reads the masked copies the
    shards stage wrote with `mask_tokens` keyed by (seed, copy, row); epoch `e` gets copy
    `e % dupe_factor`. With `dupe_factor` > the epochs trained, the masks equal dynamic
    masking's; the position is the data cursor's epoch, so there is no state to restore.

    Args:
        cfg: masking config (must be the one the copies were written with).
        vocab_size: number of ids, the special tokens included.
        seed: masking seed (must be the one the copies were written with).
        source: the masked copies of the training split.
    """

    mode = "precomputed"

    def __init__(
        self, cfg: MaskingConfig, vocab_size: int, seed: int, source: PrecomputedShardDataset
    ) -> None:
        self.cfg, self.vocab_size, self.seed, self.source = cfg, vocab_size, seed, source

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """The precomputed corruption of rows `row_index` in `epoch`.

        Args:
            input_ids: the unmasked rows (B, L); only their shape and device are used (the
                copies were made from the same rows by the shards stage).
            row_index: int64 (B,) global training row ids.
            epoch: epoch number; copy `epoch % dupe_factor` is read.

        Returns:
            `(input_ids, labels)`, int64 (B, L) on the device of `input_ids`.

        Raises:
            ValueError: the copies' rows are not shaped like `input_ids`.
        """
        ids, labels = self.source.get(row_index.cpu().numpy(), epoch)
        if ids.shape != input_ids.shape:
            raise ValueError(
                f"masking: precomputed rows {tuple(ids.shape)} differ from the batch "
                f"{tuple(input_ids.shape)}"
            )
        device = input_ids.device
        return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size", "dupe_factor", "selection",
        "whole_word"}` (plain Python values)."""
        return {"mode": self.mode, "seed": self.seed, "vocab_size": self.vocab_size,
                "dupe_factor": self.source.dupe_factor, "selection": self.cfg.selection,
                "whole_word": self.cfg.whole_word}

    def load_state_dict(self, state: dict) -> None:
        """Check that a checkpoint's masking matches these copies (nothing else to restore).

        Raises:
            ValueError: the state comes from another mode, vocabulary, seed, dupe_factor,
                selection or whole-word setting.
        """
        if state != self.state_dict():
            raise ValueError(
                f"masking: checkpoint state {state} does not match {self.state_dict()}"
            )


def build_masker(
    cfg: MaskingConfig, vocab_size: int, seed: int, shards: ShardManifest | None = None,
    word_starts: Tensor | np.ndarray | None = None,
) -> Masker:
    """Build the masker selected by `cfg.mode` (the single dispatch point, STYLE rule 6).

    Args:
        cfg: masking config.
        vocab_size: number of ids, the special tokens included.
        seed: masking seed (usually `TrainConfig.seed`).
        shards: the training shards; required by `precomputed` mode, whose copies they hold.
        word_starts: bool (vocab_size,), True where an id begins a word
            (`Tokenizer.word_starts()`); required by `dynamic` mode with `cfg.whole_word`
            (precomputed copies already hold their whole-word masks), ignored otherwise.

    Returns:
        A `Masker`.

    Raises:
        ValueError: unknown `cfg.mode`, `vocab_size <= NUM_SPECIAL`, in `dynamic` mode
            `cfg.whole_word` without `word_starts`, or in `precomputed` mode: no `shards`,
            shards without masked copies, or copies written with another masking config
            or seed than `cfg` and `seed`.
    """
    if cfg.mode == "dynamic":
        return DynamicMasker(cfg, vocab_size, seed, word_starts if cfg.whole_word else None)
    if cfg.mode == "precomputed":
        if shards is None:
            raise ValueError("masking: precomputed mode needs the shard manifest")
        want = {"masking": cfg.model_dump(mode="json"), "masking_seed": seed,
                "masking_algorithm": MASKING_ALGORITHM}
        have = {k: shards.config.get(k) for k in want}
        if have != want:
            raise ValueError(
                f"masking: the shards in {shards.output_dir} were written with {have}, but "
                f"training asks for {want}; rewrite them with this masking config and "
                "train.seed"
            )
        from mlm_pipeline.train.data import (
            PrecomputedShardDataset,  # avoids an import cycle
        )

        return PrecomputedMasker(cfg, vocab_size, seed, PrecomputedShardDataset(shards))
    raise ValueError(f"masking: unknown mode {cfg.mode!r}")


#: Rows masked per `mask_tokens` call: bounds the (3, rows, seq_len) int64 hash buffer.
_MASK_CHUNK_ROWS = 4096


def write_masked_copies(
    shards: list[FileEntry], out_dir: Path, masking: MaskingConfig, seed: int,
    tok: Tokenizer, seq_len: int,
) -> list[FileEntry]:
    """Write the `dupe_factor` masked copies of the training shards (precomputed masking;
    layout and naming in the `mlm_pipeline.shards` docstring).

    Copy `c` of shard `i` is `train-copy{c}-{i:05d}.arrow`: `input_ids`
    (fixed_size_list<uint16|uint32>[seq_len], the shards' dtype) and `labels`
    (fixed_size_list<int32>[seq_len], -100 where not predicted), made by `mask_tokens`
    keyed by (seed, epoch=c, row_index = global training row), so copy `c` equals what
    dynamic masking gives in epoch `c`.

    Args:
        shards: entries of the unmasked training shards, in row order.
        out_dir: the shards stage directory (entries' paths are relative to it).
        masking: `dupe_factor`, `mlm_probability`, replacement shares, `selection`,
            `whole_word` (word starts from `Tokenizer.word_starts`).
        seed: masking seed (the training seed).
        tok: the tokenizer (vocabulary size, word starts).
        seq_len: tokens per row.

    Returns:
        The copies' entries, copy-major, then shard order.

    Raises:
        OSError: a copy cannot be written (its temporary file is removed).
    """
    word_starts = torch.from_numpy(tok.word_starts()) if masking.whole_word else None
    entries: list[FileEntry] = []
    for c in range(masking.dupe_factor):
        first_row = 0
        for i, entry in enumerate(shards):
            rows = open_shard(out_dir / entry.path)
            ids_out = np.empty_like(rows)
            labels_out = np.empty(rows.shape, np.int32)
            for start in range(0, len(rows), _MASK_CHUNK_ROWS):
                chunk = torch.from_numpy(rows[start : start + _MASK_CHUNK_ROWS].astype(np.int64))
                row_index = torch.arange(first_row + start, first_row + start + len(chunk))
                ids, labels = mask_tokens(
                    chunk, vocab_size=tok.vocab_size, row_index=row_index, seed=seed, epoch=c,
                    mlm_probability=masking.mlm_probability,
                    mask_replace_prob=masking.mask_replace_prob,
                    random_replace_prob=masking.random_replace_prob,
                    selection=masking.selection, word_starts=word_starts,
                )
                ids_out[start : start + len(chunk)] = ids.numpy()
                labels_out[start : start + len(chunk)] = labels.numpy()
            path = out_dir / f"train-copy{c}-{i:05d}.arrow"
            entries.append(write_arrow(out_dir, path, {"input_ids": ids_out,
                                                        "labels": labels_out}, seq_len))
            first_row += len(rows)
        logger.info("shards: masked copy %d of %d written (%d rows)", c + 1,
                    masking.dupe_factor, first_row)
    return entries
