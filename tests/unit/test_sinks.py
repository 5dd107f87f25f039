"""Metrics sinks without MLflow: key rule, formatting, JSONL round trip, fan-out."""

from __future__ import annotations

import json
import logging

import pytest

from mlm_pipeline.sinks import (
    JsonlSink,
    MultiSink,
    StdoutSink,
    check_key,
    format_value,
    to_float,
)


@pytest.mark.parametrize(
    "key",
    ["train/loss", "train/tokens_per_s", "eval/mlm_accuracy", "memory/max_reserved_gib",
     "a b.c-d_e", "x" * 250],
)
def test_check_key_accepts_mlflow_legal_keys(key):
    check_key(key)


@pytest.mark.parametrize(
    "key",
    ["", "mfu(%)", "a:b", "train//loss", "train/", "/abs", "../up", "./a", ".", "é", "x" * 251],
)
def test_check_key_rejects_and_names_the_key(key):
    with pytest.raises(ValueError) as err:
        check_key(key)
    assert repr(key) in str(err.value)


@pytest.mark.parametrize(
    ("value", "text"),
    [(5.12345, "5.123"), (1e-3, "1.0e-03"), (12345.4, "12,345"), (0.0, "0"), (0.15, "0.15"),
     (-2.5e-5, "-2.5e-05"), (999.94, "999.9"), (float("nan"), "nan"), (float("-inf"), "-inf")],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_to_float_names_the_key():
    assert to_float("k", 3) == 3.0
    with pytest.raises(TypeError, match="'train/loss'"):
        to_float("train/loss", "high")


def test_stdout_sink_line(caplog):
    log = logging.getLogger("test_sinks.stdout")
    sink = StdoutSink(log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        sink.log({"train/loss": 5.1234, "train/lr": 0.001, "train/tokens_per_s": 12345.0}, 120)
    assert [r.getMessage() for r in caplog.records] == [
        "step 120 | train/loss 5.123 | train/lr 1.0e-03 | train/tokens_per_s 12,345"
    ]


def _strict_lines(path):
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


def test_jsonl_sink_round_trip(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    sink = JsonlSink(path)
    records = [({"train/loss": 2.5, "train/lr": 1e-4}, 10), ({"train/loss": float("nan")}, 20)]
    sink.log(*records[0])
    sink.flush()  # visible before close
    assert _strict_lines(path) == [{"step": 10, "train/loss": 2.5, "train/lr": 1e-4}]
    sink.log(*records[1])
    sink.close()
    sink.close()  # idempotent
    assert _strict_lines(path) == [
        {"step": 10, "train/loss": 2.5, "train/lr": 1e-4},
        {"step": 20, "train/loss": None},
    ]
    with pytest.raises(RuntimeError, match="closed"):
        sink.log({"train/loss": 1.0}, 30)

    resumed = JsonlSink(path, append=True)
    resumed.log({"train/loss": 1.5}, 30)
    resumed.close()
    assert [r["step"] for r in _strict_lines(path)] == [10, 20, 30]
    JsonlSink(path).close()  # default truncates
    assert path.read_text() == ""


def test_jsonl_sink_rejects_bad_keys(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="'step'"):
        sink.log({"step": 1.0}, 0)
    with pytest.raises(ValueError, match=r"'mfu\(%\)'"):
        sink.log({"mfu(%)": 1.0}, 0)
    sink.close()


class _Recorder:
    def __init__(self, fail_close: bool = False):
        self.records, self.closed, self.fail_close = [], False, fail_close

    def log(self, metrics, step):
        self.records.append((dict(metrics), step))

    def flush(self):
        pass

    def close(self):
        self.closed = True
        if self.fail_close:
            raise OSError("disk full")


def test_multi_sink_fans_out_and_checks_keys_first(tmp_path):
    a, b = _Recorder(), _Recorder()
    multi = MultiSink(a, b)
    multi.log({"train/loss": 1.0}, 3)
    assert a.records == b.records == [({"train/loss": 1.0}, 3)]
    with pytest.raises(ValueError):
        multi.log({"train/loss": 2.0, "bad:key": 1.0}, 4)
    assert len(a.records) == 1  # no sink saw the rejected record


def test_multi_sink_closes_all_then_raises():
    a, b = _Recorder(fail_close=True), _Recorder()
    with pytest.raises(OSError, match="disk full"):
        MultiSink(a, b).close()
    assert a.closed and b.closed


def test_format_value_threshold_is_inclusive():
    # 1000 switches to the thousands form; 0.01 stays in the 4-digit form.
    assert format_value(1000.0) == "1,000"
    assert format_value(0.01) == "0.01"
