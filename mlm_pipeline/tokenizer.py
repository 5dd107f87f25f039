"""SentencePiece tokenizer: training on the training split, loading and batch encoding.

`train_tokenizer` trains a SentencePiece model (Kudo & Richardson 2018; unigram LM, Kudo 2018,
or BPE, Sennrich et al. 2016) on the training split of an ingested corpus, with the fixed
special-token ids of `config.SPECIAL_TOKENS`:

    0 [PAD] (pad_id)   1 [UNK] (unk_id)   2 [CLS] (bos_id)   3 [SEP] (eos_id)   4 [MASK] (control)

`[MASK]` is a *control* symbol: it has an id but is never matched in text, so a document that
contains the characters "[MASK]" is encoded as ordinary text. The only way id 4 enters a
sequence from text is `Tokenizer.encode_with_mask` (fill-mask probes); masking itself
writes the id directly.

Normalization. Ingestion already applied the declared Unicode policy (NFC or NFKC), so the
tokenizer must not apply another one: SentencePiece's default `nmt_nfkc` would silently turn
an NFC corpus into NFKC. We therefore train with the identity rule *except for whitespace*:
SentencePiece only treats U+0020 as a word boundary, and with the plain `identity` rule a tab,
newline, no-break space (U+00A0, U+202F, common in French typography) or any other Unicode
space is an ordinary character, usually unseen in training and encoded as [UNK] (we checked
this with sentencepiece 0.2.3: "chat\\tdort" gives [UNK] for the tab). A custom rule table
(`normalization_rule_tsv`) maps every character for which `str.isspace()` is true to U+0020;
it is compiled into the `.model` file, so any SentencePiece runtime reading the model encodes
the same ids. `remove_extra_whitespaces` (default) then collapses runs of spaces.

The trainer's input file (the training split's documents as bounded lines) is written by
`mlm_pipeline.documents`.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
import sentencepiece as spm

from mlm_pipeline.config import (
    CLS_ID,
    MASK_ID,
    NUM_SPECIAL,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    TokenizerConfig,
)
from mlm_pipeline.documents import write_training_text
from mlm_pipeline.manifest import (
    CorpusManifest,
    Stopwatch,
    TokenizerManifest,
    compute_digest,
    file_entry,
    load_if_complete,
    read_manifest,
    stage_dir,
    write_manifest,
)

logger = logging.getLogger(__name__)

STAGE = "tokenizer"
MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
#: The literal marker that `Tokenizer.encode_with_mask` replaces by the [MASK] id.
MASK_MARKER = "[MASK]"
#: Seed of the training-sentence sample (`write_training_text`): a rerun samples the same
#: lines. SentencePiece's own sampling is not used: with 0.2.3 its sampled models differed
#: run to run despite `set_random_generator_seed` (three runs, three model hashes).
_SAMPLING_SEED = 1
_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
#: Pieces `<0x00>` ... `<0xFF>` that `byte_fallback` adds, at ids 5-260 (after the specials).
_BYTE_PIECES = 256
_SEVERE = re.compile(r"[WEF]\d{4} ")  # absl log prefix of warnings, errors, fatals
_READ = re.compile(r"Loaded all (\d+) sentences")


def tokenizer_digest(cfg: TokenizerConfig, corpus: CorpusManifest) -> str:
    """Identity of the tokenizer `train_tokenizer(cfg, corpus, ...)` writes: config + corpus."""
    return compute_digest(STAGE, cfg, {"corpus": corpus.digest})


def train_tokenizer(
    cfg: TokenizerConfig, corpus: CorpusManifest, work_dir: str | os.PathLike[str]
) -> TokenizerManifest:
    """Train a SentencePiece model on the corpus's training split (or reuse a cached one).

    Each document is written to a temporary text file as one line per non-blank line of the
    document; a line longer than `cfg.max_sentence_length` bytes is split at whitespace (at a
    character boundary when a single word is longer), so no text is dropped. At most
    `cfg.input_sentence_size` of these lines are written (a seeded uniform sample, see
    `documents.write_training_text`), which bounds the trainer's memory; the same corpus
    and config give the same model on every run.

    With `cfg.byte_fallback` the vocabulary holds the 256 byte pieces `<0x00>`...`<0xFF>` at
    ids 5-260, right after the fixed special ids, and they count in `cfg.vocab_size`.

    Args:
        cfg: tokenizer settings (`vocab_size` counts the five special tokens).
        corpus: the ingested corpus; only its `train` Parquet files are read.
        work_dir: pipeline work directory; output goes to `<work_dir>/tokenizer/<digest[:16]>`.

    Returns:
        The manifest of `spm.model` and `spm.vocab`, with the actual `vocab_size`, the
        number of sentences (lines) the trainer read and of candidate lines before sampling
        (`sampled_from`), `byte_fallback`, and `sample_digest` (sha256 of the training
        text file given to the trainer: the sample).

    Raises:
        ValueError: `cfg.vocab_size` is more than the corpus supports or fewer than its
            required characters, plus the 256 byte pieces with `byte_fallback` (the
            message names both numbers), the training split has no text, or a Parquet file
            lacks a string `text` column (the file is named).
        RuntimeError: the trained model does not have the fixed special-token ids.
    """
    digest = tokenizer_digest(cfg, corpus)
    out_dir = stage_dir(work_dir, STAGE, digest)
    cached = load_if_complete(out_dir, TokenizerManifest, digest)
    if cached is not None:
        logger.info("tokenizer: reusing %s", out_dir)
        return cached
    watch = Stopwatch()
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".tmp-*"):  # left by a killed run (SIGKILL skips cleanup)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tmp-") as tmp_name:
            tmp = Path(tmp_name)
            lines, candidates, sample_digest = write_training_text(
                corpus, tmp / "train.txt", cfg.max_sentence_length,
                cfg.input_sentence_size, _SAMPLING_SEED,
            )
            if lines == 0:
                raise ValueError(
                    f"tokenizer: the training split of corpus {corpus.output_dir} has no text"
                )
            read = _run_trainer(cfg, tmp, lines)
            _strip_temp_paths(tmp / MODEL_FILE)
            for name in (MODEL_FILE, VOCAB_FILE):
                os.replace(tmp / name, out_dir / name)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    vocab_size = spm.SentencePieceProcessor(model_file=str(out_dir / MODEL_FILE)).get_piece_size()
    manifest = TokenizerManifest(
        stage=STAGE,
        digest=digest,
        output_dir=str(out_dir),
        config=cfg.model_dump(mode="json"),
        inputs={"corpus": corpus.digest},
        created_at=watch.created_at,
        wall_time_s=watch.elapsed,
        model=file_entry(out_dir, out_dir / MODEL_FILE),
        vocab=file_entry(out_dir, out_dir / VOCAB_FILE),
        vocab_size=vocab_size,
        model_type=cfg.model_type,
        special_tokens=dict(SPECIAL_TOKENS),
        training_sentences=read,
        byte_fallback=cfg.byte_fallback,
        sample_digest=sample_digest,
        sampled_from=candidates,
        normalization=corpus.config.get("normalization"),
    )
    write_manifest(manifest)
    logger.info(
        "tokenizer: %s vocab_size=%d from %d sentences (%d lines written) in %.1f s",
        cfg.model_type, vocab_size, read, lines, watch.elapsed,
    )
    return manifest


def _run_trainer(cfg: TokenizerConfig, tmp: Path, lines: int) -> int:
    """Run the SentencePiece trainer in `tmp` and check its model; returns sentences read.

    Raises:
        ValueError: the requested vocabulary size does not fit the corpus (too many pieces,
            fewer than the required characters, or fewer pieces built than requested).
        RuntimeError: the model does not have the fixed special-token ids.
    """
    rules = tmp / "whitespace.tsv"
    # Rule format (sentencepiece normalizer builder): source code points TAB target code points.
    spaces = (c for c in range(0x110000) if chr(c).isspace() and c != 0x20)
    rules.write_text("".join(f"{c:X}\t20\n" for c in spaces), encoding="utf-8")
    log_path = tmp / "trainer.log"
    error: RuntimeError | None = None
    try:
        # `logstream` redirects the process's stderr (fd 2) into the file while training:
        # the only way to read how many sentences the trainer loaded. It calls
        # `sys.stderr.fileno()`, which fails where stderr is replaced (pytest's capsys,
        # notebooks): then the log stays on fd 2 and the count is estimated.
        with open(log_path, "w", encoding="utf-8") as log:
            stream = log if _has_fileno(sys.stderr) else None
            spm.SentencePieceTrainer.train(
                input=str(tmp / "train.txt"),
                model_prefix=str(tmp / Path(MODEL_FILE).stem),
                model_type=cfg.model_type,
                vocab_size=cfg.vocab_size,
                character_coverage=cfg.character_coverage,
                input_sentence_size=0,  # train.txt is already the sample: load it all
                max_sentence_length=cfg.max_sentence_length,
                num_threads=cfg.num_threads,
                byte_fallback=cfg.byte_fallback,
                normalization_rule_tsv=str(rules),
                pad_id=PAD_ID, pad_piece="[PAD]",
                unk_id=UNK_ID, unk_piece="[UNK]",
                bos_id=CLS_ID, bos_piece="[CLS]",
                eos_id=SEP_ID, eos_piece="[SEP]",
                control_symbols=[MASK_MARKER],
                logstream=stream,
            )
    except RuntimeError as exc:
        error = exc
    read = _read_trainer_log(log_path, lines)
    if error is not None:
        if m := _TOO_HIGH.search(str(error)):
            raise ValueError(_too_high_message(cfg, int(m.group(2)), read)) from error
        if m := _TOO_SMALL.search(str(error)):
            bytes_note = f" and {_BYTE_PIECES} byte pieces" if cfg.byte_fallback else ""
            raise ValueError(
                f"tokenizer.vocab_size={cfg.vocab_size} is less than this corpus needs: "
                f"SentencePiece ({cfg.model_type}) needs at least {m.group(2)} pieces (the "
                f"characters kept by character_coverage={cfg.character_coverage:g} plus the "
                f"special tokens{bytes_note}) for {read} training sentences; raise "
                "tokenizer.vocab_size or lower tokenizer.character_coverage"
            ) from error
        raise error
    sp = spm.SentencePieceProcessor(model_file=str(tmp / MODEL_FILE))
    if sp.get_piece_size() < cfg.vocab_size:  # a trainer that silently built fewer pieces
        raise ValueError(_too_high_message(cfg, sp.get_piece_size(), read))
    _check_special(sp, tmp / MODEL_FILE, RuntimeError)
    return read


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return True


def _too_high_message(cfg: TokenizerConfig, supported: int, read: int) -> str:
    return (
        f"tokenizer.vocab_size={cfg.vocab_size} is more than this corpus supports: "
        f"SentencePiece ({cfg.model_type}) can build at most {supported} pieces from {read} "
        "training sentences; lower tokenizer.vocab_size or add text"
    )


def _read_trainer_log(log_path: Path, lines: int) -> int:
    """Forward the trainer's log to `logger`; returns the sentences it says it loaded
    (else `lines`, the lines written for it)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        logger.log(logging.WARNING if _SEVERE.match(line) else logging.DEBUG, "spm: %s", line)
    if m := _READ.search(text):
        return int(m.group(1))
    return lines


def _strip_temp_paths(path: Path) -> None:
    """Keep only file names of the temporary paths the trainer records in the model.

    The `.model` proto stores its trainer spec, temporary input paths included; without
    them the same config and corpus give byte-identical models (and `model_sha256`) in any
    directory. Needs protobuf (an mlflow dependency); without it the model is left as is.
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: the model works, its sha256 is just less stable
        logger.debug("protobuf not installed: %s keeps its temporary paths", path)
        return
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    spec.input[:] = [Path(p).name for p in spec.input]
    spec.model_prefix = Path(spec.model_prefix).name
    norm.normalization_rule_tsv = Path(norm.normalization_rule_tsv).name
    path.write_bytes(proto.SerializeToString())


def _check_special(sp: spm.SentencePieceProcessor, path: Path, error: type[Exception]) -> None:
    wrong = [
        f"{piece} has id {sp.piece_to_id(piece)}"
        for piece, want in SPECIAL_TOKENS.items()
        if sp.piece_to_id(piece) != want or sp.id_to_piece(want) != piece
    ]
    if not sp.is_control(MASK_ID):
        wrong.append(f"{MASK_MARKER} is not a control symbol")
    if wrong:
        raise error(f"{path}: special tokens differ from {SPECIAL_TOKENS}: {'; '.join(wrong)}")


class Tokenizer:
    """A trained SentencePiece model with the pipeline's fixed special-token ids.

    Text given to `encode` and `encode_with_mask` is first brought to the Unicode
    normalization form of the corpus the model was trained on (`normalization`), as
    ingestion did to every training document: "cafe\u0301" and "caf\u00e9" encode alike.

    Attributes:
        path: the `.model` file it was loaded from.
        model_sha256: hex sha256 of that file's bytes (equals the manifest's `model.sha256`).
        normalization: `NFC`, `NFKC`, or None (text is encoded as given).
        pad_id, unk_id, cls_id, sep_id, mask_id: the fixed special ids 0-4.
    """

    pad_id, unk_id, cls_id, sep_id, mask_id = PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID

    def __init__(self, path: str | os.PathLike[str], normalization: str | None = None) -> None:
        """Load a `.model` file (prefer `Tokenizer.load`, which finds `normalization`).

        Raises:
            ValueError: the file is not a SentencePiece model, the model does not have the
                fixed special-token ids, or `normalization` is not NFC, NFD, NFKC or NFKD.
        """
        if normalization not in (None, "NFC", "NFD", "NFKC", "NFKD"):
            raise ValueError(f"tokenizer: unknown normalization form {normalization!r}")
        self.path = Path(path)
        self.normalization = normalization
        proto = self.path.read_bytes()
        self.model_sha256 = hashlib.sha256(proto).hexdigest()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as exc:
            raise ValueError(f"{self.path}: not a SentencePiece model ({exc})") from exc
        self._word_starts: np.ndarray | None = None
        _check_special(self._sp, self.path, ValueError)

    @classmethod
    def load(cls, source: str | os.PathLike[str] | TokenizerManifest) -> Tokenizer:
        """Load from a `TokenizerManifest`, its directory / `manifest.json`, or a `.model` file.

        The normalization form comes from the manifest; for a `.model` file, from the
        stage's `manifest.json` beside it when that lists this file (else None).

        Raises:
            FileNotFoundError: the path does not exist.
            ValueError: the manifest is invalid, the file is not a SentencePiece model, or
                the model lacks the fixed special ids.
        """
        if isinstance(source, TokenizerManifest):
            return cls(source.file(source.model.path), source.normalization)
        p = Path(source)
        if p.is_dir() or p.name == "manifest.json":
            m = read_manifest(p, TokenizerManifest)
            return cls(m.file(m.model.path), m.normalization)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {p}")
        beside = p.with_name("manifest.json")
        try:
            m = read_manifest(beside, TokenizerManifest)
        except (OSError, ValueError):  # no stage manifest here: a model file on its own
            return cls(p)
        return cls(p, m.normalization if m.file(m.model.path).samefile(p) else None)

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
        return self._sp.encode(
            [self._normalize(t) for t in texts], out_type=int,
            num_threads=num_threads if num_threads > 0 else -1,
        )

    def _normalize(self, text: str) -> str:
        return unicodedata.normalize(self.normalization, text) if self.normalization else text

    def encode_with_mask(self, text: str) -> list[int]:
        """Encode a fill-mask probe: each literal "[MASK]" becomes the [MASK] id (4).

        The text is split on the marker and each part encoded on its own, so each part gets
        SentencePiece's word-start marker: "l'[MASK]s" reads as "l'", [MASK], " s".

        Returns:
            Piece ids with `MASK_ID` at each marker (no [CLS] / [SEP] added).
        """
        ids: list[int] = []
        for i, part in enumerate(self._normalize(text).split(MASK_MARKER)):
            if i:
                ids.append(MASK_ID)
            ids.extend(self._sp.encode(part, out_type=int))
        return ids

    def decode(self, ids) -> str:
        """Decode ids (any iterable of ints, e.g. a numpy row) to text; control ids vanish."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        """The piece string of id `i` (e.g. "▁chat", "[SEP]")."""
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`; `unk_id` when it is not in the vocabulary."""
        return self._sp.piece_to_id(piece)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

