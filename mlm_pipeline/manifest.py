"""Stage manifests: small JSON records of what a stage wrote and what it depended on.

Each stage writes its outputs into a content-addressed directory
`<work_dir>/<stage>/<digest[:16]>/` and a `manifest.json` beside them. The digest is a
sha256 over the stage name, its config and the digests of its inputs (input manifests, or
the bytes of raw input files), so it is the stage's identity: a rerun with unchanged inputs
finds the manifest and skips the work (`load_if_complete`).

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from mlm_pipeline import __version__

logger = logging.getLogger(__name__)

#: Bump when a stage's output format changes, so old cached outputs are not reused.
FORMAT_VERSION = 1


class ManifestPathError(ValueError):
    """A path in a manifest that is not inside its stage directory (the manifest is named)."""


class FileEntry(BaseModel):
    """One output file: path relative to the manifest's directory, size and checksum."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Path relative to `Manifest.output_dir`."""
    bytes: int
    """Size in bytes."""
    sha256: str
    """Hex sha256 of the file's bytes."""
    rows: int | None = None
    """Records in the file (documents or token rows), when it has records."""
    tokens: int | None = None
    """Tokens in the file, for token shards."""


class Manifest(BaseModel):
    """Fields common to every stage manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    """Stage name (`ingest`, `tokenizer`, `shards`, `train`, `evaluate`)."""
    digest: str
    """Hex sha256 identity of the stage: config + input digests (see `compute_digest`)."""
    output_dir: str
    """Absolute directory holding the outputs and `manifest.json`."""
    config: dict[str, Any]
    """The stage config as JSON."""
    inputs: dict[str, str]
    """Name -> digest of every input (upstream manifests or raw files)."""
    package_version: str = __version__
    """mlm_pipeline version that wrote it."""
    created_at: float
    """Unix time (s) when the manifest was written."""
    wall_time_s: float
    """Seconds the stage took."""

    @property
    def path(self) -> Path:
        """Path of this manifest's `manifest.json`."""
        return Path(self.output_dir) / "manifest.json"

    def file(self, rel: str) -> Path:
        """Absolute path of an output file given relative to `output_dir`: the one check
        of every path read from a manifest, so a tampered manifest cannot make a stage
        read, or upload, a file outside its stage directory.

        Raises:
            ManifestPathError: `rel` is absolute or has a `..` part, or resolves (through
                a symbolic link) outside `output_dir`; the manifest is named.
        """
        root, given = Path(self.output_dir), PurePath(rel)
        if given.anchor or ".." in given.parts:
            raise ManifestPathError(f"{self.path}: path {rel!r} is not relative to the "
                                    f"stage directory {root} without '..'; refused")
        try:
            real, real_root = (root / rel).resolve(), root.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise ManifestPathError(f"{self.path}: path {rel!r}: {exc}; refused") from exc
        if real != real_root and real_root not in real.parents:
            raise ManifestPathError(f"{self.path}: path {rel!r} resolves to {real}, outside "
                                    f"the stage directory {real_root} (a symbolic link); refused")
        return root / rel


M = TypeVar("M", bound=Manifest)


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace) for hashing."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_jsonable
    ).encode()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    raise TypeError(f"cannot hash {type(obj).__name__} into a digest")


def compute_digest(stage: str, config: Any, inputs: Mapping[str, str]) -> str:
    """Digest that identifies a stage's output.

    Args:
        stage: stage name.
        config: the stage config (pydantic model or JSON-able value).
        inputs: name -> digest of each input; order does not matter.

    Returns:
        64 hex characters of sha256 over `FORMAT_VERSION`, the stage, the canonical config
        JSON and the sorted inputs.
    """
    h = hashlib.sha256()
    h.update(canonical_json({"format": FORMAT_VERSION, "stage": stage}))
    h.update(canonical_json(config))
    h.update(canonical_json(dict(sorted(inputs.items()))))
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in `chunk_bytes` chunks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path, **counts: int | None) -> FileEntry:
    """Describe `path` (inside `root`) with its size and sha256."""
    return FileEntry(
        path=str(path.relative_to(root)),
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
        **counts,
    )


def stage_dir(work_dir: str | os.PathLike[str], stage: str, digest: str) -> Path:
    """`<work_dir>/<stage>/<digest[:16]>`, absolute."""
    return Path(work_dir).expanduser().resolve() / stage / digest[:16]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same directory and a rename,
    so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; give the usual umask-based mode for shared work dirs.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(manifest: Manifest) -> Path:
    """Write `manifest.json` atomically into the manifest's `output_dir`; returns its path."""
    atomic_write_text(manifest.path, manifest.model_dump_json(indent=2) + "\n")
    return manifest.path


def read_manifest(path: str | os.PathLike[str], cls: type[M]) -> M:
    """Load a manifest JSON file (or a directory holding `manifest.json`) as `cls`.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: when it does not validate as `cls` (the path is named).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    try:
        return cls.model_validate_json(p.read_bytes())
    except FileNotFoundError:
        raise
    except Exception as exc:  # pydantic ValidationError or JSON error
        raise ValueError(f"{p}: not a valid {cls.__name__}: {exc}") from exc


def load_if_complete(out_dir: Path, cls: type[M], digest: str,
                     sha256: Callable[[Path], str] | None = None) -> M | None:
    """Return the manifest in `out_dir` when it exists, has `digest`, and every file it
    lists still exists with the recorded size and, when `sha256` (path -> hex digest,
    e.g. `mlm_pipeline.ingest.hashing.HashMemo.file_sha256`) is given, the recorded
    sha256; otherwise None (the stage must run). A changed file is named in a warning.

    A stage directory that was moved or copied (its work directory with it) is reused
    where it is: the returned manifest's `output_dir` is `out_dir`, resolved.

    Raises:
        ManifestPathError: a listed path is not inside `out_dir` (`Manifest.file`).
    """
    p = out_dir / "manifest.json"
    if not p.is_file():
        return None
    try:
        m = read_manifest(p, cls)
    except ValueError:
        return None
    if m.digest != digest:
        return None
    here = str(out_dir.resolve())
    if Path(m.output_dir).resolve() != Path(here):
        m = m.model_copy(update={"output_dir": here})
    files = [(m.file(entry.path), entry) for entry in _file_entries(m)]
    if any(not f.is_file() or f.stat().st_size != e.bytes for f, e in files):
        return None
    for f, entry in files if sha256 is not None else ():
        if (actual := sha256(f)) != entry.sha256:
            logger.warning("%s: %s changed: sha256 %s, its manifest %s records %s; the "
                           "stage is rebuilt", m.stage, f, actual, p, entry.sha256)
            return None
    return m


def _file_entries(obj: Any) -> list[FileEntry]:
    if isinstance(obj, FileEntry):
        return [obj]
    if isinstance(obj, BaseModel):
        obj = [getattr(obj, name) for name in type(obj).model_fields]
    elif isinstance(obj, dict):
        obj = list(obj.values())
    return [e for v in obj for e in _file_entries(v)] if isinstance(obj, (list, tuple)) else []


class Stopwatch:
    """Wall-clock timer for a stage: `elapsed` is seconds since creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.created_at = time.time()

    @property
    def elapsed(self) -> float:
        """Seconds since the stopwatch was created."""
        return time.perf_counter() - self.start


# --------------------------------------------------------------------------- stage manifests
# All stage manifests live here (not in the stage modules) so that flows can pass and
# validate them without importing torch.


class SourceEntry(BaseModel):
    """One raw input file read by ingestion."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Absolute path (or URL) as read."""
    sha256: str
    """Hex sha256 of the file's bytes (compressed bytes for `.gz`)."""
    bytes: int
    """Size in bytes."""
    documents: int
    """Documents read from it, before any drop."""


class SkippedFile(BaseModel):
    """An entry of a source directory or glob that was not read (never opened)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Path (or URL) of the entry."""
    reason: str
    """What it is: `unsupported_type`, `fifo`, `device`, `socket`, `symlink_loop`,
    `dangling_symlink`, `symlink_to_directory`, `directory` (named like an input file),
    `unreadable_directory`, ... (see `mlm_pipeline.ingest.listing`)."""


class BadFile(BaseModel):
    """An input file rejected as unreadable in its format (`ingest.on_bad_file: skip`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Path (or URL) of the file, as in `sources`."""
    reason: str
    """Short code: `corrupt_compressed`, `corrupt_parquet`, `not_json_array`,
    `json_extra_data`, `missing_text_column`, `text_column_type`, `unclosed_csv_quote`."""
    error: str
    """The error message (it names the file, and the line, offset or column)."""
    documents: int = 0
    """Records read from it before the error (counted, kept or dropped, like any other
    records); 0 when the file was rejected before its first record."""


class CorpusManifest(Manifest):
    """Output of `ingest`: Parquet document shards (`id`, `text`, `source`) per split."""

    sources: list[SourceEntry]
    """Every raw input file, in reading order."""
    train: list[FileEntry]
    """Training-split Parquet files (rows = documents)."""
    validation: list[FileEntry]
    """Validation-split Parquet files (rows = documents)."""
    documents_read: int
    """Records read from all sources, before any drop."""
    documents_kept: int
    """Documents written (train + validation)."""
    documents_train: int
    """Documents in the training split."""
    documents_validation: int
    """Documents in the validation split."""
    characters: int
    """Characters (code points) in the kept documents."""
    dropped: dict[str, int]
    """Documents dropped, by reason (`empty`, `too_short`, `duplicate`, `bad_json`, ...)."""
    repaired: dict[str, int]
    """Documents kept after a repair, by reason (`invalid_utf8`, `nul`, `bom`, ...)."""
    split_parts_extra: int = 0
    """Extra documents made by splitting oversized ones (a document cut into k parts adds
    k - 1), so that `documents_read + split_parts_extra == documents_kept + sum(dropped)`."""
    bad_files: list[BadFile] = []
    """Input files rejected part-way or before their first record, with the reason."""
    skipped_files: list[SkippedFile] = []
    """Entries of source directories and globs that were not read, with their kind."""


class TokenizerManifest(Manifest):
    """Output of `train_tokenizer`: a SentencePiece model."""

    model: FileEntry
    """The `.model` file (serialized SentencePiece ModelProto)."""
    vocab: FileEntry
    """The `.vocab` file (piece and score per line)."""
    vocab_size: int
    """Pieces in the vocabulary, special tokens included."""
    model_type: str
    """`unigram` or `bpe`."""
    special_tokens: dict[str, int]
    """Special token -> fixed id (`[PAD]`=0 ... `[MASK]`=4)."""
    training_sentences: int
    """Sentences the trainer read (after sampling)."""
    byte_fallback: bool = False
    """Whether unknown characters decompose into UTF-8 byte pieces instead of [UNK]."""
    sample_digest: str | None = None
    """sha256 of the training text the trainer was given (one sentence per line): the
    seeded sample of at most `input_sentence_size` lines."""
    sampled_from: int | None = None
    """Candidate sentences (lines) of the training split the sample was drawn from."""
    normalization: str | None = None
    """Unicode normalization form of the corpus it was trained on (`NFC`, `NFKC`), which
    `Tokenizer.encode` applies to new text; None in manifests written before this field."""


class ShardSplit(BaseModel):
    """The shards of one split (train or validation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shards: list[FileEntry]
    """Arrow IPC files in order; `rows` and `tokens` set on each."""
    rows: int
    """Rows of exactly `seq_len` tokens."""
    documents: int
    """Documents encoded."""
    tokens_in: int
    """Tokens entering packing: every document's pieces plus one [SEP] per document."""
    remainder_tokens: int
    """Stream tokens left after the last full row (fewer than `seq_len - 1`), not written:
    `remainder_content_tokens + remainder_separators`."""
    remainder_content_tokens: int | None = None
    """Document pieces dropped in the remainder, so that content tokens in rows + these =
    the pieces of every document (None: a manifest written before this field)."""
    remainder_separators: int | None = None
    """[SEP] tokens dropped in the remainder (None: a manifest written before this field)."""
    masked_copies: int = 0
    """Precomputed masked copies of every row among `shards` (0 = unmasked rows only)."""


class ShardManifest(Manifest):
    """Output of `write_shards`: packed token rows in Arrow IPC files."""

    seq_len: int
    """Tokens per row."""
    dtype: str
    """Storage dtype of `input_ids` (`uint16` or `uint32`)."""
    vocab_size: int
    """Size of the vocabulary the ids index."""
    packing: str
    """How rows are built (documented in `mlm_pipeline.shards.stage`)."""
    train: ShardSplit
    """Training rows."""
    validation: ShardSplit
    """Validation rows."""
    masking: dict[str, Any] | None = None
    """The masking config and seed the precomputed copies were made with (None = none)."""


class TrainManifest(Manifest):
    """Output of `train`: the final checkpoint and training summary."""

    checkpoint_dir: str
    """Directory of the final checkpoint (relative to `output_dir`)."""
    steps: int
    """Optimizer steps taken."""
    tokens_seen: int
    """Tokens (rows * seq_len) consumed by training."""
    final_metrics: dict[str, float]
    """Last logged training metrics (`train/loss`, `train/tokens_per_s`, ...)."""
    metrics_log: str
    """JSONL file of every logged metrics record (relative to `output_dir`)."""
    stopped_early: bool
    """True when `max_time_s` ended training before `max_steps`."""
    stop_reason: str = "max_steps"
    """Why training ended: `max_steps` (all steps trained) or `time_cap` (`max_time_s`); a
    run stopped by a non-finite loss or an interruption raises and writes no manifest."""
    device: str
    """Device trained on (`cpu`, `cuda`)."""
    precision: str
    """`fp32` or `bf16`."""
    train_time_s: float | None = None
    """Seconds of training loop over every segment of a resumed run (`Meter.train_time_s`:
    no start-up, no periodic evaluation); None in manifests written before it was kept."""
    peak_tflops: float | None = None
    """MFU denominator at the end of training, TFLOP/s (None: unknown, MFU not reported)."""
    peak_source: str | None = None
    """Where `peak_tflops` comes from: `measured`, `declared`, `spec` or `achieved`."""


class EvalManifest(Manifest):
    """Output of `evaluate`: held-out metrics with fixed masks."""

    metrics: dict[str, float]
    """`eval/loss`, `eval/mlm_accuracy`, `eval/perplexity`, `eval/masked_tokens`, ..."""
    probes: list[dict[str, Any]]
    """Fill-mask probes: text and top-k predictions per mask."""
