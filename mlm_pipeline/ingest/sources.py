"""Input sources of the ingestion stage: resolution, content hashes and byte streams.

A source is a local path or an fsspec URL (`s3://`, `https://`, `file://`; fsspec is
imported only for URLs). This module expands `IngestConfig.sources` into files, hashes
their bytes (the stage's cache key, remembered by `mlm_pipeline.ingest.hashing`), and opens
them as streams: decompressed by suffix (`.gz`, `.bz2`, `.xz` with Python's stdlib, `.zst`
with pyarrow's zstd codec, so no extra dependency) and, for text, transcoded to UTF-8 when
a UTF-16 or UTF-32 byte-order mark is present (not a repair). A truncated or corrupt
compressed stream is a `BadFileError` (a `ValueError`) that names the file
(`open_compressed`). Lines are split and UTF-8 decoded here, with the repairs counted by
`mlm_pipeline.ingest.readers`: a UTF-8 BOM (`bom`), invalid bytes or lone surrogates
(`invalid_utf8`), NUL (`nul`). Which files a directory or glob holds is
`mlm_pipeline.ingest.listing`'s.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import logging
import lzma
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pyarrow as pa

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import corpora
from mlm_pipeline.ingest.allowed import confine
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.ingest.listing import (
    SUPPORTED_SUFFIXES, local_files, skipped_warning, special_warning, supported,
)
from mlm_pipeline.manifest import SkippedFile

logger = logging.getLogger(__name__)

#: An input: a local path, or an fsspec URL string (`s3://b/k.jsonl`, `file:///d/a.txt`).
Source = Path | str
_CHUNK = 1 << 20  # bytes read at a time
#: Compression of each suffix, as error messages name it.
_CODECS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
#: What decompressors (and pyarrow's Parquet reader) raise on damaged data: EOFError for
#: a truncated gzip/bzip2/xz stream, zlib.error and gzip.BadGzipFile (an OSError), lzma's
#: LZMAError, a plain OSError from bz2 ("Invalid data stream") and pyarrow (zstd, Parquet
#: pages), pyarrow's ArrowInvalid (a truncated or empty Parquet file).
DAMAGED_DATA_ERRORS = (EOFError, zlib.error, lzma.LZMAError, pa.ArrowException, OSError)
_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
# Longest BOM first: the UTF-32-LE BOM begins with the UTF-16-LE one.
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
              (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


class BadFileError(ValueError):
    """An input file that cannot be read as its format (truncated or corrupt compressed
    stream or Parquet file, `.json` that is not one array, missing text column, CSV quote
    never closed). The message starts with the file's path or URL; `reason` is a short
    code (`corrupt_compressed`, `corrupt_parquet`, `not_json_array`, `json_extra_data`,
    `missing_text_column`, `text_column_type`, `unclosed_csv_quote`) for the manifest."""

    def __init__(self, path: Source, reason: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path, self.reason = path, reason


def resolve_sources(cfg: IngestConfig, skipped: list[SkippedFile] | None = None
                    ) -> list[Source]:
    """Expand `cfg.sources` into input files, in order (directories and globs sorted):
    local paths, or URLs (`s3://`, `file://`...) resolved with fsspec. Only regular files
    are returned; every other entry of a directory or glob (a file of an unsupported type,
    a FIFO, a device, a symlink loop or dangling link...) is skipped, named with its kind
    in a warning and, when `skipped` is given, appended to it. With
    `cfg.allowed_sources` set, a file that an entry inside an allowed root expands to but
    that resolves outside every allowed root (a file symlink leading out) is skipped the
    same way, as `outside_allowed_sources` (`mlm_pipeline.ingest.allowed.confine`).

    Raises:
        FileNotFoundError: an entry matches no file (the entry is named).
        ValueError: a file has an unsupported extension (the file is named), or an
            unknown `debian:` name.
        RuntimeError: a `debian:` corpus cannot be fetched.
        ImportError: a URL's protocol needs a package that is missing (`fsspec`, or
            e.g. `s3fs` for `s3://`; fsspec's message names it).
    """
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else corpora.default_cache_dir()
    files: list[Source] = []
    for entry in cfg.sources:
        if entry.startswith("debian:"):
            files += corpora.fetch_debian_corpus(entry.removeprefix("debian:"), cache_dir)
            continue
        here: list[SkippedFile] = []
        found = resolve_url(entry, here) if is_url(entry) else local_files(entry, here)
        found = _confined(entry, found, cfg, here, warn=True)
        _check_found(entry, found, here)
        files += [f if is_url(f) else f.resolve() for f in found]
        if skipped is not None:
            skipped += here
    return files


def check_local_sources(cfg: IngestConfig) -> None:
    """Check the local entries of `cfg.sources` (paths, directories, globs) as
    `resolve_sources` would, without fetching `debian:` corpora or listing URLs: the CLI
    calls it before starting Prefect, so a mistyped path fails at once.

    Raises:
        FileNotFoundError: a local entry matches no file (the entry is named).
        ValueError: a file has an unsupported extension (the file is named).
    """
    for entry in cfg.sources:
        if not (entry.startswith("debian:") or is_url(entry)):
            here: list[SkippedFile] = []
            found = _confined(entry, local_files(entry, here, warn=False), cfg, here, warn=False)
            _check_found(entry, found, here)  # ingest warns


def _confined(entry: str, found: list[Source], cfg: IngestConfig, skipped: list[SkippedFile],
              warn: bool) -> list[Source]:
    """`found` less the files leading outside `cfg.allowed_sources` (`allowed.confine`),
    which are appended to `skipped` and, when `warn`, named in a warning."""
    outside: list[SkippedFile] = []
    kept = confine(entry, found, cfg.allowed_sources, outside)
    if outside:
        if warn:
            special_warning(entry, outside, None)
        skipped += outside
        skipped.sort(key=lambda s: Path(s.path))
    return kept


def _check_found(entry: str, found: list[Source], skipped: list[SkippedFile]) -> None:
    if not found:
        p = Path(entry).expanduser()
        if p.is_dir() and (every := sorted(f.name for f in p.rglob("*") if f.is_file())):
            raise FileNotFoundError(
                f"ingest.sources: directory {entry!r} has no file of a supported type "
                f"({', '.join(SUPPORTED_SUFFIXES)}); it holds {len(every)} other files, "
                f"e.g. {', '.join(every[:3])}")
        kinds = ", ".join(f"{s.path} ({s.reason})" for s in skipped[:3])
        raise FileNotFoundError(f"ingest.sources: {entry!r} matches no file" + (
            f"; skipped: {kinds}{', ...' if len(skipped) > 3 else ''}" if skipped else ""))
    for f in found:
        if not supported(source_name(f)):
            raise ValueError(f"ingest.sources: {f}: unsupported file type; expected "
                             f"one of {', '.join(SUPPORTED_SUFFIXES)}")


def content_hash(path: Source, work_dir: str | Path | None = None) -> str:
    """sha256 of a source's bytes (a URL's streamed), remembered in `work_dir`'s hash
    memo (`mlm_pipeline.ingest.hashing`), or in this process without one: the
    orchestrator's cache key (`ingest_digest`) and `ingest` itself both need it, and an
    unchanged corpus should not be read, or downloaded, again to find it unchanged.

    Raises:
        OSError: the file cannot be read.
    """
    if is_url(path):
        return url_size_and_sha256(path, work_dir)[1]
    return HashMemo(work_dir).file_sha256(path)


def source_size(path: Source, work_dir: str | Path | None = None) -> int:
    """Bytes of a source file (local, or a URL's through the hash memo of `work_dir`)."""
    return url_size_and_sha256(path, work_dir)[0] if is_url(path) else path.stat().st_size


def is_url(source: Source) -> bool:
    """Whether a source is an fsspec URL (`s3://...`, `file://...`), not a local path."""
    return isinstance(source, str) and "://" in source


def source_name(source: Source) -> str:
    """The basename of a local path or URL (document ids and manifests use it)."""
    return source.rstrip("/").rsplit("/", 1)[-1] if is_url(source) else Path(source).name


def open_raw(source: Source) -> IO[bytes]:
    """Open a local file or URL for binary reading (no decompression)."""
    if is_url(source):
        import fsspec  # only for URL sources: keeps local reading free of it

        return fsspec.open(source, "rb").open()
    return open(source, "rb")


def resolve_url(entry: str, skipped: list[SkippedFile] | None = None) -> list[str]:
    """The files of an fsspec URL (a file, a directory searched recursively for
    supported suffixes, or a glob), sorted, as URLs with their protocol. Entries of a
    directory that are not files of a supported type are named in a warning and appended
    to `skipped` when given."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(entry)
    if fs.isdir(path):
        every = fs.find(path, detail=True)
        files = [p for p, info in every.items() if info.get("type") == "file"]
        found = [p for p in files if supported(p)]
        other = [SkippedFile(path=fs.unstrip_protocol(p), reason="unsupported_type")
                 for p in files if not supported(p)]
        other += [SkippedFile(path=fs.unstrip_protocol(p), reason=str(info.get("type")))
                  for p, info in every.items() if info.get("type") not in ("file", "directory")]
        skipped_warning(entry, [p for p in files if not supported(p)])
        special_warning(entry, [o for o in other if o.reason != "unsupported_type"], None)
        if skipped is not None:
            skipped += sorted(other, key=lambda o: o.path)
    elif fs.isfile(path):
        found = [path]
    else:
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    return [fs.unstrip_protocol(p) for p in sorted(found)]


def url_size_and_sha256(url: str, work_dir: str | Path | None = None) -> tuple[int, str]:
    """(bytes, sha256 of the bytes) of a URL's file, streamed; remembered by its version
    id or ETag in `work_dir`'s hash memo (`HashMemo.url_size_and_sha256`)."""
    return HashMemo(work_dir).url_size_and_sha256(url)


def is_damaged_data(e: BaseException) -> bool:
    """Whether an exception of `DAMAGED_DATA_ERRORS` reports damaged data rather than a
    failed read: an OSError of the system (errno set) or a subclass such as
    FileNotFoundError or PermissionError is a read failure, not damage."""
    if isinstance(e, OSError):
        return type(e) in (OSError, gzip.BadGzipFile) and e.errno is None
    return isinstance(e, DAMAGED_DATA_ERRORS)


class _Decompressed:
    """A decompressing stream whose errors on damaged data are `ValueError`s naming the
    file, so that the CLI prints them as one line (the original error is the cause)."""

    def __init__(self, path: Source, stream: IO[bytes], codec: str) -> None:
        self._path, self._stream, self._codec = path, stream, codec

    def read(self, n: int = -1) -> bytes:
        """Up to `n` decompressed bytes (b"" at the end).

        Raises:
            BadFileError: the stream is truncated or corrupt (the file is named).
        """
        try:
            return self._stream.read(n)
        except DAMAGED_DATA_ERRORS as e:
            if not is_damaged_data(e):
                raise
            raise BadFileError(self._path, "corrupt_compressed",
                               f"truncated or corrupt {self._codec} stream: {e}") from e

    def close(self) -> None:
        """Close the decompressor."""
        self._stream.close()


def open_compressed(path: Source) -> tuple[IO[bytes], list[IO[bytes]]]:
    """Open a file for binary reading, decompressing by its suffix (streaming).

    Returns:
        The stream and every handle to close when done (the stream and the raw file).
        Reading a truncated or corrupt compressed stream raises a `BadFileError` (a
        `ValueError`) that starts with the file's path or URL, raised from the
        decompressor's error.
    """
    name, raw = source_name(path), open_raw(path)
    if name.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
    elif name.endswith(".bz2"):
        stream = bz2.BZ2File(raw)
    elif name.endswith(".xz"):
        stream = lzma.LZMAFile(raw)
    elif name.endswith(".zst"):
        stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")
    else:
        return raw, [raw]
    wrapped = _Decompressed(path, stream, _CODECS[name[name.rindex("."):]])
    return wrapped, [wrapped, raw]


class _Chunks(io.RawIOBase):
    """A readable raw stream over an iterator of byte chunks (closes `owners` on close)."""

    def __init__(self, chunks: Iterator[bytes], owners: list[IO[bytes]]) -> None:
        super().__init__()
        self._chunks, self._owners, self._buf = chunks, owners, b""

    def readable(self) -> bool:
        """Always True: this stream is read-only."""
        return True

    def readinto(self, b) -> int:
        """Fill `b` from the next chunks; returns the bytes copied (0 at the end)."""
        while not self._buf:
            if (chunk := next(self._chunks, None)) is None:
                return 0
            self._buf = chunk
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n

    def close(self) -> None:
        """Close the underlying streams."""
        for owner in self._owners:
            owner.close()
        super().close()


def open_utf8(path: Source) -> io.BufferedReader:
    """Open a text file as a stream of UTF-8 bytes: decompressed, and transcoded from
    UTF-16/UTF-32 when it starts with their byte-order mark (the BOM is removed).

    Invalid UTF-16/32 (lone surrogates, a truncated last unit) becomes bytes that are
    invalid UTF-8, so the UTF-8 decoder downstream replaces and counts them. Reading a
    truncated or corrupt compressed file raises a `ValueError` naming it
    (`open_compressed`).
    """
    raw, owners = open_compressed(path)
    head = b""
    while len(head) < 4 and (more := raw.read(4 - len(head))):
        head += more
    encoding = next((enc for bom, enc in _WIDE_BOMS if head.startswith(bom)), None)

    def passthrough() -> Iterator[bytes]:
        yield head
        while chunk := raw.read(_CHUNK):
            yield chunk

    def transcode() -> Iterator[bytes]:
        dec = codecs.getincrementaldecoder(encoding)(errors="surrogatepass")
        chunk = head
        while chunk:
            yield dec.decode(chunk).encode("utf-8", "surrogatepass")
            chunk = raw.read(_CHUNK)
        try:
            yield dec.decode(b"", final=True).encode("utf-8", "surrogatepass")
        except UnicodeDecodeError:  # a truncated last code unit
            yield b"\xff"

    chunks = passthrough() if encoding is None else transcode()
    return io.BufferedReader(_Chunks(chunks, owners), buffer_size=_CHUNK)


def raw_lines(f: IO[bytes], chunk_bytes: int = _CHUNK, eol: re.Pattern = _EOL) -> Iterator[bytes]:
    """Lines of a binary stream split on `eol` (default `\\r\\n`, `\\r` or `\\n`; the
    only alternative used is `\\n`), terminators removed; memory holds one chunk plus the
    current line, and a long line is joined once, not re-concatenated per chunk."""
    cr = eol is _EOL
    parts: list[bytes] = []  # pieces of the current, unfinished line
    while chunk := f.read(chunk_bytes):
        if b"\n" not in chunk and not (cr and b"\r" in chunk):
            parts.append(chunk)
            continue
        buf = b"".join(parts) + chunk if parts else chunk
        parts = []
        # A final "\r" may be the first half of "\r\n": keep it for the next chunk.
        end = len(buf) - 1 if cr and buf.endswith(b"\r") else len(buf)
        cut = max(buf.rfind(b"\n", 0, end), buf.rfind(b"\r", 0, end) if cr else -1)
        if cut < 0:
            parts = [buf]
            continue
        yield from eol.split(buf[:cut + 1])[:-1]
        if cut + 1 < len(buf):
            parts = [buf[cut + 1:]]
    buf = b"".join(parts)
    if buf:
        yield from eol.split(buf)[:-1] if eol.search(buf[-1:]) else eol.split(buf)


def decode(raw: bytes, first: bool) -> tuple[str, set[str]]:
    """Decode one UTF-8 line; returns the text and the repairs made (BOM, invalid
    UTF-8, NUL)."""
    fixes = set()
    if first and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
        fixes.add("bom")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        fixes.add("invalid_utf8")
    if "\x00" in text:
        text = text.replace("\x00", "")
        fixes.add("nul")
    return text, fixes
