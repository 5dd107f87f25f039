"""Incremental parsing of a `.json` input: one top-level array, element by element.

Memory holds the largest element (or a chunk of text), never the file. A syntax error
inside the array loses only the damaged text: parsing resumes at the next element, found
as the first `,` after the error whose following value parses and is itself followed by
`,` or `]` (or the array's closing `]`, when only whitespace follows it). The damaged span
is reported as a `Damage`: its first element number and the number of elements it is
counted as (one, plus one per resume point that failed in it; a comma inside a damaged
element's strings, after the error, can make this count higher than the elements lost,
never lower unless the damage removed a separator). A file that ends inside the array
ends in one damaged span. Text after a `]` that seemed to close the array is damage too
once the file had damage (that `]` may have belonged to a damaged element), else the file
is bad (`json_extra_data`).

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import IO, Any, NamedTuple

from mlm_pipeline.ingest.sources import BadFileError, Source

_NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")  # characters that may continue a JSON number
_WS = re.compile(r"[ \t\r\n]*")
_SEPARATOR = re.compile(r"[,\]]")
# A parse error this close to the end of the buffered text may be an element cut there
# (a literal, an escape such as the surrogate pair \ud83d\ude00): read more first.
_CUT_MARGIN = 16


class Damage(NamedTuple):
    """A span of the array that could not be parsed.

    Attributes:
        first: number (from 1) of the first element it is counted as.
        elements: elements it is counted as (at least 1).
        at: character offset of the first error (after any BOM).
        why: the decoder's message at that error.
        resumed: character offset of the next element, or of the array's closing `]`;
            None when the file ends inside the array.
    """

    first: int
    elements: int
    at: int
    why: str
    resumed: int | None


def array_items(f: IO[str], path: Source, chunk: int) -> Iterator[Any | Damage]:
    """Parse a text stream holding one JSON array, element by element.

    Args:
        f: the text (any BOM already consumed); read `chunk` characters at a time.
        path: the file, for error messages.
        chunk: characters per read.

    Yields:
        Each element's value in file order, and a `Damage` in place of every damaged span.

    Raises:
        BadFileError: the text is not an array (`not_json_array`), or has anything but
            whitespace after the array's closing `]` (`json_extra_data`); the message names
            the character offset.
    """
    return _Parser(f, path, chunk).items()


class _Parser:
    """The state of one parse: a window `buf` on the text and the position in it."""

    def __init__(self, f: IO[str], path: Source, chunk: int) -> None:
        self.f, self.path, self.chunk, self.want = f, path, chunk, chunk
        self.dec = json.JSONDecoder()
        # buf[pos:] is unparsed; `done` characters precede buf, for offsets.
        self.buf, self.pos, self.done, self.eof = "", 0, 0, False

    def fill(self) -> bool:
        """Append more text (dropping what precedes `pos`); False at end of file."""
        more = self.f.read(self.want)
        self.buf, self.done, self.pos = self.buf[self.pos:] + more, self.done + self.pos, 0
        self.eof = not more
        return bool(more)

    def peek(self) -> str:
        """Skip whitespace; the next character ("" at end of file)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.fill():
                return self.buf[self.pos:self.pos + 1]

    def decode(self) -> tuple[bool, Any, int, str]:
        """Decode the value at `pos`: `(True, value, end, "")` or `(False, None, error
        position, message)` (positions index `buf`). Failing near the buffer's end (or
        inside a string still open there) may be an element cut by it, and so may a number
        with only number characters after it up to the end ("0." of "0.5"): read more and
        parse again; twice as much per retry keeps a large element linear. An error
        earlier in the text is final, so a syntax error never reads the rest of a large
        file into memory."""
        while True:
            try:
                obj, end = self.dec.raw_decode(self.buf, self.pos)
            except RecursionError:  # nested deeper than the decoder's recursion limit
                return False, None, self.pos, "value nested too deeply"
            except ValueError as e:
                if not self.eof and _maybe_cut(e, self.buf):
                    self.fill()
                    self.want *= 2
                    continue
                return False, None, getattr(e, "pos", self.pos), getattr(e, "msg", str(e))
            if (not self.eof and type(obj) in (int, float)
                    and _NUMBER_TAIL.fullmatch(self.buf, end)):
                self.fill()
                self.want *= 2
                continue
            self.want = self.chunk
            return True, obj, end, ""

    def resync(self, start: int) -> tuple[str, int]:
        """Move `pos` past the next `,` or `]` at or after buffer index `start`; returns
        that character and its offset in the file (`("", -1)` at end of file)."""
        while (m := _SEPARATOR.search(self.buf, start)) is None:
            self.pos = len(self.buf)
            if not self.fill():
                return "", -1
            start = 0
        self.pos = m.end()
        return m.group(), self.done + m.start()

    def items(self) -> Iterator[Any | Damage]:
        """The array's elements and damaged spans, in file order (see `array_items`)."""
        if self.peek() != "[":
            raise BadFileError(self.path, "not_json_array",
                               "a .json input must be a top-level array of objects")
        self.pos += 1
        if self.peek() == "]":
            self.pos += 1
            if self.peek():
                raise self.extra_data()
            return
        k, damage, had_damage = 0, None, False  # damage: [first, elements, at, why]
        while True:
            if not self.peek():  # the file ends inside the array
                yield Damage(*(damage or [k + 1, 1, self.done + self.pos,
                                          "the file ends inside the array"]), None)
                return
            start = self.done + self.pos
            ok, obj, end, why = self.decode()
            if ok:
                self.pos = end
                sep = self.peek()
                if sep in (",", "]"):
                    if damage is not None:
                        yield Damage(*damage, start)
                        k, damage = k + damage[1], None
                    k += 1
                    yield obj
                    self.pos += 1
                    if sep == ",":
                        continue
                    if not self.peek():  # the array's closing bracket
                        return
                    if not had_damage:
                        raise self.extra_data()
                    why = "data after a ']' (which belonged to a damaged element)"
                else:
                    why = f"expected ',' or ']' after element {k + 1}, found {sep!r}"
                end = self.pos
            had_damage = True
            if damage is None:
                damage = [k + 1, 1, self.done + end, why]
            else:  # a resume point that failed: count it as one more element
                damage[1] += 1
            while True:
                found, at = self.resync(end)
                if found == ",":
                    break
                if not found:
                    yield Damage(*damage, None)
                    return
                if not self.peek():  # the array's closing bracket
                    yield Damage(*damage, at)
                    return
                end = self.pos  # a ']' inside the damage: look further

    def extra_data(self) -> BadFileError:
        """The error for text after the array's closing `]` (at `pos`)."""
        return BadFileError(self.path, "json_extra_data",
                            f"char {self.done + self.pos}: extra data after the closing "
                            "']' of the top-level array")


def _maybe_cut(err: ValueError, buf: str) -> bool:
    """Whether a failure of `raw_decode` on `buf` may come from the end of `buf` cutting
    the element (only more text can tell), rather than from a syntax error before it."""
    if not isinstance(err, json.JSONDecodeError):
        return True
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf) - _CUT_MARGIN
