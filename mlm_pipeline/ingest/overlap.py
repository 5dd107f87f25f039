"""How much of the validation text is training text: removing the validation lines that
occur in training, and measuring the validation<->training n-gram overlap that remains.

A held-out figure means what it says only when the held-out text is not, in large part,
text the model trained on. Near-verbatim repeats (shared help-page boilerplate, a paragraph
quoted in two documents) fall on both sides of a split by document hash, and document-level
near-duplicate removal does not catch them: on `debian:fr` 23.0 % of the validation
split's 13-gram windows occur in training, 22.6 % after MinHash near-dedup at Jaccard 0.8
and 21.6 % at 0.5 (the documents differ; their boilerplate lines do not).

`dedup_validation_lines` removes from every validation document each line that occurs in
a training document (`line_key`: case-folded, whitespace collapsed), CCNet's line-level
deduplication (Wenzek et al. 2020, section 3.3) applied across the split only, so the
training text is unchanged.

`ngram_overlap` measures what remains: the share of the validation split's word 13-gram
windows that occur anywhere in the training split, the contamination measure of GPT-3's
decontamination (Brown et al. 2020, appendix C: 13-grams of lowercased words).

Words are maximal runs of word characters (`\\w+`, Unicode), case-folded; a document of
`n` or more words has `words - n + 1` windows, a shorter one none (it is counted apart).
A window is a 64-bit polynomial hash of its words' CRC-32 values (`zlib.crc32` of the
UTF-8 word; stable across processes and machines, no vocabulary kept in memory): two
different windows collide with probability about 2**-64 per pair, so the figure is exact
for any practical purpose.

Memory: the validation windows' hashes (8 bytes each, sorted and deduplicated); the
training split is streamed once, a batch of documents at a time. Time: one pass of a
regular expression and `zlib.crc32` over every training word (about 2 s per million
words on one core).

Imports neither torch nor prefect (numpy only).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable, Iterator

import numpy as np
from pydantic import BaseModel

from mlm_pipeline.manifest import ValidationOverlap

#: Window length in words (GPT-3's decontamination, Brown et al. 2020, appendix C).
DEFAULT_NGRAM = 13
#: A validation document with more than this share of its windows in training is counted
#: as mostly training text.
MOSTLY = 0.5
_WORD = re.compile(r"\w+")
_SPACES = re.compile(r"\s+")
#: Odd 64-bit multiplier of the polynomial window hash (the golden-ratio constant of
#: Knuth's multiplicative hashing, TAOCP vol. 3, 6.4).
_BASE = np.uint64(0x9E3779B97F4A7C15)


def window_hashes(text: str, ngram: int = DEFAULT_NGRAM) -> np.ndarray:
    """The hashes of `text`'s word `ngram`-gram windows, in order.

    Args:
        text: a document.
        ngram: window length in words (>= 1).

    Returns:
        uint64 array (max(0, words - ngram + 1),).

    Raises:
        ValueError: `ngram` < 1.
    """
    if ngram < 1:
        raise ValueError(f"n-gram overlap: window length {ngram} must be at least 1")
    words = _WORD.findall(text.casefold())
    if len(words) < ngram:
        return np.zeros(0, dtype=np.uint64)
    ids = np.fromiter((zlib.crc32(w.encode("utf-8")) for w in words), dtype=np.uint64,
                      count=len(words))
    windows = np.lib.stride_tricks.sliding_window_view(ids, ngram)      # (W, ngram)
    powers = _BASE ** np.arange(ngram - 1, -1, -1, dtype=np.uint64)     # wraps mod 2**64
    with np.errstate(over="ignore"):
        return (windows * powers).sum(axis=1, dtype=np.uint64)


def ngram_overlap(validation: Iterable[str], train: Iterable[str],
                  ngram: int = DEFAULT_NGRAM) -> ValidationOverlap:
    """How many of the validation documents' word n-gram windows occur in training.

    Args:
        validation: the validation documents' texts (held in memory as window hashes).
        train: the training documents' texts (streamed once).
        ngram: window length in words.

    Returns:
        The counts (`ValidationOverlap`, its line-removal counts 0).

    Raises:
        ValueError: `ngram` < 1.
    """
    per_doc, short = [], 0
    for text in validation:
        h = window_hashes(text, ngram)
        if h.size:
            per_doc.append(h)
        else:
            short += 1
    every = np.unique(np.concatenate(per_doc)) if per_doc else np.zeros(0, np.uint64)
    seen = np.zeros(every.size, dtype=bool)
    batch: list[np.ndarray] = []
    size = 0
    for text in train:
        if not every.size:
            break
        batch.append(window_hashes(text, ngram))
        size += batch[-1].size
        if size >= 1 << 20:
            _mark(every, seen, batch)
            batch, size = [], 0
    _mark(every, seen, batch)
    windows = hits = mostly = 0
    for h in per_doc:
        found = seen[np.searchsorted(every, h)]
        windows += h.size
        hits += int(found.sum())
        mostly += bool(found.mean() > MOSTLY)
    return ValidationOverlap(ngram=ngram, validation_windows=windows,
                             validation_windows_in_train=hits,
                             validation_documents=len(per_doc),
                             validation_documents_mostly_in_train=mostly,
                             validation_documents_short=short)


def _mark(every: np.ndarray, seen: np.ndarray, batch: list[np.ndarray]) -> None:
    """Set `seen` where a hash of `every` (sorted, unique) occurs in `batch`."""
    if not batch or not every.size:
        return
    found = np.concatenate(batch)
    pos = np.searchsorted(every, found)
    pos[pos == every.size] = 0
    seen[pos[every[pos] == found]] = True


def line_key(line: str) -> bytes | None:
    """The deduplication key of one line: blake2b (16 bytes) of its case-folded text with
    whitespace runs made one space and trimmed; None for a blank line (never removed)."""
    text = _SPACES.sub(" ", line.casefold()).strip()
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest() if text else None


def dedup_validation_lines(validation: list[tuple[str, str, str]], train: Iterable[str],
                           min_chars: int) -> tuple[list[tuple[str, str, str]], LineDedup]:
    """Remove from the validation documents every line that occurs in a training document.

    Args:
        validation: `(id, text, source)` of every validation document, in split order.
        train: the training documents' texts (streamed once; unchanged).
        min_chars: a validation document left shorter than this (stripped) is dropped.

    Returns:
        The validation documents kept, each with its training lines removed (its other
        lines, their line ends and order unchanged, the result stripped), in order; and the
        counts (`LineDedup`).
    """
    keys = {k for _, text, _ in validation for k in map(line_key, text.splitlines()) if k}
    in_train = ({k for text in train for k in map(line_key, text.splitlines()) if k in keys}
                if keys else set())
    kept, stats = [], LineDedup()
    for doc_id, text, source in validation:
        lines = text.splitlines(keepends=True)
        rest = [line for line in lines if line_key(line) not in in_train]
        if len(rest) == len(lines):
            kept.append((doc_id, text, source))
            continue
        stats.lines_removed += len(lines) - len(rest)
        new = "".join(rest).strip()
        stats.characters_removed += len(text) - len(new)
        if len(new) < min_chars:
            stats.documents_dropped += 1
        else:
            stats.documents_changed += 1
            kept.append((doc_id, new, source))
    return kept, stats


class LineDedup(BaseModel):
    """What `dedup_validation_lines` removed."""

    lines_removed: int = 0
    """Validation lines that occur in training, removed."""
    characters_removed: int = 0
    """Characters the validation split lost (lines, their line ends, trimmed space)."""
    documents_changed: int = 0
    """Validation documents kept with lines removed."""
    documents_dropped: int = 0
    """Validation documents left shorter than `ingest.min_chars`, dropped."""
