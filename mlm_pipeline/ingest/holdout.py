"""The fixed benchmark text of `eval.holdout_sources`: read, capped, digested and pinned.

Scheduled retraining compares each week's model with last week's on data that moves with
the corpus; a holdout set is text that does not move, scored for every model version in
`holdout/bits_per_char` (`evaluate.bpc`), so week-over-week numbers are comparable, and
the registry decides on it when it is set (`app.decide.on_holdout`).

Definition (`read_holdout`):

- Documents: the holdout sources read as the ingest stage reads its sources (the same
  readers, formats, repairs, filters, splitting of long documents and `allowed_sources`
  confinement: the `ingest` section with `sources` replaced by `eval.holdout_sources`
  and no `max_documents`), normalized (`ingest.normalization`), exact duplicates
  removed, in reading order. Bad files follow `ingest.on_bad_file`.
- Scored text (the cap): per document its whitespace-separated words, in order, while
  their characters (`len(word) + 1` each) fit `eval.bpc_max_chars` (`text_words`): the
  last document may be cut, later ones are not used. A document is kept as its words
  joined by one space.
- Digest (`digest.holdout`): the sha256 (hex) of the scored text as UTF-8: the kept
  documents joined by one line feed (a kept document holds no line feed). The same
  files give the same digest on any machine; `eval.holdout_digest` pins it.
- Never trained on: every scored document's whole normalized text (before the cap) is a
  key (`keys`: BLAKE2b-128 of its UTF-8, the key of the ingest stage's exact
  deduplication); the ingest stage drops a document with such a key from the corpus, as
  `holdout_overlap`, before the train/validation split.

Imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from mlm_pipeline.config import IngestConfig, PipelineConfig
from mlm_pipeline.ingest.accounting import Accounting, bad_files_error
from mlm_pipeline.ingest.sources import check_local_sources, is_url, resolve_sources

logger = logging.getLogger(__name__)

#: The ingest drop reason of a training document that is also a holdout document.
OVERLAP = "holdout_overlap"


def text_words(documents: Iterable[str], max_chars: int) -> list[list[str]]:
    """The words of `documents` scored under the budget `max_chars`: per document its
    whitespace-split words, in order, until the words' characters (`len + 1` each) would
    pass `max_chars`; documents with no word left are dropped from the end."""
    out: list[list[str]] = []
    used = 0
    for text in documents:
        words = []
        for w in text.split():
            if used + len(w) + 1 > max_chars:
                break
            words.append(w)
            used += len(w) + 1
        else:
            out.append(words)
            continue
        if words:
            out.append(words)
        break
    return out


def text_digest(documents: Iterable[str]) -> str:
    """sha256 (hex) of `documents` joined by one line feed, as UTF-8."""
    return hashlib.sha256("\n".join(documents).encode("utf-8")).hexdigest()


def overlap_key(text: str) -> bytes:
    """The key of a normalized document (BLAKE2b-128 of its UTF-8): the ingest stage's
    exact-deduplication key."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass(frozen=True)
class Holdout:
    """The scored holdout text (see the module docstring).

    Attributes:
        documents: the scored documents, each its words joined by one space.
        digest: sha256 (hex) of the scored text (`text_digest(documents)`).
        sources: the `eval.holdout_sources` it was read from.
        keys: the overlap keys of the scored documents' whole texts.
    """

    documents: tuple[str, ...]
    digest: str
    sources: tuple[str, ...]
    keys: frozenset[bytes]

    @property
    def chars(self) -> int:
        """Characters of the scored text, each word counting `len(word) + 1`."""
        return sum(len(w) + 1 for d in self.documents for w in d.split())

    def keys_digest(self) -> str:
        """sha256 (hex) of the sorted overlap keys: what the ingest digest depends on."""
        return hashlib.sha256(b"".join(sorted(self.keys))).hexdigest()


def read_holdout(cfg: PipelineConfig) -> Holdout | None:
    """The holdout text of `cfg` (`eval.holdout_sources`), checked against the pin
    `eval.holdout_digest`; None when no holdout source is set.

    Raises:
        ValueError: the digest is not the pinned one (one line: the field, both digests
            and the sources); the sources give no word; a bad file with
            `ingest.on_bad_file: fail`; an unsupported file type.
        FileNotFoundError: a holdout source matches no file.
    """
    ev = cfg.eval
    if not ev.holdout_sources:
        return None
    icfg = IngestConfig.model_validate({**cfg.ingest.model_dump(),
                                        "sources": ev.holdout_sources, "max_documents": None})
    reader = Accounting(icfg)
    seen: set[bytes] = set()
    texts: list[str] = []
    used = 0
    for _, text, _ in reader.documents(resolve_sources(icfg)):
        key = overlap_key(text)
        if key in seen:
            continue
        seen.add(key)
        texts.append(text)
        used += sum(len(w) + 1 for w in text.split())
        if used >= ev.bpc_max_chars:
            break  # the cap is reached: later documents are not scored
    if reader.bad_files and icfg.on_bad_file == "fail":
        raise bad_files_error(reader.bad_files) from reader.first_error
    words = text_words(texts, ev.bpc_max_chars)
    if not words:
        raise ValueError(f"eval.holdout_sources {ev.holdout_sources}: no word to score "
                         f"({reader.read} records read, {len(reader.bad_files)} bad files)")
    documents = tuple(" ".join(w) for w in words)
    holdout = Holdout(documents=documents, digest=text_digest(documents),
                      sources=tuple(ev.holdout_sources),
                      keys=frozenset(overlap_key(t) for t in texts[:len(documents)]))
    if ev.holdout_digest is not None and ev.holdout_digest != holdout.digest:
        raise ValueError(f"eval.holdout_digest: pinned {ev.holdout_digest}, but "
                         f"eval.holdout_sources {ev.holdout_sources} give {holdout.digest}")
    logger.info("holdout: %d documents, %d characters from %s (digest %s)",
                len(documents), holdout.chars, list(ev.holdout_sources), holdout.digest[:12])
    return holdout


def check_holdout(cfg: PipelineConfig) -> None:
    """Check the holdout sources before a run starts (the CLI calls it before Prefect):
    each local entry must match files, and when every entry is local the text is read
    and its pin (`eval.holdout_digest`) checked, so a wrong pin fails at once. `debian:`
    and URL entries are left to the ingest task (`read_holdout`), not fetched here.

    Raises:
        The errors of `read_holdout`.
    """
    sources = cfg.eval.holdout_sources
    check_local_sources(cfg.ingest.model_copy(update={"sources": sources}))
    if sources and not any(s.startswith("debian:") or is_url(s) for s in sources):
        read_holdout(cfg)
