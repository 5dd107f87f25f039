"""The base of every config model, the special-token ids of a tokenizer (`SpecialIds`) and
the fixed ids of the SentencePiece tokenizers this pipeline trains."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Fixed ids of the special tokens of a SentencePiece tokenizer trained by this pipeline
#: (`tokenizer.stage.train_tokenizer` trains with them). Every other stage reads the ids
#: from its tokenizer (`SpecialIds`), since an adopted tokenizer has others.
SPECIAL_TOKENS: dict[str, int] = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
#: In our SentencePiece tokenizers, the first id of an ordinary (non-special) piece: ids
#: `[0, NUM_SPECIAL)` are special.
NUM_SPECIAL = len(SPECIAL_TOKENS)
#: Label of a position that is not predicted (PyTorch `cross_entropy`'s default
#: `ignore_index`, and Hugging Face's): the one definition for masking, model and metrics.
IGNORE_INDEX = -100


class StrictModel(BaseModel):
    """Base of every config: frozen, unknown keys rejected, attribute docstrings kept."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class SpecialIds(StrictModel):
    """The special-token ids of one tokenizer, as every stage after the tokenizer uses them.

    The five roles are what packing, masking and evaluation write ([CLS] first in a row,
    [SEP] after each document, [MASK] for a selected token, [PAD] for padding, [UNK] for
    answers out of the vocabulary); `all_special_ids` are the ids that masking never
    selects and never draws as a random replacement, and that fill-mask never proposes:
    the roles and every other special token of the tokenizer (a ModernBERT vocabulary's
    `<|endoftext|>` and `<|padding|>`, for instance), as Hugging Face's
    `PreTrainedTokenizer.all_special_ids` counts them.

    A SentencePiece tokenizer trained by this pipeline has `SENTENCEPIECE_SPECIAL_IDS`
    (0-4); a BERT WordPiece vocabulary [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103.

    Raises:
        ValueError: (pydantic's `ValidationError`) a role's id is not in `all_special_ids`,
            `all_special_ids` is not sorted and distinct, or an id is negative.
    """

    pad_id: int = Field(ge=0)
    """Id of [PAD]: padding of rows shorter than the batch (evaluation, fine-tuning)."""
    unk_id: int | None = Field(default=None, ge=0)
    """Id of [UNK]; None for a tokenizer that has none (byte-level BPE needs none)."""
    cls_id: int = Field(ge=0)
    """Id of [CLS]: the first token of every row."""
    sep_id: int = Field(ge=0)
    """Id of [SEP]: written after every document of the packed stream."""
    mask_id: int = Field(ge=0)
    """Id of [MASK]: the replacement of a selected token."""
    all_special_ids: tuple[int, ...]
    """Every special id, sorted: never selected, never a random replacement."""

    @model_validator(mode="after")
    def _check(self) -> SpecialIds:
        problems = []
        ids = self.all_special_ids
        if list(ids) != sorted(set(ids)):
            problems.append(f"all_special_ids {list(ids)} must be sorted and distinct")
        if ids and ids[0] < 0:
            problems.append(f"all_special_ids has a negative id {ids[0]}")
        for role in ("pad_id", "unk_id", "cls_id", "sep_id", "mask_id"):
            value = getattr(self, role)
            if value is not None and value not in ids:
                problems.append(f"{role} {value} is not in all_special_ids")
        if problems:
            raise ValueError("special ids: " + "; ".join(problems))
        return self

    def roles(self) -> dict[str, int]:
        """`{"[PAD]": pad_id, "[UNK]": unk_id, "[CLS]": ..., "[SEP]": ..., "[MASK]": ...}`,
        [UNK] left out when there is none (the role names, whatever the tokens' texts)."""
        pairs = (("[PAD]", self.pad_id), ("[UNK]", self.unk_id), ("[CLS]", self.cls_id),
                 ("[SEP]", self.sep_id), ("[MASK]", self.mask_id))
        return {name: i for name, i in pairs if i is not None}


#: The special ids of every SentencePiece tokenizer this pipeline trains (and of every
#: tokenizer and shard manifest written before other tokenizers were adopted).
SENTENCEPIECE_SPECIAL_IDS = SpecialIds(pad_id=PAD_ID, unk_id=UNK_ID, cls_id=CLS_ID,
                                       sep_id=SEP_ID, mask_id=MASK_ID,
                                       all_special_ids=tuple(range(NUM_SPECIAL)))
