"""A trained SentencePiece tokenizer: loading it, checking it, encoding new text.

`SentencePieceTokenizer` (a `Tokenizer`, `tokenizer.base`) wraps a `.model` file that
`mlm_pipeline.tokenizer.stage.train_tokenizer` wrote, with the fixed special-token ids of
`config.SPECIAL_TOKENS` (`SENTENCEPIECE_SPECIAL_IDS`).

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import unicodedata
from pathlib import Path

import numpy as np
import sentencepiece as spm

from mlm_pipeline.config import (
    MASK_ID, NUM_SPECIAL, SENTENCEPIECE_SPECIAL_IDS, SPECIAL_TOKENS, UNK_ID)
from mlm_pipeline.manifest import TokenizerManifest, read_manifest
from mlm_pipeline.tokenizer.base import BatchEncoder, EncoderSpec, Tokenizer

__all__ = ["MASK_MARKER", "SentencePieceTokenizer", "Tokenizer", "check_special",
           "sentencepiece_batch_encoder"]

logger = logging.getLogger(__name__)

#: The literal marker that `Tokenizer.encode_with_mask` replaces by the [MASK] id.
MASK_MARKER = "[MASK]"
#: Any special name written in a text ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), as a
#: capturing group (`re.split` keeps the names).
_SPECIAL_NAME = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
#: `ModelProto.SentencePiece.Type.USER_DEFINED` (sentencepiece_model.proto).
_USER_DEFINED = 4
_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def check_special(sp: spm.SentencePieceProcessor, path: Path, error: type[Exception]) -> None:
    """Check the fixed special-token ids of a loaded model.

    Raises:
        error: a special token has another id, or [MASK] is not a control symbol (the
            file is named).
    """
    wrong = [f"{piece} has id {sp.piece_to_id(piece)}" for piece, want in SPECIAL_TOKENS.items()
             if sp.piece_to_id(piece) != want or sp.id_to_piece(want) != piece]
    if not sp.is_control(MASK_ID):
        wrong.append(f"{MASK_MARKER} is not a control symbol")
    if wrong:
        raise error(f"{path}: special tokens differ from {SPECIAL_TOKENS}: {'; '.join(wrong)}")


class SentencePieceTokenizer(Tokenizer, kind="sentencepiece"):
    """A trained SentencePiece model with the pipeline's fixed special-token ids.

    Text given to `encode` and `encode_with_mask` is first brought to the Unicode
    normalization form of the corpus the model was trained on (`normalization`), as
    ingestion did to every training document: "cafe\u0301" and "caf\u00e9" encode alike.

    Attributes:
        path: the `.model` file it was loaded from.
        model_sha256: hex sha256 of that file's bytes (equals the manifest's `model.sha256`).
        normalization: `NFC`, `NFKC`, or None (text is encoded as given).
        special_ids: the fixed special ids 0-4 (`SENTENCEPIECE_SPECIAL_IDS`).
    """

    special_ids = SENTENCEPIECE_SPECIAL_IDS

    @staticmethod
    def encoder_of(model: bytes) -> BatchEncoder:
        """`sentencepiece_batch_encoder(model)`."""
        return sentencepiece_batch_encoder(model)

    def __init__(self, path: str | os.PathLike[str], normalization: str | None = None) -> None:
        """Load a `.model` file (prefer `Tokenizer.load`, which finds `normalization`).

        Raises:
            ValueError: the file is not a SentencePiece model, the model does not have the
                fixed special-token ids, or `normalization` is not NFC, NFD, NFKC or NFKD.
        """
        if normalization not in (None, *_FORMS):
            raise ValueError(f"tokenizer: unknown normalization form {normalization!r}")
        self.path = Path(path)
        self.normalization = normalization
        self._proto = proto = self.path.read_bytes()
        self.model_sha256 = hashlib.sha256(proto).hexdigest()
        try:
            if not proto:
                raise RuntimeError("empty file")
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, IndexError) as exc:  # IndexError: some truncated protos
            raise ValueError(f"{self.path}: not a SentencePiece model ({exc})") from exc
        self._word_starts: np.ndarray | None = None
        self._decoder: spm.SentencePieceProcessor | None = None
        check_special(self._sp, self.path, ValueError)

    @classmethod
    def load_file(cls, p: Path) -> SentencePieceTokenizer:
        """Load a `.model` file on its own: it takes the normalization of a tokenizer
        manifest beside it that describes the same bytes (sha256); without one, text is
        encoded as given, with a warning.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the file is not a SentencePiece model, or it lacks the fixed
                special ids.
        """
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {p}")
        tok = cls(p)
        try:
            m = read_manifest(p.with_name("manifest.json"), TokenizerManifest)
        except (OSError, ValueError):  # no stage manifest here: a model file on its own
            m = None
        if m is not None and m.model.sha256 == tok.model_sha256:
            tok.normalization = m.normalization
        else:
            logger.warning("%s: no tokenizer manifest.json beside it describes this model, "
                           "so its corpus's Unicode normalization is unknown: text is "
                           "encoded without normalization", p)
        return tok

    @classmethod
    def from_manifest(cls, m: TokenizerManifest) -> SentencePieceTokenizer:
        """The model `m` lists, in `m`'s directory, checked against its sha256, with the
        manifest's normalization (`Tokenizer.load`'s errors)."""
        path = m.file(m.model.path)
        tok = cls(path, m.normalization)
        if tok.model_sha256 != m.model.sha256:
            raise ValueError(
                f"{path}: sha256 {tok.model_sha256} differs from {m.model.sha256} in its "
                f"tokenizer manifest {m.path}: the model file was changed; delete "
                f"{path.parent} and rerun to train it again")
        return tok

    def encoder_spec(self) -> EncoderSpec:
        """`("sentencepiece", the .model file's bytes)`."""
        return "sentencepiece", self._proto

    @property
    def vocab_size(self) -> int:
        """Pieces in the vocabulary, special tokens included."""
        return self._sp.get_piece_size()

    def word_starts(self) -> np.ndarray:
        """Which ids begin a word, for whole-word masking.

        Whole-word masking (Devlin et al. 2019, BERT repository README, "Whole Word
        Masking" update; Cui et al. 2021 for Chinese) selects words, then masks all their
        pieces. A word is an id flagged True followed by every following id flagged False.
        An id is True when its piece starts with SentencePiece's word-boundary marker
        "\u2581" (U+2581) or is one of the special ids 0-4 ([PAD], [UNK], [CLS], [SEP],
        [MASK]: each is a word on its own); continuation pieces, byte-fallback pieces
        `<0x..>` included, are False (the bytes of an unknown character continue the word
        their "\u2581" or previous piece started).

        Returns:
            Bool array of shape `(vocab_size,)`, indexed by id (a fresh copy).
        """
        if self._word_starts is None:
            pieces = (self._sp.id_to_piece(i) for i in range(self.vocab_size))
            starts = np.fromiter((p.startswith("\u2581") for p in pieces), dtype=bool,
                                 count=self.vocab_size)
            starts[:NUM_SPECIAL] = True
            self._word_starts = starts
        return self._word_starts.copy()

    def encode(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Encode a batch of texts to piece ids (no [CLS] / [SEP] added).

        A literal "[MASK]" in a text is ordinary text: id 4 never comes out of `encode`.

        Args:
            texts: documents or sentences (normalized first, see the class docstring).
            num_threads: SentencePiece encoder threads; 0 or less uses SentencePiece's
                default (-1: one per hardware thread).

        Returns:
            One list of ids in `[0, vocab_size)` per text, in order.
        """
        return self._sp.encode([self._normalize(t) for t in texts], out_type=int,
                               num_threads=num_threads if num_threads > 0 else -1)

    def _normalize(self, text: str) -> str:
        return unicodedata.normalize(self.normalization, text) if self.normalization else text

    def encode_with_mask(self, text: str) -> list[int]:
        """Encode a fill-mask probe: each literal special name becomes its id, "[MASK]" the
        [MASK] id (4), and "[PAD]", "[UNK]", "[CLS]", "[SEP]" theirs (0-3).

        The names are matched as `transformers` matches special tokens (the exported
        tokenizer's default call gives the same ids): in the text as given, before
        normalization (NFKC must not make a name of the fullwidth "［ＭＡＳＫ］"). The text
        is split at the names and each part encoded on its own, so each part gets
        SentencePiece's word-start marker: "l'[MASK]s" reads as "l'", [MASK], " s".
        Training documents are encoded by `encode`, where a name is ordinary text.

        Returns:
            Piece ids with the special ids at the names (no [CLS] / [SEP] added).
        """
        ids: list[int] = []
        for i, part in enumerate(_SPECIAL_NAME.split(text)):
            if i % 2:  # the captured names sit at odd positions
                ids.append(SPECIAL_TOKENS[part])
            elif part:
                ids.extend(self._sp.encode(self._normalize(part), out_type=int))
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Decode ids (any iterable of ints, e.g. a numpy row) to text, as the exported
        tokenizer's `decode` does with the same `skip_special_tokens`.

        Every special id is written as its name ("[CLS]", "[UNK]", ...), or, with
        `skip_special_tokens`, left out; [UNK] too, as in `transformers` (SentencePiece
        itself writes " \u2047 " for [UNK] and drops the others). Other pieces decode as
        SentencePiece decodes them ("\u2581" as a space, none before the first
        character; byte pieces as UTF-8).

        Returns:
            The text.
        """
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i >= NUM_SPECIAL])
        return self._special_decoder().decode(ids)

    def _special_decoder(self) -> spm.SentencePieceProcessor:
        """A decode-only copy of the model that writes the special pieces' names: control
        pieces made user-defined (written as their text) and [UNK]'s surface its name.
        Never used to encode (user-defined names would then match in text)."""
        if self._decoder is None:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(self.path.read_bytes())
            for i in SPECIAL_TOKENS.values():
                if i != UNK_ID:
                    proto.pieces[i].type = _USER_DEFINED
            proto.trainer_spec.unk_surface = proto.pieces[UNK_ID].piece
            self._decoder = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        return self._decoder

    def id_to_piece(self, i: int) -> str:
        """The piece string of id `i` (e.g. "▁chat", "[SEP]")."""
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`; `unk_id` when it is not in the vocabulary."""
        return self._sp.piece_to_id(piece)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def sentencepiece_batch_encoder(model: bytes) -> BatchEncoder:
    """The `BatchEncoder` of a `.model` file's bytes: texts go to SentencePiece as UTF-8
    bytes (the ids are those of the str) and come back as int32 arrays
    (`out_type="numpy"`), one single-threaded call (it releases the GIL).

    Raises:
        ValueError: the bytes are not a SentencePiece model.
    """
    try:
        sp = spm.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, IndexError) as exc:
        raise ValueError(f"not a SentencePiece model ({exc})") from exc

    def encode(texts):
        return sp.encode(list(texts), out_type="numpy", num_threads=1) if texts else []

    return encode

