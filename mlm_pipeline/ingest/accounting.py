"""Input files -> cleaned documents, with every record accounted for: records read, drops
and repairs by reason, extra parts of split documents, and rejected (bad) files.

The policy of the ingestion stage is documented in `mlm_pipeline.ingest.stage`; this
module applies it record by record. Imports neither torch nor prefect.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterator

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.allowed import OUTSIDE, escaped
from mlm_pipeline.ingest.cleaning import letter_share, split_text
from mlm_pipeline.ingest.readers import Record, read_records
from mlm_pipeline.ingest.sources import BadFileError, Source
from mlm_pipeline.manifest import BadFile

logger = logging.getLogger(__name__)

DROP_REASONS = ("bad_json", "missing_text", "binary", "language", "empty", "too_short",
                "few_letters", "duplicate", "near_duplicate")
REPAIR_REASONS = ("bom", "invalid_utf8", "nul", "control", "control_space", "split",
                  "extra_fields")


class Accounting:
    """Turns input files into cleaned documents and counts reads, drops, repairs and
    bad files.

    Attributes:
        read: records read (bad ones included).
        split_parts_extra: parts beyond the first of every split document.
        per_file: records read per file, by index in the file list.
        dropped: documents dropped, by reason (every reason of `DROP_REASONS`).
        repaired: records repaired, by reason (every reason of `REPAIR_REASONS`).
        bad_files: files rejected by their reader, in reading order.
        first_error: the error of the first bad file (the cause of a `fail` error).
    """

    def __init__(self, cfg: IngestConfig) -> None:
        self.cfg = cfg
        self.read = 0
        self.split_parts_extra = 0
        self.per_file: dict[int, int] = {}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.repaired = dict.fromkeys(REPAIR_REASONS, 0)
        self.bad_files: list[BadFile] = []
        self.first_error: BadFileError | None = None

    def documents(self, files: list[Source]) -> Iterator[tuple[str, str, str]]:
        """`(id, normalized text, source)` of every document (or part of a split one)
        that survives cleaning and filtering (deduplication is the caller's), stopping
        after `max_documents` records.

        A file whose reader raises `BadFileError` is added to `bad_files` and logged; the
        records it gave before the error stay counted (and kept or dropped as any). With
        `on_bad_file: fail`, once a file is bad the later files are only read through, to
        name every bad file at once: their records are neither counted nor yielded.
        """
        cfg, limit = self.cfg, self.cfg.max_documents
        langs = set(cfg.languages) if cfg.languages is not None else None
        for i, path in enumerate(files):
            records = confined_records(path, cfg, read_records(
                path, cfg.text_field, cfg.txt_document))
            checking = bool(self.bad_files) and cfg.on_bad_file == "fail"
            try:
                while limit is None or self.read < limit:
                    # Pull a record only when it will be counted, so that nothing past
                    # `max_documents` is read, repaired or dropped.
                    try:
                        rec = next(records, None)
                    except BadFileError as e:
                        self._reject(path, e, self.per_file.get(i, 0))
                        break
                    if rec is None:
                        break
                    if checking:
                        continue
                    self.read += 1
                    self.per_file[i] = self.per_file.get(i, 0) + 1
                    for reason in rec.repairs:
                        self.repaired[reason] += 1
                    if (drop := self._drop_reason(rec.drop, rec.lang, langs)) is not None:
                        self.dropped[drop] += 1
                        continue
                    yield from self._cleaned(rec.id, rec.text, rec.source, rec.repairs)
            finally:
                records.close()
            if limit is not None and self.read >= limit:
                return

    def _cleaned(self, doc_id: str, text: str, source: str,
                 repairs: set[str]) -> Iterator[tuple[str, str, str]]:
        """The document, normalized, or its parts; counts a text drop or a split."""
        cfg = self.cfg
        if "\x00" in text:
            text = text.replace("\x00", "")
            if "nul" not in repairs:
                self.repaired["nul"] += 1
        text = unicodedata.normalize(cfg.normalization, text).strip()
        if (drop := self._text_drop_reason(text)) is not None:
            self.dropped[drop] += 1
        elif len(text) <= cfg.max_document_chars:
            yield doc_id, text, source
        else:
            self.repaired["split"] += 1
            for k, (part, _sep) in enumerate(split_text(text, cfg.max_document_chars), 1):
                self.split_parts_extra += k > 1  # parts beyond the first are new docs
                yield f"{doc_id}#{k}", part, source

    def _reject(self, path: Source, error: BadFileError, documents: int) -> None:
        self.bad_files.append(BadFile(path=str(path), reason=error.reason, error=str(error),
                                      documents=documents))
        self.first_error = self.first_error or error
        kept = (f"the {documents} record(s) read before the error are counted as usual; the "
                "rest of the file is not read" if documents else "no record read from it")
        logger.warning("ingest: bad input file (%s), %s (ingest.on_bad_file: %s): %s",
                       error.reason, kept, self.cfg.on_bad_file, error)

    @staticmethod
    def _drop_reason(drop: str | None, lang: str | None, langs: set[str] | None) -> str | None:
        if drop is not None:
            return drop  # a bad record
        if langs is not None and lang is not None and lang not in langs:
            return "language"
        return None

    def _text_drop_reason(self, text: str) -> str | None:
        if not text:
            return "empty"
        if len(text) < self.cfg.min_chars:
            return "too_short"
        if self.cfg.min_letter_share > 0 and letter_share(text) < self.cfg.min_letter_share:
            return "few_letters"
        return None


def confined_records(path: Source, cfg: IngestConfig,
                     records: Iterator[Record]) -> Iterator[Record]:
    """`records` (of the file `path`, not yet started), once `path` is checked again, as it
    is opened, against `cfg.allowed_sources` (`allowed.escaped`): a file listed inside an
    allowed root that now resolves outside every root (a link swapped in after listing) is
    a bad file, never opened.

    Raises:
        BadFileError: reason `outside_allowed_sources`, the path and where it leads named.
    """
    if (why := escaped(path, cfg.allowed_sources)) is not None:
        raise BadFileError(path, OUTSIDE, f"not read: {why}")
    yield from records


def bad_files_error(bad: list[BadFile]) -> ValueError:
    """The one error of `on_bad_file: fail`: every bad file, one per line (each line
    starts with the file's path or URL)."""
    return ValueError(f"ingest: {len(bad)} bad input file(s), and ingest.on_bad_file is "
                      "'fail' (with 'skip' the other files are read and these are named in "
                      "the manifest):\n" + "\n".join(b.error for b in bad))
