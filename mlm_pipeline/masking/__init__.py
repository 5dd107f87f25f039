"""Stage 3, masking (torch): the pure keyed masking function (`keyed`: `mask_tokens`),
`KeyedMasking`, the one object every mask is made with (training, precomputed copies,
evaluation), and the stateful maskers the training loop calls (`maskers`: dynamic or
precomputed, built by `build_masker`); `keyed_numpy` runs `mask_tokens` on CPU tensors in
numpy (the same bits), and `vocab` turns a tokenizer's special ids into masking's tables.

Masking sits below the shards stage, which writes precomputed masked copies with it; it
imports only the ground floor.
"""

from mlm_pipeline.masking.keyed import MASKING_ALGORITHM, mask_tokens
from mlm_pipeline.masking.maskers import (
    DynamicMasker,
    KeyedMasking,
    MaskedCopies,
    Masker,
    PrecomputedMasker,
    build_masker,
    keyed_masking,
)

__all__ = ["MASKING_ALGORITHM", "DynamicMasker", "KeyedMasking", "MaskedCopies", "Masker",
           "PrecomputedMasker", "build_masker", "keyed_masking", "mask_tokens"]
