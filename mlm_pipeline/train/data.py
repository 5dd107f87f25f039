"""Memory-mapped token rows and a resumable, deterministic batch order.

`ShardDataset` maps the Arrow IPC shards of one split (`ShardManifest`) without copying and
gathers rows by global index; `PrecomputedShardDataset` does the same for the masked
copies of the training split (`masking.mode: precomputed`). `RowCursor` walks a shuffled
order that depends only on (seed, epoch), so the position `(epoch, offset)` is the whole
state: a resumed run sees exactly the batches an uninterrupted run would have seen, and
the W ranks of a distributed run take disjoint strided slices of the same order (rank r
reads positions r, r + W, ...), so one micro-batch of b rows on each rank covers the same
positions as one of b * W rows in one process.

An epoch's last incomplete batch is skipped (`drop_last`, as in PyTorch's DataLoader); each
epoch has its own permutation, so the rows skipped differ from epoch to epoch and no row is
left out of training for good.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mlm_pipeline.manifest import ShardManifest
from mlm_pipeline.shards.format import (masked_copies, open_masked_shard, open_shard,
                                        split_shards)


def _offsets(sizes: list[int]) -> np.ndarray:
    """offsets[i] = global index of the first row of shard i; offsets[-1] = total rows."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _gather(offsets: np.ndarray, seq_len: int, indices: Sequence[int] | np.ndarray,
            *columns: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
    """Rows at global `indices` of each column (one array per shard), int64 (n, seq_len).

    Raises:
        IndexError: when an index is outside [0, offsets[-1]).
    """
    idx, total = np.asarray(indices, dtype=np.int64), int(offsets[-1])
    if idx.size and (idx.min() < 0 or idx.max() >= total):
        raise IndexError(f"row index out of range [0, {total})")
    outs = [np.empty((idx.size, seq_len), dtype=np.int64) for _ in columns]
    shard_of = np.searchsorted(offsets, idx, side="right") - 1
    for s in np.unique(shard_of):
        sel = shard_of == s
        local = idx[sel] - offsets[s]
        for out, shards in zip(outs, columns):
            out[sel] = shards[s][local]
    return tuple(torch.from_numpy(out) for out in outs)


class ShardDataset:
    """The unmasked rows of one split, memory-mapped from its Arrow IPC shards (masked
    copies of a precomputed training split are left out: see `PrecomputedShardDataset`).

    Args:
        manifest: the shard manifest.
        split: `train` or `validation`.

    Raises:
        ValueError: when `split` is unknown or has no rows.
    """

    def __init__(self, manifest: ShardManifest, split: str) -> None:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        info = getattr(manifest, split)
        if info.rows == 0:
            raise ValueError(f"{manifest.output_dir}: the {split} split has no rows")
        self.split = split
        self.seq_len = manifest.seq_len
        self.arrays: list[np.ndarray] = [open_shard(manifest.file(entry.path))
                                         for entry in split_shards(manifest, split)]
        #: offsets[i] = global index of the first row of shard i; offsets[-1] = total rows.
        self.offsets = _offsets([a.shape[0] for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Rows at global `indices`.

        Returns:
            int64 tensor (len(indices), seq_len).

        Raises:
            IndexError: when an index is outside [0, len).
        """
        return _gather(self.offsets, self.seq_len, indices, self.arrays)[0]

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """Occurrences of each id over the whole split, as int64 (vocab_size,), streaming
        shard by shard."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for a in self.arrays:
            for start in range(0, a.shape[0], 65536):
                block = np.asarray(a[start : start + 65536]).ravel()
                counts += np.bincount(block, minlength=vocab_size)[:vocab_size]
        return counts


class PrecomputedShardDataset:
    """The precomputed masked copies of the training split, memory-mapped.

    Row `i` of copy `c` is `mask_tokens(row i, seed, epoch=c, row_index=i)` (written by
    `write_shards` with precomputed masking); epoch `e` reads copy `e % dupe_factor`, so
    training cycles through the copies (BERT's `dupe_factor`, Devlin et al. 2019).

    Args:
        manifest: a shard manifest written with `masking.mode="precomputed"`.

    Raises:
        ValueError: the manifest lists no masked copies, or a copy's row count differs from
            the training split's.
    """

    def __init__(self, manifest: ShardManifest) -> None:
        self.dupe_factor = masked_copies(manifest)
        if self.dupe_factor == 0:
            raise ValueError(
                f"{manifest.output_dir}: the shards hold no precomputed masked copies; write "
                "them with masking.mode=precomputed or train with masking.mode=dynamic")
        self.seq_len = manifest.seq_len
        self.copies: list[list[tuple[np.ndarray, np.ndarray]]] = []
        for c in range(self.dupe_factor):
            entries = split_shards(manifest, "train", copy=c)
            self.copies.append([open_masked_shard(manifest.file(e.path)) for e in entries])
            rows = sum(ids.shape[0] for ids, _ in self.copies[-1])
            if rows != manifest.train.rows:
                raise ValueError(
                    f"{manifest.output_dir}: masked copy {c} holds {rows} rows, the training "
                    f"split {manifest.train.rows}")
        self.offsets = _offsets([ids.shape[0] for ids, _ in self.copies[0]])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, indices: Sequence[int] | np.ndarray,
            epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked rows at global `indices` for `epoch` (copy `epoch % dupe_factor`).

        Returns:
            `(input_ids, labels)`, int64 tensors (len(indices), seq_len); labels are -100
            where not predicted.

        Raises:
            IndexError: when an index is outside [0, len).
        """
        shards = self.copies[epoch % self.dupe_factor]
        return _gather(self.offsets, self.seq_len, indices, [s[0] for s in shards],
                       [s[1] for s in shards])


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled row order of one epoch: a permutation of [0, num_rows), int64, that
    depends only on (seed, epoch) (NumPy PCG64 seeded with both), never on earlier draws."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows).astype(np.int64)


class RowCursor:
    """Deterministic, resumable source of row indices for training batches.

    Args:
        num_rows: rows in the split.
        batch_size: rows per batch returned by `next_batch` (per rank).
        seed: shuffling seed.
        rank: this process's rank in data-parallel training.
        world_size: number of ranks; rank r takes positions r, r + world_size, ... of each
            epoch's order. Every rank has `(num_rows // world_size) // batch_size` batches
            an epoch, so ranks change epoch together.

    The state (`epoch`, `offset`) is the same on every rank, so rank 0's checkpoint resumes
    every rank, with the world size it was written with.

    Raises:
        ValueError: when one rank's share of an epoch is smaller than one batch.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        # The same count on every rank (rank 0 may hold one row more): the ranks must
        # agree on where an epoch ends.
        self.per_rank = num_rows // world_size
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the training split has {num_rows} rows: fewer than one batch of "
                f"{batch_size} rows per rank (world_size {world_size}); lower "
                "train.micro_batch_size or add data")
        self.epoch, self.offset = 0, 0  # offset: batches already taken in this epoch
        self._order: np.ndarray | None = None

    def _epoch_rows(self) -> np.ndarray:
        if self._order is None:
            order = epoch_order(self.num_rows, self.seed, self.epoch)
            self._order = order[self.rank :: self.world_size]
        return self._order

    def next_batch(self) -> tuple[np.ndarray, int]:
        """The next batch's global row indices (int64, (batch_size,)) and its epoch."""
        if self.offset >= self.batches_per_epoch:
            self.epoch += 1
            self.offset = 0
            self._order = None
        start = self.offset * self.batch_size
        rows = self._epoch_rows()[start : start + self.batch_size]
        self.offset += 1
        return rows, self.epoch

    def state_dict(self) -> dict[str, Any]:
        """Position and identity of the order: everything needed to resume exactly."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_rows": self.num_rows, "batch_size": self.batch_size,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict` (by any rank: the same on every rank).

        Raises:
            ValueError: when the saved order was for other data, seed or batch size, or for
                another number of ranks (both world sizes named).
        """
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ValueError(
                f"cannot resume: the checkpoint was written by a run of world size "
                f"{saved_world} (train.distributed nproc_per_node x nnodes) and this run has "
                f"world size {self.world_size}; resume with {saved_world} ranks (each rank "
                "reads its own strided slice of the row order, so the position does not "
                "carry over to another number of ranks)")
        for key in ("seed", "num_rows", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume data position: saved {key}={state[key]} but this run "
                    f"has {key}={getattr(self, key)}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = None
