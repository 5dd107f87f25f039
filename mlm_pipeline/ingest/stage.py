"""Stage 1, ingestion: raw text files -> cleaned, deduplicated Parquet documents per split.

Inputs (`IngestConfig.sources`, in order): `debian:NAME` (a built-in corpus, see
`mlm_pipeline.ingest.corpora`), a file, a directory (recursively: every supported suffix), a
glob, or an fsspec URL of any of these (`mlm_pipeline.ingest.sources`: resolution, content
hashes, decompression, UTF-16/32). Formats (`.txt`, `.jsonl`, `.json`, `.csv`,
`.parquet`) are `mlm_pipeline.ingest.readers`'s. Every record read is repaired or dropped, and
every repair and drop is counted in the manifest:

* Repairs (counted once per record read, kept or dropped): `bom`, `invalid_utf8`, `nul`
  (see `sources`), `extra_fields` (see `readers`), `control` (C0 control characters other
  than tab, line feed, carriage return and the separators removed; `cleaning.screen`),
  `control_space` (a run of C0 separators, vertical tab, form feed or U+001C-U+001F, made
  one space so that words stay apart), and `split`: a document longer than
  `max_document_chars` is cut into parts of at most that many characters, at the last
  blank line (paragraph) before the limit, else the last whitespace after `.`, `!` or `?`
  (sentence), else the last whitespace, else hard at the limit. The whitespace run cut at
  is removed (parts are stripped), no other character is lost. Parts get ids `<id>#<k>`
  (k from 1) and are then deduplicated and assigned to splits like any document.
* Drops (in this order): `bad_json`, `missing_text` (field absent or not a string),
  `binary` (a share of U+FFFD and control characters above `cleaning.BINARY_SHARE`),
  `language` (a `lang` field not in `languages`), `empty`, `too_short`, `few_letters`
  (letter share below `min_letter_share`), `duplicate` (exact match on the normalized
  text; memory: one 16-byte digest per kept document), `near_duplicate` (MinHash LSH,
  optional, see `cleaning.NearDuplicateFilter`). With a holdout set (`eval.holdout_sources`,
  `ingest.holdout`), a document whose normalized text is a scored holdout document is
  dropped as `holdout_overlap` before deduplication (the reason is in the manifest only
  then), so the benchmark text is never trained on.

Counts: `documents_read` counts records read (one per source record, bad ones included);
`documents_kept` counts documents written, each part of a split document counting as one;
drops count records before splitting and parts after it (`duplicate`, `near_duplicate`).
So `documents_read + split_parts_extra = documents_kept + sum(dropped)`, where
`split_parts_extra` (in the manifest) counts the parts beyond the first of each split
document (`repaired["split"]` counts the split documents).

Bad files (`on_bad_file`): a file its reader cannot read as its format (truncated or
corrupt compressed stream or Parquet file, `.json` that is not one array, no
`text_field` column, CSV quote never closed: `sources.BadFileError`) is named with its
reason in the manifest's `bad_files` and logged. With `skip` the run goes on with the
other files; the records the file gave before the error (the rows of a CSV before a quote
that never closes, the first array of a `.json` with a second one after it) are counted,
kept or dropped like any, and its entry says how many. With `fail` the stage reads the
other files through and raises one error naming every bad file. `on_bad_file` is no part
of the digest; a cached manifest with bad files fails too. Entries of source directories
and globs that are not regular files of a supported type (FIFOs, devices, symlink loops,
dangling links, directories named like files...) are never opened: they are named with
their kind in `skipped_files` (`listing`).

Split: a document goes to validation iff the first 8 bytes of sha256(normalized text),
read as a big-endian integer and divided by 2**64, are below `validation_fraction`. The
result depends on the text only: same on any machine, in any order. When that leaves
validation empty although `validation_fraction > 0` and at least 2 documents are kept,
the kept document with the smallest such hash is moved to validation, so evaluation
always has data.

Validation honesty (`mlm_pipeline.ingest.overlap`): with `validation_dedup: lines`, every
validation line that occurs (case-folded, whitespace collapsed) in a training document is
removed from its validation document after the split (a document left shorter than
`min_chars` is dropped as `validation_overlap`; one changed is counted as repaired,
`validation_lines`); the training split is not touched. Then, unless `overlap_ngram` is
None, the manifest's `validation_overlap` records the share of the validation split's word
13-gram windows that occur in training: what remains of training text in the held-out text.

Output: `train-NNNNN.parquet` and `validation-NNNNN.parquet` (string columns `id`,
`text`, `source`; zstd; a new file every `writer.DOCS_PER_FILE` documents) written streaming
in batches of `writer.BATCH_DOCS` (one row group each; `writer.SplitWriter`), in reading
order. Memory: one batch (its texts once, as UTF-8, plus the Parquet encoder's pages) and
the exact-dedup digests, 24-49 bytes per distinct document (`cleaning.DigestSet`; 10 M
documents: under 0.5 GiB); it does not grow with the corpus otherwise.

Reuse: a stage directory with this digest is reused only when every Parquet file still has
the sha256 its manifest records; a changed file is named in a warning and the stage is
rebuilt. Source and output hashes come through the work directory's hash memo
(`hashing`), so an unchanged corpus is not read again to be found unchanged.

This module imports neither torch nor prefect (nor `datasketch`, unless near-dedup is on).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.accounting import Accounting, bad_files_error
from mlm_pipeline.ingest.cleaning import DigestSet, NearDuplicateFilter
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.ingest.holdout import OVERLAP, Holdout
from mlm_pipeline.ingest import writer
from mlm_pipeline.ingest.overlap import (
    DEFAULT_NGRAM, LineDedup, dedup_validation_lines, ngram_overlap,
)
from mlm_pipeline.ingest.sources import (
    Source, content_hash, resolve_sources, source_name, source_size,
)
from mlm_pipeline.locks import remove_stale_temporaries, reuse_or_build
from mlm_pipeline.manifest import (
    CorpusManifest, FileEntry, SkippedFile, SourceEntry, Stopwatch, ValidationOverlap,
    compute_digest, load_if_complete, stage_dir, write_manifest,
)
from mlm_pipeline.progress import NullProgress, Progress, reporting

logger = logging.getLogger(__name__)


def ingest(cfg: IngestConfig, work_dir: str | Path, progress: Progress | None = None,
           accounting: Callable[[IngestConfig], Accounting] = Accounting,
           holdout: Holdout | None = None) -> CorpusManifest:
    """Read, clean, deduplicate and split the corpus into Parquet files.

    Args:
        cfg: ingestion config.
        work_dir: root of the stage outputs; this stage writes `<work_dir>/ingest/<digest>`.
        progress: where to report (`mlm_pipeline.progress`): the fetch of `debian:`
            corpora (stage `fetch`, packages) and stage `ingest`: bytes read of the
            sources' total (exact at each file's end, estimated from the text read within
            a file), with `read`, `kept` and `dropped` documents so far; at the end the
            count is the sources' bytes and the fields the manifest's counts.
        accounting: what reads and cleans the records (`Accounting`, in this process;
            `partitions.partitioned(mapper, n)` reads partitions in parallel: same output).
        holdout: the run's holdout text (`holdout.read_holdout`): its documents are
            dropped from the corpus (`holdout_overlap`), and its keys join the digest.

    Returns:
        The manifest: sources (path, sha256, bytes, documents read), the Parquet files of
        each split (rows = documents), document and character counts, drops and repairs
        by reason (every reason present, 0 when none), bad files and skipped entries.

    Raises:
        FileNotFoundError: a source matches no file.
        ValueError: a file has an unsupported extension; with `on_bad_file: fail`, files
            are bad (a `.json` file that is not an array or has data after it, a missing
            `text_field` column (CSV/Parquet) or one of a non-string type (Parquet), a CSV
            quoted field never closed, a truncated or corrupt compressed or Parquet file):
            one error names them all, one line each; the training split would be empty;
            an unknown `debian:` corpus; a path in the cached manifest is outside its
            stage directory (`ManifestPathError`, the manifest named).
        ImportError: `near_dedup_threshold` is set but `datasketch` is not installed; a
            URL source needs a missing fsspec backend (e.g. `s3fs`).
        RuntimeError: a `debian:` corpus cannot be fetched (see `corpora.fetch_debian_corpus`).
    """
    watch = Stopwatch()
    skipped: list[SkippedFile] = []
    progress = progress or NullProgress()
    with reporting(progress):
        files = resolve_sources(cfg, skipped)
    hashes = [content_hash(f, work_dir) for f in files]
    digest = _digest(cfg, files, hashes, holdout)
    out_dir = stage_dir(work_dir, "ingest", digest)
    # Reused only when every document file still has its sha256 (a changed one is named).
    cached, reused = reuse_or_build(
        out_dir, "ingest",
        lambda: load_if_complete(out_dir, CorpusManifest, digest, HashMemo(work_dir).file_sha256),
        lambda: _build(cfg, work_dir, files, hashes, skipped, digest, out_dir, watch,
                       progress, accounting, holdout))
    if not reused:
        return cached
    logger.info("ingest: cached %s (%d documents)", out_dir, cached.documents_kept)
    if cached.bad_files and cfg.on_bad_file == "fail":
        raise bad_files_error(cached.bad_files)
    for b in cached.bad_files:
        logger.warning("ingest: cached corpus skipped a bad input file (%s): %s",
                       b.reason, b.error)
    return cached


def _build(cfg: IngestConfig, work_dir: str | Path, files: list[Source], hashes: list[str],
           skipped: list[SkippedFile], digest: str, out_dir: Path,
           watch: Stopwatch, progress: Progress,
           accounting: Callable[[IngestConfig], Accounting] = Accounting,
           holdout: Holdout | None = None) -> CorpusManifest:
    """Write the stage directory `out_dir` (the caller holds its `stage_lock`); the
    arguments and errors are `ingest`'s."""
    sizes = [source_size(f, work_dir) for f in files]
    meter = _BytesMeter(sizes, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)  # left by an interrupted run
    reader = accounting(cfg)
    held = holdout.keys if holdout is not None else frozenset()
    if holdout is not None:
        reader.dropped[OVERLAP] = 0
    writers = {split: writer.SplitWriter(out_dir, split) for split in ("train", "validation")}
    seen = DigestSet()
    near = NearDuplicateFilter(cfg.near_dedup_threshold) if cfg.near_dedup_threshold else None
    smallest: tuple[bytes, int, int] | None = None  # train doc with the smallest split hash
    kept = characters = 0
    threshold = cfg.validation_fraction
    try:
        for doc_id, text, source in reader.documents(files):
            data = text.encode("utf-8")
            meter.add(reader, len(data), kept)
            key = hashlib.blake2b(data, digest_size=16).digest()  # holdout.overlap_key
            if key in held:
                reader.dropped[OVERLAP] += 1
                continue
            if seen.add(key):
                reader.dropped["duplicate"] += 1
                continue
            if near is not None and near.is_duplicate(text):
                reader.dropped["near_duplicate"] += 1
                continue
            kept += 1
            characters += len(text)
            h = hashlib.sha256(data).digest()[:8]
            split = "validation" if int.from_bytes(h, "big") / 2**64 < threshold else "train"
            if split == "train" and (smallest is None or h < smallest[0]):
                smallest = (h, len(writers["train"].entries), writers["train"].rows_in_file)
            writers[split].add(doc_id, data, source)
        if reader.bad_files and cfg.on_bad_file == "fail":
            raise bad_files_error(reader.bad_files) from reader.first_error
        train, validation = writers["train"].close(), writers["validation"].close()
        n_val = sum(e.rows or 0 for e in validation)
        if n_val == 0 and threshold > 0 and kept >= 2 and smallest is not None:
            train, validation = writer.move_to_validation(out_dir, train, smallest[1], smallest[2])
            n_val = 1
            logger.info("ingest: validation split was empty; moved the document with the "
                        "smallest split hash from train to validation")
        if kept - n_val == 0:
            raise ValueError(f"ingest: the training split is empty ({reader.read} records read, "
                             f"{kept} kept, {n_val} in validation, {len(reader.bad_files)} "
                             f"bad files); check the sources {cfg.sources} and "
                             f"validation_fraction {threshold}")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    validation, overlap, removed = _validation_overlap(cfg, out_dir, train, validation, reader)
    kept, n_val, characters = kept - removed[0], n_val - removed[0], characters - removed[1]
    m = CorpusManifest(
        stage="ingest", digest=digest, output_dir=str(out_dir),
        config=cfg.model_dump(mode="json"), inputs=_inputs(files, hashes),
        created_at=watch.created_at, wall_time_s=watch.elapsed,
        sources=[SourceEntry(path=str(f), sha256=h, bytes=n,
                             documents=reader.per_file.get(i, 0))
                 for i, (f, h, n) in enumerate(zip(files, hashes, sizes))],
        train=train, validation=validation,
        documents_read=reader.read, documents_kept=kept, documents_train=kept - n_val,
        documents_validation=n_val, characters=characters,
        dropped=dict(reader.dropped), repaired=dict(reader.repaired),
        split_parts_extra=reader.split_parts_extra, bad_files=reader.bad_files,
        skipped_files=skipped, validation_overlap=overlap,
    )
    write_manifest(m)
    progress.finish("ingest", read=m.documents_read, kept=kept,
                    dropped=sum(m.dropped.values()))
    drops = ", ".join(f"{k} {v}" for k, v in m.dropped.items() if v) or "none"
    repairs = ", ".join(f"{k} {v}" for k, v in m.repaired.items() if v) or "none"
    logger.info("ingest: %d files (%d bad, %d other entries skipped), %d read, %d kept (train "
                "%d, validation %d), %d chars; dropped: %s; repaired: %s; %.1f s -> %s",
                len(files), len(m.bad_files), len(skipped), m.documents_read, kept,
                m.documents_train, n_val, characters, drops, repairs, m.wall_time_s, out_dir)
    return m


def _validation_overlap(cfg: IngestConfig, out_dir: Path, train: list[FileEntry],
                        validation: list[FileEntry], reader: Accounting
                        ) -> tuple[list[FileEntry], ValidationOverlap | None, tuple[int, int]]:
    """Line-level deduplication of the validation split against training
    (`cfg.validation_dedup`), then the n-gram overlap that remains (`cfg.overlap_ngram`).

    Counts the documents emptied (`dropped["validation_overlap"]`) and changed
    (`repaired["validation_lines"]`) in `reader`; both reasons are present only with
    `validation_dedup: lines`.

    Returns:
        The validation split's files (rewritten when lines were removed), the overlap
        record (None when not measured) and (documents dropped, characters removed).
    """
    stats = LineDedup()
    if cfg.validation_dedup == "lines":
        docs = writer.read_split(out_dir, validation)
        kept, stats = dedup_validation_lines(
            docs, (t for _, t in read_documents([out_dir / e.path for e in train])),
            cfg.min_chars)
        reader.dropped["validation_overlap"] = stats.documents_dropped
        reader.repaired["validation_lines"] = stats.documents_changed
        if stats.lines_removed:
            validation = writer.rewrite_split(out_dir, "validation", validation, kept)
        logger.info("ingest: removed %d validation lines found in training (%d characters; "
                    "%d documents changed, %d dropped)", stats.lines_removed,
                    stats.characters_removed, stats.documents_changed,
                    stats.documents_dropped)
        if not kept:
            logger.warning("ingest: no validation document is left after removing its lines "
                           "found in training (ingest.validation_dedup: lines)")
    removed = (stats.documents_dropped, stats.characters_removed)
    if cfg.overlap_ngram is None:
        return validation, None, removed
    overlap = ngram_overlap(
        (t for _, t in read_documents([out_dir / e.path for e in validation])),
        (t for _, t in read_documents([out_dir / e.path for e in train])), cfg.overlap_ngram)
    overlap = overlap.model_copy(update={"lines_removed": stats.lines_removed,
                                         "characters_removed": stats.characters_removed})
    logger.info("ingest: %.1f %% of the validation split's %d word %d-gram windows occur in "
                "training (%d of %d validation documents mostly training text)",
                100 * overlap.share, overlap.validation_windows, overlap.ngram,
                overlap.validation_documents_mostly_in_train, overlap.validation_documents)
    return validation, overlap, removed


def ingest_digest(cfg: IngestConfig, work_dir: str | Path | None = None,
                  holdout: Holdout | None = None) -> str:
    """The digest `ingest(cfg, work_dir)` would give its output, without reading documents:
    resolves the sources (fetching `debian:` corpora if needed) and hashes their bytes,
    through the hash memo of `work_dir` when given (an unchanged corpus is not read
    again; `mlm_pipeline.ingest.hashing`), else of this process; `holdout` as `ingest`'s.

    Raises:
        The errors of `resolve_sources`.
    """
    files = resolve_sources(cfg)
    return _digest(cfg, files, [content_hash(f, work_dir) for f in files], holdout)


def _inputs(files: list[Source], hashes: list[str]) -> dict[str, str]:
    # Content only: the same bytes under another directory give the same digest. The
    # basename stays in the key because document ids contain it.
    return {f"{i:05d}:{source_name(f)}": h for i, (f, h) in enumerate(zip(files, hashes))}


def _digest(cfg: IngestConfig, files: list[Source], hashes: list[str],
            holdout: Holdout | None = None) -> str:
    config = cfg.model_dump(mode="json",
                            exclude={"cache_dir", "sources", "on_bad_file", "allowed_sources"})
    # Keys added after digests were first published count only when not at their default,
    # so that earlier corpora keep their digests.
    for key, default in (("validation_dedup", "none"), ("overlap_ngram", DEFAULT_NGRAM)):
        if config[key] == default:
            del config[key]
    if holdout is not None:  # only when set: digests without a holdout stay the same
        config["holdout_keys"] = holdout.keys_digest()
    return compute_digest("ingest", config, _inputs(files, hashes))


def read_documents(files: list[Path]) -> Iterator[tuple[str, str]]:
    """Stream `(id, text)` from ingest Parquet files, in file order, `writer.BATCH_DOCS` at
    a time.

    Args:
        files: Parquet files written by `ingest` (e.g. `[m.file(e.path) for e in m.train]`).

    Yields:
        `(id, text)` of every document.
    """
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(writer.BATCH_DOCS, columns=["id", "text"]):
            yield from zip(batch.column("id").to_pylist(), batch.column("text").to_pylist())


class _BytesMeter:
    """Reports stage `ingest`: source bytes read, exact at each file's end (the files
    before the one being read, whose index is the highest in `Accounting.per_file`), and
    within a file the UTF-8 bytes of the documents read from it, capped at its size; plus
    the documents read, kept and dropped so far. One update every `EVERY` documents."""

    EVERY = 256

    def __init__(self, sizes: list[int], progress: Progress) -> None:
        self.before = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes, self.progress = sizes, progress
        self.file, self.in_file, self.done, self.seen = 0, 0, 0, 0
        progress.start("ingest", float(sum(sizes)), "bytes", f"{len(sizes)} files")

    def add(self, reader: Accounting, nbytes: int, kept: int) -> None:
        """Count one document of `nbytes` UTF-8 bytes; `kept` documents were kept before it."""
        self.in_file += nbytes
        self.seen += 1
        if self.seen % self.EVERY:
            return
        current = next(reversed(reader.per_file), 0)  # files are read in order
        if current != self.file:  # the bytes since the last update: counted in the old file
            self.file, self.in_file = current, 0
        self.done = max(self.done, self.before[current] + min(self.in_file, self.sizes[current]))
        self.progress.update("ingest", float(self.done), read=reader.read, kept=kept,
                             dropped=sum(reader.dropped.values()))
