"""Text cleaning helpers of the ingestion stage: screening of binary content and control
characters, splitting of oversized documents, the letter-share filter, the compact digest
set of exact deduplication and near-duplicate detection.

Imports neither torch nor prefect; `datasketch` (the optional `near-dedup` extra) only
when a `NearDuplicateFilter` is created.
"""

from __future__ import annotations

import re
from array import array

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
#: Share of a text's characters that are U+FFFD (bytes that were not valid UTF-8) or C0
#: control characters other than tab, line feed and carriage return, above which the text
#: is binary content, not text (dropped as `binary`). Measured: random bytes read as
#: UTF-8, 0.54-0.55 (about half of the bytes become U+FFFD, 1 in 9 is a control
#: character); an accent-heavy French sentence in Latin-1 read as UTF-8, 0.13 (so such a
#: text is kept, its accents repaired as `invalid_utf8`).
BINARY_SHARE = 0.3
#: ... and at least this many such characters: a short text with a replaced byte or two
#: ("caf\ufffd", "i\ufffdj") stays text (repaired as `invalid_utf8`).
BINARY_MIN_CHARS = 8
#: C0 controls that are whitespace (`str.isspace`: vertical tab, form feed, the file /
#: group / record / unit separators): they separate words, so a run of them becomes one space.
_CONTROL_SPACE = re.compile("[\x0b\x0c\x1c-\x1f]+")
#: The other C0 controls but NUL (`nul`), tab, line feed and carriage return: removed.
_CONTROL = re.compile("[\x01-\x08\x0e-\x1b]")
_SUSPECT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffd]")


def screen(text: str) -> tuple[str, tuple[str, ...] | str | None]:
    """Screen one record's text for binary content and control characters.

    Tab, line feed and carriage return (a line end, in `\\r\\n` or alone) are kept; NUL is
    the readers' (repair `nul`), though one still present counts as binary evidence. A run
    of C0 controls that are whitespace (vertical tab, form feed, U+001C-U+001F) becomes one
    space (repair `control_space`: `"one\\x0ctwo"` -> `"one two"`, never `"onetwo"`); other
    C0 controls are removed (repair `control`). Every other character is kept as it is.

    Returns:
        `(text, "binary")` when more than `BINARY_SHARE` of its characters, and at least
        `BINARY_MIN_CHARS`, are U+FFFD or C0 control characters (the text unchanged, to
        be dropped); else `(cleaned, repairs)`, `repairs` the tuple of the repairs made
        (`"control"`, `"control_space"`, in this order), None when none was made. One
        regex scan when the text has none of these characters.
    """
    if _SUSPECT.search(text) is None:
        return text, None
    suspect = sum(1 for _ in _SUSPECT.finditer(text))
    if suspect > BINARY_SHARE * len(text) and suspect >= BINARY_MIN_CHARS:
        return text, "binary"
    cleaned, removed = _CONTROL.subn("", text)
    cleaned, spaced = _CONTROL_SPACE.subn(" ", cleaned)
    repairs = (("control",) if removed else ()) + (("control_space",) if spaced else ())
    return (cleaned, repairs) if repairs else (text, None)


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


class DigestSet:
    """An exact set of 128-bit digests (exact deduplication) in flat arrays.

    Open addressing with linear probing (Knuth, The Art of Computer Programming vol. 3,
    section 6.4, Algorithm L) over two arrays of signed 64-bit integers (the digest's
    halves) and a byte array of used slots: 17 bytes per slot, at most `MAX_LOAD` of the
    slots used (the table doubles past it), so 24-49 bytes per digest, against about 116
    for a Python `set` of 16-byte `bytes` (CPython 3.11, measured). The home slot is the
    low bits of the digest's second half, uniform for a cryptographic digest.
    """

    #: Largest share of used slots before the table doubles.
    MAX_LOAD = 0.7

    def __init__(self, capacity: int = 1 << 16) -> None:
        """Start with `capacity` slots (rounded up to a power of two, at least 8)."""
        self._alloc(max(8, 1 << (max(capacity, 1) - 1).bit_length()))
        self._n = 0

    def _alloc(self, slots: int) -> None:
        self._used = bytearray(slots)
        self._hi = array("q", bytes(8 * slots))
        self._lo = array("q", bytes(8 * slots))
        self._mask = slots - 1
        self._limit = int(slots * self.MAX_LOAD)

    def add(self, digest: bytes) -> bool:
        """Insert `digest`; True when it was already in the set (nothing inserted).

        Raises:
            ValueError: `digest` is not 16 bytes long.
        """
        if len(digest) != 16:
            raise ValueError(f"DigestSet: digests are 16 bytes, got {len(digest)}")
        hi = int.from_bytes(digest[:8], "little", signed=True)
        lo = int.from_bytes(digest[8:], "little", signed=True)
        used, his, los, mask = self._used, self._hi, self._lo, self._mask
        i = lo & mask
        while used[i]:
            if los[i] == lo and his[i] == hi:
                return True
            i = (i + 1) & mask
        used[i], his[i], los[i] = 1, hi, lo
        self._n += 1
        if self._n > self._limit:
            self._grow()
        return False

    def _grow(self) -> None:
        old = zip(self._used, self._hi, self._lo)
        self._alloc(2 * (self._mask + 1))
        used, his, los, mask = self._used, self._hi, self._lo, self._mask
        for was_used, hi, lo in old:
            if was_used:
                i = lo & mask
                while used[i]:
                    i = (i + 1) & mask
                used[i], his[i], los[i] = 1, hi, lo

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's arrays."""
        return len(self._used) + 8 * (len(self._hi) + len(self._lo))
