"""Progress reports of the stages (`mlm_pipeline.progress`): monotonic counts that end at the
stage's total, checked against the manifests' counts on the tiny fixtures; `LogProgress`
lines at a bounded rate; the terminal's `train` line from the metrics sink's records."""

from __future__ import annotations

import io
import itertools
import json
import logging
import math

import pyarrow.parquet as pq
import pytest
from pyarrow import ipc

from mlm_pipeline_flows.progress_display import RichProgress, SinkRecordHandler
from mlm_pipeline.config import IngestConfig
from mlm_pipeline.progress import LogProgress, MultiProgress
from mlm_pipeline.sinks import StdoutSink


class Recorder:
    """A `Progress` that keeps every call: the consumer under the stages, not under test."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, stage, total, unit, description=""):
        self.calls.append(("start", stage, total, unit))

    def update(self, stage, completed, **fields):
        self.calls.append(("update", stage, completed, fields))

    def finish(self, stage, **fields):
        self.calls.append(("finish", stage, None, fields))

    def stage(self, stage: str) -> tuple[float | None, list[float], dict]:
        """(total, counts reported with the final one = total, merged fields), checking
        that the stage started once, first, and finished once, last."""
        calls = [c for c in self.calls if c[1] == stage]
        assert calls[0][0] == "start" and calls[-1][0] == "finish", calls
        assert [c[0] for c in calls[1:-1]] == ["update"] * (len(calls) - 2)
        total = calls[0][2]
        counts = [c[2] for c in calls[1:-1]]
        fields: dict = {}
        for c in calls[1:]:
            fields.update(c[3])
        final = total if total is not None else (counts[-1] if counts else 0)
        return total, [*counts, final], fields


def _monotonic(xs) -> bool:
    return all(a <= b for a, b in itertools.pairwise(xs))


def test_ingest_reports_source_bytes_and_documents(tmp_path):
    files = []
    for part in range(2):  # two files, 700 records each: several updates, file boundaries
        path = tmp_path / f"docs{part}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(700):
                n = i if i % 7 else 0  # every 7th record repeats document 0: duplicates
                text = "ok" if i % 50 == 3 else (
                    f"Le document numéro {part}-{n} parle du chat qui dort sur le tapis.")
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        files.append(path)
    rec = Recorder()
    from mlm_pipeline.ingest import ingest

    m = ingest(IngestConfig(sources=[str(f) for f in files], min_chars=10), tmp_path / "work",
               rec)
    total, counts, fields = rec.stage("ingest")
    assert total == sum(f.stat().st_size for f in files)
    assert len(counts) >= 4 and _monotonic(counts) and counts[-1] == total
    assert fields["kept"] == m.documents_kept and fields["read"] == m.documents_read
    assert fields["dropped"] == sum(m.dropped.values()) > 0
    updates = [c[3] for c in rec.calls if c[0] == "update"]
    for key in ("kept", "dropped", "read"):
        assert _monotonic([u[key] for u in updates] + [fields[key]])
    # kept + dropped per record: 2 x 700 records, no split documents
    assert fields["kept"] + fields["dropped"] == 1400


def test_tokenizer_reports_sampling_then_training(tiny_corpus_manifest, tiny_tokenizer_config,
                                                  tmp_path):
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    rec = Recorder()
    m = train_tokenizer(tiny_tokenizer_config, tiny_corpus_manifest, tmp_path, rec)
    total, counts, fields = rec.stage("tokenizer")
    assert total == 2 and counts == [1.0, 2.0]
    lines = sum(1 for para in _train_texts(tiny_corpus_manifest) for line in para.splitlines()
                if line.strip())
    assert fields["candidates"] == m.sampled_from == lines
    assert fields["sentences"] == m.training_sentences


def _train_texts(corpus):
    return [t for e in corpus.train
            for t in pq.read_table(corpus.file(e.path), columns=["text"])["text"].to_pylist()]


def test_shards_report_documents_and_rows_per_split(
    tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_config, tmp_path
):
    from mlm_pipeline.shards.stage import write_shards

    rec = Recorder()
    m = write_shards(tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest,
                     tmp_path, progress=rec)
    for split, entries in (("train", tiny_corpus_manifest.train),
                           ("validation", tiny_corpus_manifest.validation)):
        total, counts, _ = rec.stage(f"shards {split}")
        documents = sum(pq.read_metadata(tiny_corpus_manifest.file(e.path)).num_rows
                        for e in entries)
        assert total == documents == getattr(m, split).documents
        assert _monotonic(counts) and counts[-1] == total
        rows = [c[3]["rows"] for c in rec.calls
                if c[1] == f"shards {split}" and c[0] != "start" and "rows" in c[3]]
        written = sum(ipc.open_file(m.file(s.path)).read_all().num_rows
                      for s in getattr(m, split).shards)
        assert _monotonic(rows) and rows[-1] == written == getattr(m, split).rows
    assert len(rec.stage("shards train")[1]) > 3  # encode batches of 4 documents


def test_evaluation_reports_batches(tiny_model_config, tiny_shard_manifest):
    import torch

    from mlm_pipeline.config import MaskingConfig
    from mlm_pipeline.evaluate.stage import masked_lm_metrics
    from mlm_pipeline.masking import KeyedMasking
    from mlm_pipeline.train import BertMLM
    from mlm_pipeline.train.data import ShardDataset

    torch.manual_seed(0)
    model = BertMLM(tiny_model_config, tiny_shard_manifest.vocab_size, tiny_shard_manifest.seq_len)
    data = ShardDataset(tiny_shard_manifest, "validation")
    rec = Recorder()
    metrics = masked_lm_metrics(model, data, batch_size=3, progress=rec,
                                masking=KeyedMasking(MaskingConfig(),
                                                     tiny_shard_manifest.vocab_size, seed=1))
    total, counts, fields = rec.stage("evaluate")
    assert metrics["eval/rows"] == len(data)
    assert total == math.ceil(len(data) / 3)
    assert counts == [float(k) for k in range(int(total) + 1)]
    assert fields["masked_tokens"] == metrics["eval/masked_tokens"]


def test_log_progress_is_rate_bounded_with_a_fake_clock(caplog):
    now = [0.0]
    log = LogProgress(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.progress"):
        log.start("stage", 100.0, "items")
        for k in range(1, 101):  # one update a second for 100 s
            now[0] = float(k)
            log.update("stage", float(k))
        log.finish("stage")
    lines = [r.getMessage() for r in caplog.records if r.name == "mlm_pipeline.progress"]
    # t = 1 (the first), then 11, 21, ..., 91 (10 s apart), then the last at finish
    assert len(lines) == 1 + 9 + 1
    assert "100/100 items (100.0 %)" in lines[-1]


def test_a_stage_logs_first_and_last_lines_only_within_the_interval(
    tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_config, tmp_path, caplog
):
    from mlm_pipeline.shards.stage import write_shards

    rec = Recorder()
    frozen = LogProgress(interval_s=60.0, clock=lambda: 0.0)  # no time passes
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.progress"):
        write_shards(tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest,
                     tmp_path, progress=MultiProgress(frozen, rec))
    for split in ("train", "validation"):
        updates = [c for c in rec.calls if c[1] == f"shards {split}" and c[0] == "update"]
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "mlm_pipeline.progress" and f"shards {split}" in r.getMessage()]
        assert len(updates) >= 1 and len(lines) == 2  # the first update and the finish


def test_training_line_comes_from_the_sink_records():
    rec = Recorder()
    handler = SinkRecordHandler(rec, max_steps=30)
    log = logging.getLogger("test_progress.sink")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        sink = StdoutSink(log=log)
        for step in (10, 20, 30):
            sink.log({"train/loss": 6.0 - step / 10, "train/tokens_per_s": 1234.5 * step}, step)
    finally:
        log.removeHandler(handler)
    updates = [c for c in rec.calls if c[0] == "update"]
    assert rec.calls[0] == ("start", "train", 30.0, "steps")
    assert [u[2] for u in updates] == [10.0, 20.0, 30.0]
    assert updates[-1][3] == {"loss": 3.0, "tokens/s": 37035.0}


def test_rich_display_shows_each_stage_in_its_units():
    from rich.console import Console

    out = io.StringIO()
    bars = RichProgress(Console(file=out, width=160, force_terminal=False))
    bars.start("ingest", 3 * 2**20, "bytes")
    bars.start("shards train", None, "rows")
    bars.update("ingest", 2**20, kept=10, dropped=2)
    bars.update("shards train", 40)
    bars.finish("ingest", kept=30, dropped=4)
    bars.finish("shards train")
    bars.bars.console.print(bars.bars.get_renderable())
    text = out.getvalue()
    assert "3.0/3.0 MiB | kept 30 | dropped 4" in text
    assert "40 rows" in text


@pytest.mark.parametrize("bad", ["step %d", "other"])
def test_other_records_are_not_training_progress(bad):
    rec = Recorder()
    SinkRecordHandler(rec, 5).emit(logging.LogRecord("x", logging.INFO, "", 0, bad, (1,), None))
    assert rec.calls == []
