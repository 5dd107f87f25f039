"""Text cleaning helpers of the ingestion stage: splitting of oversized documents, the
letter-share filter and near-duplicate detection.

Imports neither torch nor prefect; `datasketch` (the optional `near-dedup` extra) only
when a `NearDuplicateFilter` is created.
"""

from __future__ import annotations

import re

#: MinHash permutations (datasketch's default; estimate error ~ 1/sqrt(128) = 0.09) and
#: word n-gram size of the shingles (5, as in Lee et al. 2022, "Deduplicating Training
#: Data Makes Language Models Better") of near-duplicate detection (Broder 1997).
MINHASH_PERMUTATIONS, SHINGLE_WORDS = 128, 5
# Cut points, searched right to left by a greedy `.*` (linear, in C): the position after
# the last non-space character followed by a blank line / sentence end + space / space.
_PARAGRAPH = re.compile(r"(?s).*\S()[^\S\n]*+\n[^\S\n]*+\n")
_SENTENCE = re.compile(r"(?s).*[.!?]()\s")
_SPACE = re.compile(r"(?s).*\S()\s")
_WHITESPACE = re.compile(r"\s+")
_WORD = re.compile(r"\S+")


def letter_share(text: str) -> float:
    """Share of letters (Unicode categories L*, `str.isalpha`) among the non-space
    characters of `text`; 0.0 for a text with no visible character."""
    visible = len(text) - sum(map(str.isspace, text))
    return sum(map(str.isalpha, text)) / visible if visible else 0.0


def split_text(text: str, max_chars: int) -> list[tuple[str, str]]:
    """Split a long document into parts of at most `max_chars` characters.

    Each cut is at the last blank line before the limit, else the last whitespace after
    `.`, `!` or `?`, else the last whitespace, else hard at the limit; the whole
    whitespace run at a cut is the separator. Linear time: each cut searches one window
    of `max_chars + 1` characters.

    Args:
        text: the document (any length).
        max_chars: largest part, in characters (>= 1).

    Returns:
        `(part, separator)` pairs with `"".join(p + s for p, s in pairs) == text`, every
        part at most `max_chars` long (one pair `(text, "")` when it already fits). A
        part is empty only if `text` starts with whitespace.
    """
    out: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while n - pos > max_chars:
        window_end = pos + max_chars + 1  # a separator may start right at the limit
        for pattern in (_PARAGRAPH, _SENTENCE, _SPACE):
            m = pattern.match(text, pos, window_end)
            if m is not None and m.start(1) > pos:
                cut = m.start(1)
                sep_end = _WHITESPACE.match(text, cut).end()
                break
        else:
            cut = sep_end = pos + max_chars  # no whitespace at all: hard cut
        out.append((text[pos:cut], text[cut:sep_end]))
        pos = sep_end
    if pos < n or not out:
        out.append((text[pos:], ""))
    return out


class NearDuplicateFilter:
    """Near-duplicate filter: MinHash (Broder 1997) of word 5-gram shingles, LSH index
    (`datasketch`) of kept documents; deterministic (fixed seed, reading order).

    A document is a near-duplicate when the LSH returns a kept candidate, i.e. its
    estimated Jaccard similarity is likely at least the threshold (the LSH bands are
    chosen by `datasketch` to balance false positives and negatives). Memory: the LSH
    index, about `MINHASH_PERMUTATIONS` * 8 bytes per kept document.

    Raises:
        ImportError: `datasketch` is missing (the message names the extra to install).
    """

    def __init__(self, threshold: float) -> None:
        try:
            from datasketch import MinHash, MinHashLSH  # optional: only when enabled
        except ImportError as e:
            raise ImportError("ingest.near_dedup_threshold needs the `datasketch` package: "
                              "pip install 'mlm-pipeline[near-dedup]'") from e
        self._minhash = MinHash
        self._lsh = MinHashLSH(threshold=threshold, num_perm=MINHASH_PERMUTATIONS)
        self._n = 0

    def is_duplicate(self, text: str) -> bool:
        """Whether `text` nearly duplicates a kept document; if not, keep it (index it)."""
        words = _WORD.findall(text)
        w = SHINGLE_WORDS
        mh = self._minhash(num_perm=MINHASH_PERMUTATIONS, seed=1)
        batch: list[bytes] = []
        for j in range(max(1, len(words) - w + 1)):  # a short text: one shingle
            batch.append(" ".join(words[j:j + w]).encode("utf-8"))
            if len(batch) >= 8192:  # bounded memory for a long text
                mh.update_batch(batch)
                batch = []
        if batch:
            mh.update_batch(batch)
        if self._lsh.query(mh):
            return True
        self._lsh.insert(self._n, mh)
        self._n += 1
        return False
