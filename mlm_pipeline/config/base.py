"""The base of every config model and the fixed ids every stage shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: Fixed ids of the special tokens, shared by the tokenizer, shards, masking and model.
SPECIAL_TOKENS: dict[str, int] = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
#: First id of an ordinary (non-special) piece; ids `[0, NUM_SPECIAL)` are special.
NUM_SPECIAL = len(SPECIAL_TOKENS)
#: Label of a position that is not predicted (PyTorch `cross_entropy`'s default
#: `ignore_index`, and Hugging Face's): the one definition for masking, model and metrics.
IGNORE_INDEX = -100


class StrictModel(BaseModel):
    """Base of every config: frozen, unknown keys rejected, attribute docstrings kept."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
