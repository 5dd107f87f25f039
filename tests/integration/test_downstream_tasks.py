"""Downstream tasks a user brings: local CSV / JSONL / Parquet files with named columns,
text pairs, a Hugging Face `datasets` name (without the package: a clear reason), and the
split fixed by a hash with its digest. Files are written here."""

from __future__ import annotations

import csv
import hashlib
import json
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import ClassificationTask, LinearProbeConfig
from mlm_pipeline.errors import DataUnavailable
from mlm_pipeline.evaluate.stats import mean_sd, paired_difference
from mlm_pipeline.evaluate.tasks import load_task, read_task_file, split_task

#: 3 classes (labels as the file writes them), 30 rows each, premise/hypothesis pairs.
ROWS = [{"premise": f"Phrase numéro {i} sur le chat.", "hypothesis": f"Le chat {i % 7}.",
         "gold": ["entailment", "neutral", "contradiction"][i % 3]} for i in range(90)]
PAIR = dict(text_column="premise", text_pair_column="hypothesis", label_column="gold")
SPLIT = LinearProbeConfig(test_fraction=0.2, dev_fraction=0.25)


def write(path, rows):
    if path.suffix == ".csv":
        with path.open("w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_pair_task_from_each_file_type_splits_by_the_documented_rule(tmp_path, suffix):
    path = write(tmp_path / f"nli{suffix}", ROWS)
    got = load_task(ClassificationTask(name="nli", source=str(path), **PAIR), SPLIT)
    assert got.classes == ("contradiction", "entailment", "neutral")  # string order
    expected = {"train": [], "dev": [], "test": []}
    for cid, label in enumerate(got.classes):  # the rule, written out again
        keyed = sorted((hashlib.sha256(f"{r['premise']}\x00{r['hypothesis']}".encode())
                        .hexdigest(), r["premise"]) for r in ROWS if r["gold"] == label)
        k = int(0.2 * 30 + 0.5)
        d = int(0.25 * (30 - k) + 0.5)
        for split, part in (("test", keyed[:k]), ("dev", keyed[k:k + d]),
                            ("train", keyed[k + d:])):
            expected[split] += [(t, cid) for _, t in part]
    for split in ("train", "dev", "test"):
        rows = getattr(got, split)
        assert list(zip(rows.texts, rows.labels)) == expected[split], split
        by_text = {r["premise"]: r["hypothesis"] for r in ROWS}
        assert list(rows.pairs) == [by_text[t] for t in rows.texts]
    assert got.record()["rows"] == {"train": 54, "dev": 18, "test": 18}
    assert got.data_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_digest_is_the_rows_not_the_file_order(tmp_path):
    shuffled = ROWS[:]
    random.Random(1).shuffle(shuffled)
    task = dict(name="nli", **PAIR)
    a = load_task(ClassificationTask(source=str(write(tmp_path / "a.jsonl", ROWS)), **task),
                  SPLIT)
    b = load_task(ClassificationTask(source=str(write(tmp_path / "b.csv", shuffled)), **task),
                  SPLIT)
    assert a.digest == b.digest and a.test == b.test
    fewer = load_task(ClassificationTask(source=str(write(tmp_path / "c.jsonl", ROWS[:-3])),
                                         **task), SPLIT)
    assert fewer.digest != a.digest


def test_integer_labels_sort_numerically_and_single_texts_have_no_pairs(tmp_path):
    rows = [{"text": f"avis {i}", "stars": i % 11} for i in range(220)]
    got = load_task(ClassificationTask(name="stars", source=str(
        write(tmp_path / "s.parquet", rows)), label_column="stars"), SPLIT)
    assert got.classes == tuple(str(i) for i in range(11))  # "10" after "9"
    assert got.train.pairs is None


@pytest.mark.parametrize(("name", "content", "where"), [
    ("bad.csv", "texte,label\na,1\n", "bad.csv:1: the header"),
    ("bad.csv", "text,label\nbon,1\n,0\n", "bad.csv:3: 'text' is ''"),
    ("bad.jsonl", '{"text": "bon", "label": 1}\n{"text": "x"\n', "bad.jsonl:2: not JSON"),
    ("bad.jsonl", '{"text": "bon", "label": 1}\n\n{"text": "x"}\n', "bad.jsonl:3: no column"),
])
def test_malformed_files_name_the_file_and_line(tmp_path, name, content, where):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as err:
        read_task_file(ClassificationTask(name="t", source=str(path)), path)
    assert where in str(err.value)


def test_a_missing_file_or_package_is_unavailable_with_its_reason(tmp_path, monkeypatch):
    with pytest.raises(DataUnavailable, match="absent.csv is not a file"):
        load_task(ClassificationTask(name="t", source=str(tmp_path / "absent.csv")), SPLIT)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataUnavailable, match=r"needs the `datasets` package: pip install"):
        load_task(ClassificationTask(name="t", source="hf:allocine"), SPLIT)
    with pytest.raises(ValueError, match="not a .csv, .jsonl, .parquet file"):
        load_task(ClassificationTask(name="t", source=str(tmp_path / "x.txt")), SPLIT)


def test_a_class_too_small_for_every_split_is_refused():
    rows = [(f"t{i}", None, "a") for i in range(20)] + [("u", None, "b"), ("v", None, "b")]
    with pytest.raises(ValueError, match="class 'b' has 2 row"):
        split_task("t", rows, SPLIT)


def test_task_names_are_unique_and_safe():
    with pytest.raises(ValueError, match="unique"):
        LinearProbeConfig(tasks=[ClassificationTask(name="a"), ClassificationTask(name="a")])
    with pytest.raises(ValueError):
        ClassificationTask(name="a b")


def test_mean_sd_and_the_paired_t_interval():
    assert mean_sd([0.7]) == (0.7, 0.0)
    mean, sd = mean_sd([0.70, 0.72, 0.74])
    assert (mean, sd) == pytest.approx((0.72, 0.02))
    d = paired_difference([0.70, 0.72, 0.74], [0.68, 0.69, 0.69])
    # differences 0.02, 0.03, 0.05: mean 1/30, squared deviations summing to 7/15000, so
    # sd sqrt(7/30000); t(0.975, 2) = 4.302652729911275 (statistical tables).
    sd = (7 / 30000) ** 0.5
    assert (d.mean, d.sd, d.n) == pytest.approx((1 / 30, sd, 3))
    half = 4.302652729911275 * sd / 3 ** 0.5
    assert (d.low, d.high) == pytest.approx((1 / 30 - half, 1 / 30 + half))
    one = paired_difference([0.7], [0.6])
    assert one.mean == pytest.approx(0.1) and one.low != one.low  # NaN: no interval
