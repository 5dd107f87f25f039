"""What masking needs to know of a vocabulary: which ids are special, which are ordinary.

`masking_vocab(vocab_size, special_ids)` turns a tokenizer's `SpecialIds` into the lookup
tables `mask_tokens` uses: a bool table of the special ids (never selected) and the
ascending ordinary ids (the random replacements). When the special ids are exactly
`[0, n)` (the SentencePiece tokenizers this pipeline trains) the tables reduce to `id < n`
and an offset `n +`, what the keyed masking of those tokenizers has always computed: their
masks do not change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mlm_pipeline.config import SENTENCEPIECE_SPECIAL_IDS, SpecialIds


@dataclass(frozen=True, eq=False)
class MaskingVocab:
    """The special and ordinary ids of a vocabulary of `vocab_size` ids.

    Attributes:
        vocab_size: ids in the vocabulary, the special tokens included.
        special_ids: the tokenizer's special ids.
        mask_id: the id a selected token is replaced by (`special_ids.mask_id`).
        prefix: n when the special ids are exactly `0 .. n-1`, else None.
        special: bool numpy (vocab_size,), True at the special ids.
        normal: int64 numpy (m,), the ordinary ids in ascending order
            (m = vocab_size - number of special ids).
    """

    vocab_size: int
    special_ids: SpecialIds
    mask_id: int
    prefix: int | None
    special: np.ndarray
    normal: np.ndarray
    _on: dict = field(default_factory=dict, repr=False)

    @property
    def num_normal(self) -> int:
        """m: ordinary ids, the random replacements' range."""
        return len(self.normal)

    def tables_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """`(special, normal)` as tensors on `device` (bool (V,), int64 (m,)), copied once
        per device."""
        if device not in self._on:
            with torch.inference_mode(False):  # usable in every mode
                self._on[device] = (torch.tensor(self.special, device=device),
                                    torch.tensor(self.normal, device=device))
        return self._on[device]


@functools.lru_cache(maxsize=32)
def masking_vocab(vocab_size: int, special_ids: SpecialIds | None = None) -> MaskingVocab:
    """The `MaskingVocab` of a vocabulary (cached per `(vocab_size, special_ids)`).

    Args:
        vocab_size: ids in the vocabulary, the special tokens included.
        special_ids: the tokenizer's special ids; None: `SENTENCEPIECE_SPECIAL_IDS`
            (ids 0-4, the SentencePiece tokenizers this pipeline trains).

    Raises:
        ValueError: a special id is not below `vocab_size`, or no ordinary id is left.
    """
    special_ids = special_ids or SENTENCEPIECE_SPECIAL_IDS
    ids = special_ids.all_special_ids
    if ids and ids[-1] >= vocab_size:
        raise ValueError(f"masking: special id {ids[-1]} is outside the vocabulary of "
                         f"{vocab_size} ids")
    if len(ids) >= vocab_size:
        raise ValueError(f"masking: vocab_size {vocab_size} must exceed the "
                         f"{len(ids)} special ids")
    special = np.zeros(vocab_size, dtype=bool)
    special[list(ids)] = True
    normal = np.flatnonzero(~special).astype(np.int64)
    for table in (special, normal):
        table.setflags(write=False)
    prefix = len(ids) if ids == tuple(range(len(ids))) else None
    return MaskingVocab(vocab_size, special_ids, special_ids.mask_id, prefix, special, normal)
