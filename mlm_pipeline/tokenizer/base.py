"""What every tokenizer of the pipeline offers the later stages: `Tokenizer`.

Two kinds exist: the SentencePiece tokenizers this pipeline trains
(`tokenizer.SentencePieceTokenizer`, special ids 0-4) and a Hugging Face `tokenizer.json`
adopted with the model a run continues (`pretrained.PretrainedTokenizer`: WordPiece, BPE,
byte-level BPE or Unigram, with the ids its vocabulary gives them). Packing, masking,
whole-word masking, evaluation and export take the special ids (`special_ids`) and the
word boundaries (`word_starts`, `word_ends`) from the tokenizer, never from constants.
`Tokenizer.load` opens either from its stage manifest.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mlm_pipeline.config import SpecialIds
from mlm_pipeline.manifest import TokenizerManifest, read_manifest

#: `encoder(texts)` -> one int32 id array per text (UTF-8 bytes in), no [CLS]/[SEP]
#: added, special-token names in the texts encoded as plain text.
BatchEncoder = Callable[[Sequence[bytes]], list[np.ndarray]]
#: `(kind, model file bytes)`: what a worker process needs to build a `BatchEncoder`
#: (`batch_encoder_from_spec`), cheap to send.
EncoderSpec = tuple[str, bytes]


KINDS: dict[str, type[Tokenizer]] = {}
"""The tokenizer class of each manifest `kind`, filled by the subclasses' `kind=` class
argument (the package imports them all, so each is registered before any load)."""


class Tokenizer(ABC):
    """A tokenizer of this pipeline: encoding, decoding, special ids, word boundaries.

    Attributes:
        path: the model file (`spm.model`, or an adopted `tokenizer.json`).
        model_sha256: hex sha256 of that file (the manifest's `model.sha256`).
        normalization: the Unicode form `encode` applies first (`NFC`, `NFKC`), or None.
        special_ids: the five roles' ids and every id masking never selects or draws.
    """

    path: Path
    model_sha256: str
    normalization: str | None
    special_ids: SpecialIds

    def __init_subclass__(cls, kind: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            KINDS[kind] = cls

    @staticmethod
    @abstractmethod
    def encoder_of(model: bytes) -> BatchEncoder:
        """The `BatchEncoder` of a model file's bytes of this kind."""

    @property
    def pad_id(self) -> int:
        """Id of [PAD]."""
        return self.special_ids.pad_id

    @property
    def unk_id(self) -> int | None:
        """Id of [UNK] (None when the vocabulary has none)."""
        return self.special_ids.unk_id

    @property
    def cls_id(self) -> int:
        """Id of [CLS]."""
        return self.special_ids.cls_id

    @property
    def sep_id(self) -> int:
        """Id of [SEP]."""
        return self.special_ids.sep_id

    @property
    def mask_id(self) -> int:
        """Id of [MASK]."""
        return self.special_ids.mask_id

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids in the vocabulary, special and added tokens included."""

    @abstractmethod
    def word_starts(self) -> np.ndarray:
        """Bool (vocab_size,), True where an id begins a word (whole-word masking); every
        special id is True (a word of its own). A fresh copy.

        Raises:
            ValueError: the tokenizer does not mark words (whole-word masking impossible).
        """

    def word_ends(self) -> np.ndarray | None:
        """Bool (vocab_size,), True where a word ends with an id, so that the next piece
        begins one (byte-level BPE pieces ending in whitespace); None when only the
        starts mark words."""
        return None

    @abstractmethod
    def encode(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Piece ids of each text (no [CLS] / [SEP] added); a special token's name in a
        text is plain text, as in the training documents."""

    @abstractmethod
    def encode_with_mask(self, text: str) -> list[int]:
        """Piece ids of a fill-mask probe: each literal "[MASK]" is the mask id, the
        tokenizer's other special names their ids (no [CLS] / [SEP] added)."""

    @abstractmethod
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (any iterable of ints), special ids as their names or left out."""

    @abstractmethod
    def id_to_piece(self, i: int) -> str:
        """The piece string of id `i`."""

    @abstractmethod
    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`; `unk_id` when it is not in the vocabulary (-1 without one)."""

    @abstractmethod
    def encoder_spec(self) -> EncoderSpec:
        """`(kind, model bytes)` from which `batch_encoder_from_spec` builds the encoder
        of training documents (in this process or a worker)."""

    def batch_encoder(self) -> BatchEncoder:
        """The encoder of training documents (`BatchEncoder`): thread-safe, releases the
        GIL while it encodes."""
        return batch_encoder_from_spec(self.encoder_spec())

    @classmethod
    def load(cls, source: str | os.PathLike[str] | TokenizerManifest) -> Tokenizer:
        """Load from a `TokenizerManifest`, a stage directory or its `manifest.json`, or a
        model file (`.model`, or an adopted stage's `tokenizer.json`).

        With a manifest (given, or read from the directory), the model is the file it
        lists in that directory (so a copied or moved stage directory loads its own copy)
        and its sha256 must equal the manifest's; the manifest's `kind` picks the class.

        Returns:
            A `SentencePieceTokenizer` or a `PretrainedTokenizer`.

        Raises:
            FileNotFoundError: the path does not exist.
            ValueError: the manifest is invalid or lists a model path outside its
                directory (`ManifestPathError`), a file differs from its manifest
                (sha256), or the model is not a tokenizer of its kind (the file named).
        """
        if isinstance(source, TokenizerManifest):
            manifest = source
        else:
            p = Path(source)
            if not (p.is_dir() or p.suffix == ".json"):  # a `.model` file
                return KINDS["sentencepiece"].load_file(p)
            # a directory, its manifest.json, or an adopted stage's tokenizer.json
            path = p / "manifest.json" if p.is_dir() else p.with_name("manifest.json")
            manifest = read_manifest(path, TokenizerManifest)  # this directory
            manifest = manifest.model_copy(update={"output_dir": str(path.parent.resolve())})
        return KINDS[manifest.kind].from_manifest(manifest)


@functools.lru_cache(maxsize=4)
def batch_encoder_from_spec(spec: EncoderSpec) -> BatchEncoder:
    """The `BatchEncoder` of an `EncoderSpec` (cached: a worker builds each once).

    Raises:
        ValueError: an unknown kind, or bytes that are not a model of the kind.
    """
    kind, model = spec
    if kind not in KINDS:
        raise ValueError(f"tokenizer: unknown encoder kind {kind!r}")
    return KINDS[kind].encoder_of(model)
