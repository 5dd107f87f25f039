"""Precomputed masking's copies of the training shards (written by the shards stage).

Copy `c` of the training split is what `mask_tokens` gives in epoch `c`, keyed by
(seed, c, global row): `mlm_pipeline.masking.PrecomputedMasker` reads them back in training.
Torch is needed only here, so the shards stage imports this module only when
`masking.mode` is `precomputed`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mlm_pipeline.config import MaskingConfig
from mlm_pipeline.manifest import FileEntry
from mlm_pipeline.masking.maskers import keyed_masking
from mlm_pipeline.shards.format import open_shard, write_arrow

if TYPE_CHECKING:
    from mlm_pipeline.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
#: Rows masked per `mask_tokens` call: bounds the (3, rows, seq_len) int64 hash buffer.
_MASK_CHUNK_ROWS = 4096


def write_masked_copies(shards: list[FileEntry], out_dir: Path, masking: MaskingConfig,
                        tok: Tokenizer, seq_len: int) -> list[FileEntry]:
    """Write the `dupe_factor` masked copies of the training shards (precomputed masking;
    layout and naming in the `mlm_pipeline.shards.stage` docstring).

    Copy `c` of shard `i` is `train-copy{c}-{i:05d}.arrow`: `input_ids`
    (fixed_size_list<uint16|uint32>[seq_len], the shards' dtype) and `labels`
    (fixed_size_list<int32>[seq_len], `IGNORE_INDEX` where not predicted), made by
    `KeyedMasking(masking, ...)` keyed by (`masking.seed`, epoch=c, row_index = global
    training row), so copy `c` equals what dynamic masking gives in epoch `c`.

    Args:
        shards: entries of the unmasked training shards, in row order.
        out_dir: the shards stage directory (entries' paths are relative to it).
        masking: `dupe_factor`, `mlm_probability`, replacement shares, `selection`,
            `whole_word` (word boundaries from `Tokenizer.word_starts` and `word_ends`), `seed`.
        tok: the tokenizer (vocabulary size, special ids, word boundaries).
        seq_len: tokens per row.

    Returns:
        The copies' entries, copy-major, then shard order.

    Raises:
        OSError: a copy cannot be written (its temporary file is removed).
    """
    keyed = keyed_masking(masking, tok)
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
                ids, labels = keyed(chunk, row_index, c)
                ids_out[start : start + len(chunk)] = ids.numpy()
                labels_out[start : start + len(chunk)] = labels.numpy()
            path = out_dir / f"train-copy{c}-{i:05d}.arrow"
            columns = {"input_ids": ids_out, "labels": labels_out}
            entries.append(write_arrow(out_dir, path, columns, seq_len))
            first_row += len(rows)
        logger.info("shards: masked copy %d of %d written (%d rows)", c + 1,
                    masking.dupe_factor, first_row)
    return entries
