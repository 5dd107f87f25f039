"""A Hugging Face tokenizer adopted with the model a run continues: `PretrainedTokenizer`
and the stage function `adopt_pretrained_tokenizer`.

Continuing the pretraining of a published encoder (a BERT, a ModernBERT) needs its own
tokenizer: same pieces, same ids. `adopt_pretrained_tokenizer(source, work_dir)` reads a
`save_pretrained` directory's `tokenizer.json` through the `tokenizers` library (any of
WordPiece, BPE, byte-level BPE, Unigram), copies it with the files `transformers` saves
beside it into a stage directory named by the files' content (their sha256 are the
stage's inputs: the same files adopted from anywhere are the same tokenizer), and
records in the manifest what every later stage needs from it:

- the special ids (`SpecialIds`): the five roles from `tokenizer_config.json` /
  `special_tokens_map.json` (`pad_token`, `unk_token`, `cls_token`, `sep_token`,
  `mask_token`; [CLS] and [SEP] fall back on `bos_token` and `eos_token`), and every
  token the tokenizer flags special (its added tokens with `special: true` and the
  `additional_special_tokens`), which masking never selects nor draws. A BERT vocabulary
  gives [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103; ModernBERT's byte-level BPE
  its added tokens [UNK] 50280, [CLS] 50281, [SEP] 50282, [PAD] 50283, [MASK] 50284
  (and `<|endoftext|>`, `<|padding|>`);
- how the tokenizer marks words, for whole-word masking (`word_boundary`): WordPiece's
  continuation prefix ("##": a piece without it begins a word), a Metaspace
  pre-tokenizer's prefix ("\u2581"), byte-level BPE's encoded whitespace (a piece whose
  first byte is whitespace, "\u0120" for a space, begins a word; one whose last byte is
  whitespace, such as the newline "\u010a", ends one), or a BPE end-of-word suffix. These
  are the word boundaries of fairseq's whole-word masking (`fairseq/data/encoders/
  gpt2_bpe.py`, `sentencepiece_bpe.py`: `is_beginning_of_word`) and of the BERT
  repository's ("##"). Added tokens are words of their own.

Training documents are encoded with special-token names as plain text
(`encode_special_tokens`), as the SentencePiece tokenizers of this pipeline encode them:
a document that writes "[SEP]" must not inject a boundary or a mask. Fill-mask probes
(`encode_with_mask`) match them, as `transformers.pipeline("fill-mask")` does with the
same tokenizer. Text is encoded as given: the tokenizer's own normalizer applies.

This module imports neither torch nor prefect (`tokenizers` is imported inside the
functions; `transformers` is never imported: it would import torch).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mlm_pipeline.config import SpecialIds
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.locks import reuse_or_build
from mlm_pipeline.manifest import (
    Stopwatch, TokenizerManifest, compute_digest, file_entry, load_if_complete, sha256_file,
    stage_dir, write_manifest)
from mlm_pipeline.tokenizer.base import BatchEncoder, EncoderSpec, Tokenizer

logger = logging.getLogger(__name__)

STAGE = "tokenizer"
#: The model file every adopted tokenizer has.
TOKENIZER_JSON = "tokenizer.json"
#: The other tokenizer files `transformers`' `save_pretrained` writes (whichever exist
#: are read, hashed and copied; the model's weights and config are not tokenizer files).
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja")
#: Version of the adoption (what is read and recorded), part of the digest.
_ADOPTION = "tokenizer.json/roles-v1"
_ROLES = ("pad", "unk", "cls", "sep", "mask")
#: The five roles that packing, masking and evaluation need (an [UNK] is optional).
_REQUIRED = ("pad", "cls", "sep", "mask")
_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")


def _tokenizers():
    from mlm_pipeline.tokenizer.hf_files import require

    return require("tokenizers")


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte map: the inverse of GPT-2's `bytes_to_unicode`
    (openai/gpt-2 `src/encoder.py`, as `tokenizers.pre_tokenizers.ByteLevel` uses it):
    printable bytes map to themselves, the others to U+0100 onwards in byte order (the
    space 0x20 to "\u0120", the newline 0x0A to "\u010a")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def _flat_pre_tokenizers(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get("pretokenizers", []) for p in _flat_pre_tokenizers(child)]
    return [node]


def word_boundary(spec: dict[str, Any]) -> str:
    """How a `tokenizer.json` (parsed) marks words: `continuation:<prefix>` (WordPiece),
    `byte_level`, `prefix:<marker>` (Metaspace), `suffix:<marker>` (BPE
    `end_of_word_suffix`), `continuation:<prefix>` (BPE `continuing_subword_prefix`), or
    `none` (the module docstring)."""
    model = spec.get("model") or {}
    kind = model.get("type")
    steps = [*_flat_pre_tokenizers(spec.get("pre_tokenizer")), spec.get("decoder") or {}]
    if kind == "WordPiece":
        return f"continuation:{model.get('continuing_subword_prefix') or '##'}"
    if any(p.get("type") == "ByteLevel" for p in steps):
        return "byte_level"
    for p in steps:  # a Metaspace pre-tokenizer's marker first, else the decoder's
        if p.get("type") == "Metaspace":
            return f"prefix:{p.get('replacement') or chr(0x2581)}"
    if kind == "BPE" and model.get("end_of_word_suffix"):
        return f"suffix:{model['end_of_word_suffix']}"
    if kind == "BPE" and model.get("continuing_subword_prefix"):
        return f"continuation:{model['continuing_subword_prefix']}"
    return "none"


def _token_text(value: Any) -> str | None:
    """A special token's text in `tokenizer_config.json` / `special_tokens_map.json`: a
    string, or an `AddedToken` dict's `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_special_ids(directory: Path, tok) -> tuple[SpecialIds, dict[str, int]]:
    """The special ids of the tokenizer in `directory` (`tok`: its `tokenizers.Tokenizer`).

    Returns:
        `(special_ids, special_tokens)`: the `SpecialIds`, and every special token's
        text -> id (in id order).

    Raises:
        ValueError: a role the pipeline needs ([PAD], [CLS], [SEP], [MASK]) is named in
            none of the files, or names a token the vocabulary lacks (the files and the
            role named).
    """
    names: dict[str, Any] = {}
    read = []
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = directory / name
        if path.is_file():
            names |= {k: v for k, v in _read_json(path).items() if v is not None}
            read.append(name)
    texts = {role: _token_text(names.get(f"{role}_token")) for role in _ROLES}
    texts["cls"] = texts["cls"] or _token_text(names.get("bos_token"))
    texts["sep"] = texts["sep"] or _token_text(names.get("eos_token"))
    files = " and ".join(read) or "no tokenizer_config.json or special_tokens_map.json"
    problems = [f"{role}_token is not named" for role in _REQUIRED if not texts[role]]
    ids: dict[str, int | None] = {}
    for role, text in texts.items():
        ids[role] = None if text is None else tok.token_to_id(text)
        if text is not None and ids[role] is None:
            problems.append(f"{role}_token {text!r} is not in its vocabulary")
    if problems:
        raise ValueError(f"{directory}: the tokenizer ({files}) cannot be adopted: "
                         + "; ".join(problems))
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    extra = [_token_text(v) for v in names.get("additional_special_tokens") or []]
    extra += [_token_text(names.get(k)) for k in ("bos_token", "eos_token")]
    special |= {t: i for t in extra if t and (i := tok.token_to_id(t)) is not None}
    special |= {texts[r]: i for r, i in ids.items() if i is not None}
    special_ids = SpecialIds(
        pad_id=ids["pad"], unk_id=ids["unk"], cls_id=ids["cls"], sep_id=ids["sep"],
        mask_id=ids["mask"], all_special_ids=tuple(sorted(set(special.values()))))
    return special_ids, dict(sorted(special.items(), key=lambda kv: kv[1]))


def _open_tokenizer_json(path: Path):
    """`tokenizers.Tokenizer` of a `tokenizer.json`, with no truncation or padding.

    Raises:
        ValueError: the file is not a `tokenizers` tokenizer (the file named).
    """
    tokenizers = _tokenizers()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a Hugging Face tokenizers file ({exc})") from exc
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception
        raise ValueError(f"{path}: not a Hugging Face tokenizers file ({exc})") from exc
    tok.no_truncation()
    tok.no_padding()
    return tok


class PretrainedTokenizer(Tokenizer, kind="pretrained"):
    """An adopted Hugging Face tokenizer (`tokenizer.json`), with the special ids and word
    boundaries its stage manifest records (module docstring).

    Args:
        path: the stage directory's `tokenizer.json`.
        special_ids: the ids `read_special_ids` found.
        boundary: `word_boundary` of the file.

    Raises:
        ValueError: the file is not a `tokenizers` tokenizer.
    """

    normalization = None

    @staticmethod
    def encoder_of(model: bytes) -> BatchEncoder:
        """`pretrained_batch_encoder(model)`."""
        return pretrained_batch_encoder(model)

    def __init__(self, path: Path, special_ids: SpecialIds, boundary: str) -> None:
        self.path = Path(path)
        self._bytes = self.path.read_bytes()
        self.model_sha256 = sha256_file(self.path)
        self.special_ids = special_ids
        self.boundary = boundary
        self._tok = _open_tokenizer_json(self.path)  # special names matched (probes)
        self._plain = _open_tokenizer_json(self.path)  # special names as text (documents)
        self._plain.encode_special_tokens = True
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self._added = set(self._tok.get_added_tokens_decoder())
        #: The text of the mask token, which a probe's literal "[MASK]" becomes.
        self.mask_token = self._tok.id_to_token(special_ids.mask_id)
        self._tables: tuple[np.ndarray, np.ndarray | None] | None = None

    @classmethod
    def from_manifest(cls, m: TokenizerManifest) -> PretrainedTokenizer:
        """The `tokenizer.json` `m` lists, in `m`'s directory, checked against its sha256.

        Raises:
            ValueError: the file differs from the manifest, or is not a tokenizer.
        """
        path = m.file(m.model.path)
        sha = sha256_file(path)
        if sha != m.model.sha256:
            raise ValueError(f"{path}: sha256 {sha} differs from {m.model.sha256} in its "
                             f"tokenizer manifest {m.path}: the file was changed; delete "
                             f"{path.parent} and adopt the tokenizer again")
        return cls(path, m.special_ids, m.word_boundary or "none")

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary (the largest id + 1), added tokens included."""
        return self._vocab_size

    def _word_tables(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self._tables is None:
            kind, _, marker = self.boundary.partition(":")
            if kind == "none":
                raise ValueError(f"{self.path}: this tokenizer does not mark words (no "
                                 "WordPiece prefix, Metaspace, byte-level or end-of-word "
                                 "suffix), so masking.whole_word cannot be used with it")
            pieces = [self._tok.id_to_token(i) or "" for i in range(self._vocab_size)]
            ends = None
            if kind == "continuation":
                starts = [not p.startswith(marker) for p in pieces]
            elif kind == "prefix":
                starts = [p.startswith(marker) for p in pieces]
            elif kind == "suffix":
                starts = [False] * len(pieces)
                ends = np.fromiter((p.endswith(marker) for p in pieces), bool, len(pieces))
            else:  # byte_level: the first / last byte of the piece is whitespace
                table = byte_decoder()
                starts = [bool(p) and table.get(p[0]) in _WHITESPACE for p in pieces]
                ends = np.fromiter((bool(p) and table.get(p[-1]) in _WHITESPACE
                                    for p in pieces), bool, len(pieces))
            starts = np.array(starts, dtype=bool)
            whole = [*self._added, *self.special_ids.all_special_ids]
            starts[whole] = True  # added and special tokens are words of their own
            if ends is not None:
                ends[whole] = True
            self._tables = (starts, ends)
        return self._tables

    def word_starts(self) -> np.ndarray:
        """Bool (vocab_size,), True where an id begins a word (`word_boundary`).

        Raises:
            ValueError: the tokenizer does not mark words (`word_boundary` `none`).
        """
        return self._word_tables()[0].copy()

    def word_ends(self) -> np.ndarray | None:
        """Bool (vocab_size,), True where a word ends with an id (byte-level BPE pieces
        ending in whitespace, end-of-word suffixes, added and special tokens); None for
        WordPiece and prefix markers.

        Raises:
            ValueError: the tokenizer does not mark words.
        """
        ends = self._word_tables()[1]
        return None if ends is None else ends.copy()

    def encode(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Piece ids of each text (no [CLS] / [SEP]; special names as plain text).
        `num_threads` is unused: `tokenizers` parallelizes batches itself."""
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_mask(self, text: str) -> list[int]:
        """Piece ids of a fill-mask probe: each literal "[MASK]" becomes the mask token
        (its text, when the tokenizer spells it otherwise, e.g. "<mask>"), and every
        special token's text its id, as the tokenizer matches them."""
        if self.mask_token != "[MASK]":
            text = text.replace("[MASK]", self.mask_token)
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """`tokenizers`' decoding of `ids`, special tokens kept or skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, i: int) -> str:
        """The token string of id `i` ("" for an id no token has)."""
        return self._tok.id_to_token(int(i)) or ""

    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`; `unk_id` when absent (-1 without an [UNK])."""
        if (found := self._tok.token_to_id(piece)) is not None:
            return found
        return -1 if self.unk_id is None else self.unk_id

    def encoder_spec(self) -> EncoderSpec:
        """`("pretrained", the tokenizer.json bytes)`."""
        return "pretrained", self._bytes

    def __repr__(self) -> str:
        return f"PretrainedTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def pretrained_batch_encoder(model: bytes) -> BatchEncoder:
    """The `BatchEncoder` of a `tokenizer.json`'s bytes: texts (UTF-8) encoded by
    `tokenizers` (`encode_batch_fast`: no offsets; it releases the GIL and uses its own
    threads), special names as plain text, no [CLS] / [SEP].

    Raises:
        ValueError: the bytes are not a `tokenizers` tokenizer.
    """
    tokenizers = _tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_str(model.decode("utf-8"))
    except Exception as exc:  # tokenizers raises plain Exception
        raise ValueError(f"not a Hugging Face tokenizers file ({exc})") from exc
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode(texts):
        if not texts:
            return []
        strings = [t.decode("utf-8") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, dtype=np.int32)
                for e in batch(strings, add_special_tokens=False)]

    return encode


def _source_files(source: Path) -> list[Path]:
    """The tokenizer files of a `save_pretrained` directory: `tokenizer.json` first.

    Raises:
        FileNotFoundError: `source` is not a directory, or has no `tokenizer.json`.
    """
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer.adopt_from: {source} is not a directory")
    if not (source / TOKENIZER_JSON).is_file():
        raise FileNotFoundError(
            f"tokenizer.adopt_from: {source} has no {TOKENIZER_JSON} (a fast tokenizer's "
            "file, as `save_pretrained` writes it)")
    return [source / TOKENIZER_JSON,
            *(source / n for n in COMPANION_FILES if (source / n).is_file())]


def pretrained_tokenizer_digest(source: str | os.PathLike[str]) -> str:
    """Identity of the tokenizer `adopt_pretrained_tokenizer(source, ...)` gives: the
    sha256 of every tokenizer file in `source` (not its path).

    Raises:
        FileNotFoundError: as `adopt_pretrained_tokenizer`.
    """
    inputs = {p.name: sha256_file(p) for p in _source_files(Path(source).expanduser())}
    return compute_digest(STAGE, {"adopt": _ADOPTION}, inputs)


def adopt_pretrained_tokenizer(source: str | os.PathLike[str], work_dir: str | os.PathLike[str]
                               ) -> TokenizerManifest:
    """Adopt the Hugging Face tokenizer in directory `source` as this run's tokenizer
    (or reuse the one adopted before from the same files).

    The tokenizer files (`tokenizer.json` and whichever of `COMPANION_FILES` exist) are
    read, checked (`tokenizers` loads the file; the roles resolve to ids) and copied to
    `<work_dir>/tokenizer/<digest[:16]>`, with a manifest (`kind: pretrained`) recording
    their sha256 (`inputs`, and each copy's `FileEntry`), the special ids, the special
    tokens, the word boundary and `source`.

    Args:
        source: a local `save_pretrained` directory (of a model or of its tokenizer).
        work_dir: pipeline work directory.

    Returns:
        The manifest (`model`: `tokenizer.json`; `files`: the others).

    Raises:
        FileNotFoundError: `source` is not a directory or has no `tokenizer.json`.
        ValueError: `tokenizer.json` is not a `tokenizers` file, a role the pipeline
            needs is missing or not in the vocabulary, or a special id is not below the
            vocabulary's size (each names the file).
        RuntimeError: `tokenizers` cannot be imported.
    """
    src = Path(source).expanduser()
    files = _source_files(src)
    inputs = {p.name: sha256_file(p) for p in files}
    digest = compute_digest(STAGE, {"adopt": _ADOPTION}, inputs)
    out_dir = stage_dir(work_dir, STAGE, digest)

    def build() -> TokenizerManifest:
        watch = Stopwatch()
        tok = _open_tokenizer_json(files[0])
        special_ids, special_tokens = read_special_ids(src, tok)
        spec = json.loads(files[0].read_text(encoding="utf-8"))
        boundary = word_boundary(spec)
        out_dir.mkdir(parents=True, exist_ok=True)
        for p in files:
            tmp = out_dir / f".{p.name}.{os.getpid()}.tmp"
            shutil.copyfile(p, tmp)
            os.replace(tmp, out_dir / p.name)
        entries = [file_entry(out_dir, out_dir / p.name) for p in files]
        changed = [e.path for e in entries if e.sha256 != inputs[e.path]]
        if changed:  # the source changed while it was copied
            raise ValueError(f"tokenizer.adopt_from: {src}: {', '.join(changed)} changed "
                             "while being read; adopt it again")
        vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        manifest = TokenizerManifest(
            stage=STAGE, digest=digest, output_dir=str(out_dir.resolve()),
            config={"adopt_from": str(src)}, inputs=inputs, created_at=watch.created_at,
            wall_time_s=watch.elapsed, kind="pretrained", model=entries[0], files=entries[1:],
            vocab_size=vocab_size, source=str(src),
            model_type=str((spec.get("model") or {}).get("type", "unknown")).lower(),
            special_tokens=special_tokens, special_ids=special_ids, word_boundary=boundary)
        if special_ids.all_special_ids[-1] >= vocab_size:  # pragma: no cover - ids come from it
            raise ValueError(f"{files[0]}: special id {special_ids.all_special_ids[-1]} "
                             f"outside its vocabulary of {vocab_size}")
        write_manifest(manifest)
        logger.info("tokenizer: adopted %s (%s, %d ids, special ids %s, words: %s) from %s",
                    TOKENIZER_JSON, manifest.model_type, vocab_size, special_ids.roles(),
                    boundary, src)
        return manifest

    manifest, reused = reuse_or_build(
        out_dir, STAGE,
        lambda: load_if_complete(out_dir, TokenizerManifest, digest,
                                 HashMemo(work_dir).file_sha256), build)
    if reused:
        logger.info("tokenizer: reusing the adopted tokenizer in %s", out_dir)
    return manifest
