"""The manifests of the stages (`CorpusManifest`, `TokenizerManifest`, `ShardManifest`,
`TrainManifest`, `EvalManifest`), over `base.Manifest`.

They live here, not in the stage modules, so that flows can pass and validate them without
importing torch. This module imports neither torch nor prefect.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mlm_pipeline.config.base import SENTENCEPIECE_SPECIAL_IDS, SpecialIds
from mlm_pipeline.manifest.base import FileEntry, Manifest


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


class ValidationOverlap(BaseModel):
    """How much of the validation split is training text (`mlm_pipeline.ingest.overlap`):
    what line-level deduplication across the split removed, and the word n-gram overlap
    that remains."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ngram: int
    """Window length, words."""
    validation_windows: int
    """Word n-gram windows of the validation documents (with repeats)."""
    validation_windows_in_train: int
    """Of those, windows that occur at least once in the training documents."""
    validation_documents: int
    """Validation documents with at least one window."""
    validation_documents_mostly_in_train: int
    """Of those, documents with more than half of their windows in training."""
    validation_documents_short: int = 0
    """Validation documents shorter than `ngram` words (no window; not in the shares)."""
    lines_removed: int = 0
    """Validation lines removed as training lines (`ingest.validation_dedup: lines`)."""
    characters_removed: int = 0
    """Characters of validation text those removals took away."""

    @property
    def share(self) -> float:
        """`validation_windows_in_train / validation_windows` (0 without windows)."""
        return self.validation_windows_in_train / max(1, self.validation_windows)


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
    bad_files: list[BadFile] = []  # noqa: RUF012 - pydantic copies defaults
    """Input files rejected part-way or before their first record, with the reason."""
    skipped_files: list[SkippedFile] = []  # noqa: RUF012 - pydantic copies defaults
    """Entries of source directories and globs that were not read, with their kind."""
    validation_overlap: ValidationOverlap | None = None
    """The validation<->training overlap after deduplication (`ingest.overlap_ngram`);
    None when not measured (or made before it was)."""


class TokenizerManifest(Manifest):
    """Output of the tokenizer stage: a SentencePiece model trained by `train_tokenizer`
    (`kind: sentencepiece`), or a Hugging Face tokenizer adopted by
    `adopt_pretrained_tokenizer` (`kind: pretrained`)."""

    kind: Literal["sentencepiece", "pretrained"] = "sentencepiece"
    """`sentencepiece`: our trained `spm.model`; `pretrained`: an adopted `tokenizer.json`
    (read through the `tokenizers` library) with the files saved beside it."""
    model: FileEntry
    """The model file: the `.model` (serialized SentencePiece ModelProto), or the adopted
    `tokenizer.json`."""
    vocab: FileEntry | None = None
    """The `.vocab` file (piece and score per line) of a SentencePiece model; None for an
    adopted tokenizer."""
    files: list[FileEntry] = []  # noqa: RUF012 - pydantic copies defaults
    """An adopted tokenizer's other files, copied from its directory
    (`tokenizer_config.json`, `special_tokens_map.json`, `vocab.txt`, ...), which the model
    export writes back beside the model."""
    vocab_size: int
    """Pieces in the vocabulary, special (and added) tokens included."""
    model_type: str
    """`unigram` or `bpe` (SentencePiece); the adopted model's `wordpiece`, `bpe`,
    `unigram` or `wordlevel`."""
    special_tokens: dict[str, int]
    """Every special token's text -> its id (`[PAD]`=0 ... `[MASK]`=4 for ours)."""
    special_ids: SpecialIds = SENTENCEPIECE_SPECIAL_IDS
    """The ids of the five roles and every id masking never selects nor draws (read from
    the adopted tokenizer; the fixed 0-4 of ours, and of manifests written before this
    field)."""
    word_boundary: str | None = None
    """How an adopted tokenizer marks words, which whole-word masking follows:
    `prefix:<marker>` (a word starts at a piece beginning with the marker: SentencePiece's
    "▁", byte-level BPE's encoded space "Ġ"), `continuation:<marker>` (WordPiece's
    "##" continues a word), `suffix:<marker>` (a word ends with the marker), or `none`
    (whole-word masking refused); None for ours ("▁" prefix)."""
    source: str | None = None
    """The directory an adopted tokenizer was read from, as given (its files' sha256 are
    the stage's `inputs`, its identity)."""
    training_sentences: int = 0
    """Sentences the trainer read (after sampling); 0 for an adopted tokenizer."""
    byte_fallback: bool = False
    """Whether unknown characters decompose into UTF-8 byte pieces instead of [UNK]."""
    sample_digest: str | None = None
    """sha256 of the training text the trainer was given (one sentence per line): the
    seeded sample of at most `input_sentence_size` lines."""
    sampled_from: int | None = None
    """Candidate sentences (lines) of the training split the sample was drawn from."""
    normalization: str | None = None
    """Unicode normalization form of the corpus it was trained on (`NFC`, `NFKC`), which
    `Tokenizer.encode` applies to new text; None in manifests written before this field,
    and for an adopted tokenizer (its own normalizer applies)."""

    def tokenizer_files(self) -> list[FileEntry]:
        """Every file of the tokenizer: `model`, then `vocab` or the adopted `files`."""
        return [self.model, *([self.vocab] if self.vocab is not None else []), *self.files]


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
    special_ids: SpecialIds = SENTENCEPIECE_SPECIAL_IDS
    """The special ids the rows were written with ([CLS] first, [SEP] after each
    document) and masked with: the tokenizer's (`TokenizerManifest.special_ids`; 0-4 in
    manifests written before this field). Training and evaluation read them from here."""


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
    compile_fallback: str | None = None
    """Why the compiled model ran partly eagerly: `recompile_limit` (dynamo hit the run's
    recompile limit, `train.perf.COMPILE_RECOMPILE_LIMIT`, in its last training segment);
    None: it never did, or the run was not compiled."""
    init: dict[str, Any] | None = None
    """The warm start's parent (`train.init_from`): `source`, `checkpoint`, `digest`
    (its `state_sha256`) and `step`; None for a run from random weights."""


class EvalManifest(Manifest):
    """Output of `evaluate`: held-out metrics with fixed masks."""

    metrics: dict[str, float]
    """`eval/loss`, `eval/mlm_accuracy`, `eval/perplexity`, `eval/masked_tokens`, ..."""
    probes: list[dict[str, Any]]
    """Fill-mask probes: text and top-k predictions per mask."""
    tags: dict[str, str] = {}  # noqa: RUF012 - pydantic copies defaults
    """Run tags the evaluation asks for: `unavailable.<figure>` with the reason a figure
    could not be computed (no data, disabled, too few seeds), and `digest.task.<name>`,
    the digest of each downstream task's split."""
