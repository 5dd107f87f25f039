"""Downstream classification tasks: reading a task's labelled rows and splitting them into
train, dev and test, fixed by a hash and recorded with a digest.

A task (`config.ClassificationTask`) is the shipped French review polarity set
(`probe_data`), a local CSV / JSONL / Parquet file with named text, optional second-text
and label columns, or a Hugging Face `datasets` dataset (`hf:NAME`, loaded lazily: the
package is only in the `bench` extra). Labels are strings (an integer label `2` is `"2"`).

Split (`split_task`), deterministic and independent of row order: exact duplicates (same
text and pair) are dropped, keeping the first (a duplicate with another label is an
error); within each class the rows are ordered by the hex sha256 of their key (the UTF-8
text, or text, NUL, pair); with `max_rows` below the number of rows n, each class keeps its
first `int(max_rows * n_c / n + 0.5)`; of the k_c rows kept, the first
`int(test_fraction * k_c + 0.5)` are test, the next `int(dev_fraction * (k_c - test) +
0.5)` dev, the rest train. Dev rows are therefore carved from the rows that are not test,
and a test row can never be a dev or train row. Each split lists the classes in order,
each in hash order. The split's digest (`TaskSplit.digest`, tag `digest.task.<name>`) is
the sha256 of the classes and of every row's split, class and key hash: two runs with the
same digest were scored on the same rows.

A task whose data cannot be obtained raises `DataUnavailable` (the evaluation skips it and
records why); malformed data raises `ValueError` naming the file and line or column.
Imports neither torch nor scikit-learn.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_pipeline.config import ClassificationTask, LinearProbeConfig
from mlm_pipeline.errors import DataUnavailable
from mlm_pipeline.evaluate.probe_data import polarity_csv, read_polarity_csv, read_utf8

logger = logging.getLogger(__name__)

#: `source` of the shipped set.
POLARITY = "polarity-fr-amazon"
#: Its CSV's classes as label strings (`probe_data.LABELS`: `-1` is class 0).
POLARITY_LABELS = ("-1", "1")
#: Prefix of a Hugging Face `datasets` source.
HF_PREFIX = "hf:"
#: File suffixes read as local task files.
FILE_SUFFIXES = (".csv", ".jsonl", ".parquet")

#: One labelled row: text, second text of a pair (None for single texts), label.
Row = tuple[str, str | None, str]


@dataclass(frozen=True)
class Rows:
    """One split of a task: texts, second texts (None for single-text tasks) and class ids
    (indices into `TaskSplit.classes`)."""

    texts: tuple[str, ...]
    pairs: tuple[str, ...] | None
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class TaskSplit:
    """A task's fixed train / dev / test split (module docstring)."""

    name: str
    classes: tuple[str, ...]
    """Label strings; class id `i` is `classes[i]`."""
    train: Rows
    dev: Rows
    test: Rows
    duplicates_dropped: int
    """Rows dropped as exact duplicates of an earlier one."""
    source: str
    """What was read: a file path or `hf:NAME[/CONFIG]:SPLIT`."""
    data_sha256: str | None
    """sha256 of the file read (None for a Hugging Face dataset)."""
    digest: str
    """sha256 (hex) of the split: which row is in which split with which class."""

    @property
    def num_classes(self) -> int:
        """Number of classes, C."""
        return len(self.classes)

    def record(self) -> dict[str, Any]:
        """What the evaluation manifest records of the task: name, source, file sha256,
        split digest, classes and rows per split."""
        return {"name": self.name, "source": self.source, "data_sha256": self.data_sha256,
                "digest": self.digest, "classes": list(self.classes),
                "rows": {k: len(getattr(self, k)) for k in ("train", "dev", "test")},
                "duplicates_dropped": self.duplicates_dropped}


def load_task(task: ClassificationTask, cfg: LinearProbeConfig) -> TaskSplit:
    """Read and split `task` under `cfg`'s split settings (cached per file content and
    settings, so periodic evaluations read a file once).

    Args:
        task: the task.
        cfg: the `linear_probe` section: where the shipped set comes from (`data_path`,
            `archive_url`, `cache_dir`) and the split (`test_fraction`, `dev_fraction`,
            `max_rows`).

    Raises:
        DataUnavailable: the data cannot be obtained (a missing file, a failed fetch, no
            `datasets` package or no network for an `hf:` source).
        ValueError: malformed data (file and line or column named), an unknown file type,
            fewer than two classes, or a class left without train, dev or test rows.
    """
    if task.source == POLARITY:
        path = polarity_csv(cfg)
    elif task.source.startswith(HF_PREFIX):
        rows, dropped = deduplicate(read_hf_rows(task), task.source)
        return split_task(task.name, rows, cfg, dropped,
                          source=f"{task.source}:{task.hf_split}", data_sha256=None)
    else:
        path = Path(task.source).expanduser()
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise ValueError(f"task {task.name}: {path} is not a {', '.join(FILE_SUFFIXES)} "
                             f"file, {POLARITY!r} or {HF_PREFIX}NAME")
        if not path.is_file():
            raise DataUnavailable(f"task {task.name}: {path} is not a file")
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return _file_split(task, str(path.resolve()), sha256, cfg.test_fraction,
                       cfg.dev_fraction, cfg.max_rows)


@functools.lru_cache(maxsize=8)
def _file_split(task: ClassificationTask, path: str, sha256: str, test_fraction: float,
                dev_fraction: float, max_rows: int | None) -> TaskSplit:
    """Read, deduplicate and split a task file (cached by path and content hash)."""
    rows, dropped = deduplicate(read_task_file(task, Path(path)), path)
    return split_task(task.name, rows, LinearProbeConfig(
        test_fraction=test_fraction, dev_fraction=dev_fraction, max_rows=max_rows),
        dropped, source=path, data_sha256=sha256)


def read_task_file(task: ClassificationTask, path: Path) -> list[Row]:
    """The rows of a local task file, in file order (duplicates kept).

    `polarity-fr-amazon`: `probe_data.read_polarity_csv`. `.csv`: a header row naming the
    columns, RFC 4180 quoting. `.jsonl`: one JSON object per line (blank lines skipped).
    `.parquet`: the named columns. A text cell must be a non-empty string, a label a
    string or an integer (or a bool), present in every row.

    Raises:
        ValueError: naming the file and the line (CSV, JSONL) or column (Parquet): not
            UTF-8, malformed CSV or JSON, a missing column or key, an empty text, a
            missing label, or no row at all.
    """
    if task.source == POLARITY:
        return [(text, None, POLARITY_LABELS[c]) for text, c in read_polarity_csv(path)]
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows = _parquet_rows(task, path)
    else:
        text = read_utf8(path)
        rows = _csv_rows(task, path, text) if suffix == ".csv" else _jsonl_rows(task, path, text)
    if not rows:
        raise ValueError(f"{path}: no labelled row")
    return rows


def _columns(task: ClassificationTask) -> list[str]:
    """The text, the pair's (when set) and the label column."""
    return [task.text_column, *([task.text_pair_column] if task.text_pair_column else []),
            task.label_column]


def _row(task: ClassificationTask, get: Any, where: str) -> Row:
    """One row from `get(column)` (KeyError when absent); ValueError naming `where`."""
    values = {}
    for col in _columns(task):
        try:
            values[col] = get(col)
        except KeyError:
            raise ValueError(f"{where}: no column {col!r}") from None
    texts = [values[col] for col in _columns(task)[:-1]]  # the text (and its pair)
    for col, value in zip(_columns(task), texts):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: {col!r} is {value!r}, not a non-empty text")
    label = values[task.label_column]
    if isinstance(label, bool | int):
        label = str(int(label))
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"{where}: label {task.label_column!r} is {label!r}, not a string "
                         "or an integer")
    return texts[0], texts[1] if len(texts) > 1 else None, label.strip()


def _csv_rows(task: ClassificationTask, path: Path, text: str) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows: list[Row] = []
    start = 1
    try:
        header = next(reader, None)
        if header is None:
            return rows
        missing = [c for c in _columns(task) if c not in header]
        if missing:
            raise ValueError(f"{path}:1: the header {header} lacks the column(s) {missing} "
                             f"of task {task.name}")
        index = {c: header.index(c) for c in _columns(task)}
        start = reader.line_num + 1
        for record in reader:
            if record:
                if len(record) != len(header):
                    raise ValueError(f"{path}:{start}: {len(record)} fields, the header has "
                                     f"{len(header)}")
                rows.append(_row(task, lambda c: record[index[c]], f"{path}:{start}"))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}:{start}: malformed CSV ({exc})") from exc
    return rows


def _jsonl_rows(task: ClassificationTask, path: Path, text: str) -> list[Row]:
    rows: list[Row] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        rows.append(_row(task, record.__getitem__, f"{path}:{number}"))
    return rows


def _parquet_rows(task: ClassificationTask, path: Path) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError... for a bad file
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from exc
    missing = [c for c in _columns(task) if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing} (columns: {table.column_names})")
    columns = {c: table.column(c).to_pylist() for c in _columns(task)}
    return [_row(task, lambda c, i=i: columns[c][i], f"{path}: row {i}")
            for i in range(table.num_rows)]


def read_hf_rows(task: ClassificationTask) -> list[Row]:
    """The rows of a Hugging Face `datasets` dataset (`hf:NAME` or `hf:NAME/CONFIG`,
    split `task.hf_split`); a `ClassLabel` label column gives its class names.

    Raises:
        DataUnavailable: `datasets` is not installed, or the dataset cannot be loaded (no
            network, an unknown name); the message says which.
        ValueError: a column is missing or a row is malformed.
    """
    try:
        import datasets
    except ImportError as exc:
        raise DataUnavailable(
            f"task {task.name}: {task.source} needs the `datasets` package: pip install "
            "'mlm-pipeline[bench]'") from exc
    name, _, config = task.source.removeprefix(HF_PREFIX).partition("/")
    try:
        ds = datasets.load_dataset(name, config or None, split=task.hf_split)
    except Exception as exc:  # ConnectionError, FileNotFoundError, DatasetNotFoundError...
        raise DataUnavailable(f"task {task.name}: cannot load the Hugging Face dataset "
                              f"{task.source} (split {task.hf_split}): {exc}") from exc
    missing = [c for c in _columns(task) if c not in ds.column_names]
    if missing:
        raise ValueError(f"{task.source}: no column(s) {missing} (columns: {ds.column_names})")
    feature = ds.features[task.label_column]
    names = getattr(feature, "names", None)
    rows = []
    for i, record in enumerate(ds):
        if names is not None and isinstance(record[task.label_column], int):
            record = {**record, task.label_column: names[record[task.label_column]]}
        rows.append(_row(task, record.__getitem__, f"{task.source}: row {i}"))
    return rows


def deduplicate(rows: list[Row], where: str = "<rows>") -> tuple[list[Row], int]:
    """Keep the first row of each exact (text, pair).

    Returns:
        The unique rows in order, and how many rows were dropped.

    Raises:
        ValueError: one (text, pair) carries two labels (naming `where` and the text).
    """
    first: dict[tuple[str, str | None], str] = {}
    for text, pair, label in rows:
        if first.setdefault((text, pair), label) != label:
            raise ValueError(f"{where}: the text {text[:60]!r}... appears with labels "
                             f"{first[(text, pair)]!r} and {label!r}")
    return [(t, p, lab) for (t, p), lab in first.items()], len(rows) - len(first)


def row_key(text: str, pair: str | None) -> str:
    """Hex sha256 of a row's UTF-8 text (text, NUL, pair for a pair): its place in the
    split order."""
    data = text if pair is None else f"{text}\x00{pair}"
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def ordered_classes(labels: set[str]) -> tuple[str, ...]:
    """The classes in numeric order when every label is a number, else in string order."""
    try:
        return tuple(sorted(labels, key=float))
    except ValueError:
        return tuple(sorted(labels))


def _half_up(x: float) -> int:
    return int(x + 0.5)


def split_task(name: str, rows: list[Row], cfg: LinearProbeConfig, duplicates_dropped: int = 0,
               *, source: str = "<rows>", data_sha256: str | None = None) -> TaskSplit:
    """The stratified train / dev / test split of unique rows (module docstring).

    Args:
        name: the task's name.
        rows: unique rows (`deduplicate`).
        cfg: `test_fraction`, `dev_fraction` and `max_rows` are read.
        duplicates_dropped, source, data_sha256: recorded in the result.

    Raises:
        ValueError: fewer than two classes, or a class with no train, dev or test row (the
            message names `linear_probe.max_rows`, `test_fraction` and `dev_fraction`).
    """
    classes = ordered_classes({label for _, _, label in rows})
    if len(classes) < 2:
        raise ValueError(f"task {name}: the data has {len(classes)} class(es), needs 2")
    by_class: dict[str, list[tuple[str, str, str | None]]] = {c: [] for c in classes}
    for text, pair, label in rows:
        by_class[label].append((row_key(text, pair), text, pair))
    n = len(rows)
    parts: dict[str, list[tuple[int, str, str, str | None]]] = {"train": [], "dev": [],
                                                                 "test": []}
    for cid, label in enumerate(classes):
        keyed = sorted(by_class[label])
        if cfg.max_rows is not None and cfg.max_rows < n:
            keyed = keyed[: _half_up(cfg.max_rows * len(keyed) / n)]
        n_test = _half_up(cfg.test_fraction * len(keyed))
        n_dev = _half_up(cfg.dev_fraction * (len(keyed) - n_test))
        if not (0 < n_test and 0 < n_dev and n_test + n_dev < len(keyed)):
            raise ValueError(
                f"task {name}: class {label!r} has {len(keyed)} row(s): {n_test} test, "
                f"{n_dev} dev, {len(keyed) - n_test - n_dev} train; every split needs one: "
                "raise linear_probe.max_rows or change linear_probe.test_fraction / "
                "dev_fraction")
        for split, chunk in (("test", keyed[:n_test]), ("dev", keyed[n_test:n_test + n_dev]),
                             ("train", keyed[n_test + n_dev:])):
            parts[split] += [(cid, *row) for row in chunk]
    digest = hashlib.sha256(json.dumps(
        {"classes": classes, **{split: [[cid, key] for cid, key, _, _ in part]
                                for split, part in parts.items()}}).encode()).hexdigest()
    pairs = any(pair is not None for _, pair, _ in rows)

    def as_rows(part: list[tuple[int, str, str, str | None]]) -> Rows:
        return Rows(texts=tuple(t for _, _, t, _ in part),
                    pairs=tuple(p or "" for _, _, _, p in part) if pairs else None,
                    labels=tuple(c for c, _, _, _ in part))

    return TaskSplit(name=name, classes=classes, train=as_rows(parts["train"]),
                     dev=as_rows(parts["dev"]), test=as_rows(parts["test"]),
                     duplicates_dropped=duplicates_dropped, source=source,
                     data_sha256=data_sha256, digest=digest)


def majority_rate(split: TaskSplit) -> float:
    """Accuracy on test of always predicting the most frequent class of train (ties: the
    lowest class id)."""
    counts = Counter(split.train.labels)
    majority = min(counts, key=lambda c: (-counts[c], c))
    return sum(c == majority for c in split.test.labels) / len(split.test)
