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
`mlm_pipeline.ingest.documents`; `Tokenizer` (loading a model and encoding text) is in
`mlm_pipeline.tokenizer.tokenizer`, re-exported here.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm

from mlm_pipeline.config import CLS_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS, UNK_ID, TokenizerConfig
from mlm_pipeline.ingest.documents import write_training_text
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.locks import remove_stale_temporaries, reuse_or_build
from mlm_pipeline.manifest import (
    CorpusManifest,
    Stopwatch,
    TokenizerManifest,
    compute_digest,
    file_entry,
    load_if_complete,
    sha256_file,
    stage_dir,
    write_manifest,
)
from mlm_pipeline.progress import NullProgress, Progress
from mlm_pipeline.tokenizer.base import Tokenizer
from mlm_pipeline.tokenizer.tokenizer import MASK_MARKER, check_special

logger = logging.getLogger(__name__)

# Tokenizer and MASK_MARKER live in `tokenizer.tokenizer`.
__all__ = ["MASK_MARKER", "MODEL_FILE", "STAGE", "VOCAB_FILE", "Tokenizer", "adopt_tokenizer",
           "tokenizer_digest", "train_tokenizer"]

STAGE = "tokenizer"
MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
#: Seed of the training-sentence sample (`write_training_text`): a rerun samples the same
#: lines. SentencePiece's own sampling is not used: with 0.2.3 its sampled models differed
#: run to run despite `set_random_generator_seed` (three runs, three model hashes).
_SAMPLING_SEED = 1
#: Part of the digest: tokenizers trained before the stage sampled its own lines (and
#: recorded `normalization`, `sampled_from`) are trained again, not reused.
_SAMPLING = "reservoir-R/pcg64-raw"
_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
#: Pieces `<0x00>` ... `<0xFF>` that `byte_fallback` adds, at ids 5-260 (after the specials).
_BYTE_PIECES = 256
_SEVERE = re.compile(r"[WEF]\d{4} ")  # absl log prefix of warnings, errors, fatals
_READ = re.compile(r"Loaded all (\d+) sentences")


def tokenizer_digest(cfg: TokenizerConfig, corpus: CorpusManifest) -> str:
    """Identity of the tokenizer `train_tokenizer(cfg, corpus, ...)` writes: config, corpus
    and the sampling algorithm of the training text (`from_init` and `adopt_from` left
    out: they decide whether this tokenizer is trained, not what it is, so digests made
    before they existed still hold)."""
    tokenizer = cfg.model_dump(mode="json", exclude={"from_init", "adopt_from"})
    return compute_digest(STAGE, {"tokenizer": tokenizer, "sampling": _SAMPLING},
                          {"corpus": corpus.digest})


def train_tokenizer(
    cfg: TokenizerConfig, corpus: CorpusManifest, work_dir: str | os.PathLike[str],
    progress: Progress | None = None,
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
        progress: where to report stage `tokenizer` (`mlm_pipeline.progress`), in two
            phases of 1 unit each: sampling (of the training split's documents), then
            training on the sampled `lines`; SentencePiece's own log stays in its log.

    Returns:
        The manifest of `spm.model` and `spm.vocab`, with the actual `vocab_size`, the
        number of sentences (lines) the trainer read and of candidate lines before sampling
        (`sampled_from`), `byte_fallback`, and `sample_digest` (sha256 of the training
        text file given to the trainer: the sample).

    Raises:
        ValueError: `cfg.vocab_size` is more than the corpus supports or fewer than its
            required characters, plus the 256 byte pieces with `byte_fallback` (the
            message names both numbers), the training split has no text, or a Parquet file
            lacks a string `text` column (the file is named); a path in the cached
            manifest is outside its stage directory (`ManifestPathError`).
        RuntimeError: the trained model does not have the fixed special-token ids.
    """
    digest = tokenizer_digest(cfg, corpus)
    out_dir = stage_dir(work_dir, STAGE, digest)
    # Reused only when the model and vocab files still have their sha256 (else the changed
    # file is named in a warning and the model trained again).
    cached, reused = reuse_or_build(
        out_dir, STAGE,
        lambda: load_if_complete(out_dir, TokenizerManifest, digest,
                                 HashMemo(work_dir).file_sha256),
        lambda: _build(cfg, corpus, digest, out_dir, progress or NullProgress()))
    if reused:
        logger.info("tokenizer: reusing %s", out_dir)
    return cached


def adopt_tokenizer(parent: TokenizerManifest, work_dir: str | os.PathLike[str]
                    ) -> TokenizerManifest:
    """Reuse a tokenizer trained before (a warm start's parent, `tokenizer.from_init`)
    instead of training one: nothing is trained; the same tokenizer keeps its identity.

    The parent's files (`spm.model` and `spm.vocab`, or an adopted tokenizer's
    `tokenizer.json` and companions) are checked against its manifest (sha256)
    and copied, with the manifest, to `<work_dir>/tokenizer/<parent digest[:16]>` (nothing
    is copied when they are there already), so the shards of a new corpus are encoded with
    the parent's pieces and ids, and the parent's digest feeds the shards digest as a
    trained tokenizer's does.

    Args:
        parent: the manifest of the tokenizer to reuse (its files where `output_dir` says).
        work_dir: pipeline work directory of this run.

    Returns:
        The manifest in this work directory (`output_dir` there; everything else, digest
        included, the parent's).

    Raises:
        ValueError: a file of the parent differs from its manifest's sha256 (named), or
            its model lacks the fixed special-token ids.
        FileNotFoundError: a file of the parent is missing.
    """
    out_dir = stage_dir(work_dir, STAGE, parent.digest)

    def build() -> TokenizerManifest:
        for entry in parent.tokenizer_files():
            src = parent.file(entry.path)
            if sha256_file(src) != entry.sha256:
                raise ValueError(f"tokenizer.from_init: {src} differs from the sha256 in "
                                 f"{parent.path}")
        Tokenizer.load(parent)  # a SentencePiece model's fixed ids; an adopted one loads
        out_dir.mkdir(parents=True, exist_ok=True)
        for entry in parent.tokenizer_files():
            tmp = out_dir / f".{Path(entry.path).name}.{os.getpid()}.tmp"
            shutil.copyfile(parent.file(entry.path), tmp)
            os.replace(tmp, out_dir / entry.path)
        adopted = parent.model_copy(update={"output_dir": str(out_dir.resolve())})
        write_manifest(adopted)
        logger.info("tokenizer: reusing %s (digest %s) from %s", parent.model.path,
                    parent.digest[:16], parent.output_dir)
        return adopted

    if Path(parent.output_dir).resolve() == out_dir.resolve():
        return parent
    manifest, _ = reuse_or_build(
        out_dir, STAGE,
        lambda: load_if_complete(out_dir, TokenizerManifest, parent.digest,
                                 HashMemo(work_dir).file_sha256), build)
    return manifest


def _build(cfg: TokenizerConfig, corpus: CorpusManifest, digest: str,
           out_dir: Path, progress: Progress) -> TokenizerManifest:
    """Train into `out_dir` (the caller holds its `stage_lock`); errors: `train_tokenizer`'s."""
    watch = Stopwatch()
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)  # left by a killed run (SIGKILL skips cleanup)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".trainer.{os.getpid()}-",
                                         suffix=".tmp") as tmp_name:
            tmp = Path(tmp_name)
            progress.start("tokenizer", 2.0, "phases",
                           f"sampling lines of {corpus.documents_train} documents")
            lines, candidates, sample_digest = write_training_text(
                corpus, tmp / "train.txt", cfg.max_sentence_length, cfg.input_sentence_size,
                _SAMPLING_SEED)
            if lines == 0:
                raise ValueError(
                    f"tokenizer: the training split of corpus {corpus.output_dir} has no text")
            progress.update("tokenizer", 1.0, phase=f"training {cfg.model_type}",
                            lines=lines, candidates=candidates)
            read = _run_trainer(cfg, tmp, lines, candidates)
            _strip_temp_paths(tmp / MODEL_FILE)
            for name in (MODEL_FILE, VOCAB_FILE):
                os.replace(tmp / name, out_dir / name)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    vocab_size = spm.SentencePieceProcessor(model_file=str(out_dir / MODEL_FILE)).get_piece_size()
    manifest = TokenizerManifest(
        stage=STAGE, digest=digest, output_dir=str(out_dir), config=cfg.model_dump(mode="json"),
        inputs={"corpus": corpus.digest}, created_at=watch.created_at,
        wall_time_s=watch.elapsed, model=file_entry(out_dir, out_dir / MODEL_FILE),
        vocab=file_entry(out_dir, out_dir / VOCAB_FILE), vocab_size=vocab_size,
        model_type=cfg.model_type, special_tokens=dict(SPECIAL_TOKENS),
        training_sentences=read, byte_fallback=cfg.byte_fallback, sample_digest=sample_digest,
        sampled_from=candidates, normalization=corpus.config.get("normalization"))
    write_manifest(manifest)
    progress.finish("tokenizer", phase="done", sentences=read, vocab_size=vocab_size)
    logger.info("tokenizer: %s vocab_size=%d from %d sentences (%d lines written) in %.1f s",
                cfg.model_type, vocab_size, read, lines, watch.elapsed)
    return manifest


def _run_trainer(cfg: TokenizerConfig, tmp: Path, lines: int, candidates: int) -> int:
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
                input=str(tmp / "train.txt"), model_prefix=str(tmp / Path(MODEL_FILE).stem),
                model_type=cfg.model_type, vocab_size=cfg.vocab_size,
                character_coverage=cfg.character_coverage,
                input_sentence_size=0,  # train.txt is already the sample: load it all
                max_sentence_length=cfg.max_sentence_length, num_threads=cfg.num_threads,
                byte_fallback=cfg.byte_fallback, normalization_rule_tsv=str(rules),
                pad_id=PAD_ID, pad_piece="[PAD]", unk_id=UNK_ID, unk_piece="[UNK]",
                bos_id=CLS_ID, bos_piece="[CLS]", eos_id=SEP_ID, eos_piece="[SEP]",
                control_symbols=[MASK_MARKER], logstream=stream)
    except RuntimeError as exc:
        error = exc
    read = _read_trainer_log(log_path, lines)
    if error is not None:
        if m := _TOO_HIGH.search(str(error)):
            raise ValueError(_too_high_message(cfg, int(m.group(2)), read, candidates)) from error
        if m := _TOO_SMALL.search(str(error)):
            bytes_note = f" and {_BYTE_PIECES} byte pieces" if cfg.byte_fallback else ""
            raise ValueError(
                f"tokenizer.vocab_size={cfg.vocab_size} is less than this corpus needs: "
                f"SentencePiece ({cfg.model_type}) needs at least {m.group(2)} pieces (the "
                f"characters kept by character_coverage={cfg.character_coverage:g} plus the "
                f"special tokens{bytes_note}) for {read} training sentences; raise "
                "tokenizer.vocab_size or lower tokenizer.character_coverage") from error
        raise error
    sp = spm.SentencePieceProcessor(model_file=str(tmp / MODEL_FILE))
    if sp.get_piece_size() < cfg.vocab_size:  # a trainer that silently built fewer pieces
        raise ValueError(_too_high_message(cfg, sp.get_piece_size(), read, candidates))
    check_special(sp, tmp / MODEL_FILE, RuntimeError)
    return read


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return True


def _too_high_message(cfg: TokenizerConfig, supported: int, read: int, candidates: int) -> str:
    more = "add text"
    if candidates > read:  # the sample, not the corpus, is what is short
        more = (f"raise tokenizer.input_sentence_size (the trainer saw {read} of the "
                f"corpus's {candidates} sentences)")
    return (f"tokenizer.vocab_size={cfg.vocab_size} is more than this corpus supports: "
            f"SentencePiece ({cfg.model_type}) can build at most {supported} pieces from "
            f"{read} training sentences; lower tokenizer.vocab_size or {more}")


def _read_trainer_log(log_path: Path, lines: int) -> int:
    """Forward the trainer's log to `logger`; returns the sentences it says it loaded
    (else `lines`, the lines written for it)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        logger.log(logging.WARNING if _SEVERE.match(line) else logging.DEBUG, "spm: %s", line)
    m = _READ.search(text)
    return int(m.group(1)) if m else lines


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
