"""A work directory moved elsewhere: its stages are reused where they now are."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mlm_pipeline.config import IngestConfig, ShardConfig, TokenizerConfig
from mlm_pipeline.ingest.documents import write_training_text
from mlm_pipeline.ingest.hashing import MEMO_FILE
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.manifest import CorpusManifest, file_entry
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer.stage import Tokenizer, train_tokenizer
from mlm_pipeline.tracking.records import outputs_exist

TINY_FR = Path(__file__).parents[1] / "assets" / "tiny_fr.txt"


def _stages(work: Path):
    corpus = ingest(IngestConfig(sources=[str(TINY_FR)]), work)
    tok = train_tokenizer(TokenizerConfig(vocab_size=128), corpus, work)
    shards = write_shards(ShardConfig(seq_len=16, rows_per_shard=64), corpus, tok, work)
    return corpus, tok, shards


def _outputs(work: Path) -> dict[Path, int]:
    """mtime (ns) of every stage file, the work directory's hash memo aside."""
    return {p: p.stat().st_mtime_ns for p in work.rglob("*")
            if p.is_file() and not p.name.startswith(MEMO_FILE)}


def test_moved_work_dir_is_reused_in_place(tmp_path):
    before = _stages(tmp_path / "a")
    files = _outputs(tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "b")
    after = _stages(tmp_path / "b")
    a, b = (tmp_path / "a").resolve(), (tmp_path / "b").resolve()
    for old, new in zip(before, after):
        assert new.digest == old.digest
        assert Path(new.output_dir) == b / Path(old.output_dir).relative_to(a)
        assert outputs_exist(new)
    moved = _outputs(tmp_path / "b")
    # Nothing was rebuilt: the same files, untouched.
    assert {p.relative_to(tmp_path / "b"): t for p, t in moved.items()} == {
        p.relative_to(tmp_path / "a"): t for p, t in files.items()}
    assert Tokenizer.load(after[1]).path.is_relative_to(tmp_path / "b")


def test_large_string_text_column(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    texts = pa.array(["un\ndeux", "  ", "trois"], pa.large_string())
    pq.write_table(pa.table({"text": texts}), d / "train-00000.parquet")
    corpus = CorpusManifest.model_construct(
        output_dir=str(d), train=[file_entry(d, d / "train-00000.parquet", rows=3)])
    for k in (10, 2):
        written, total, _ = write_training_text(corpus, tmp_path / "t.txt", 100, k, seed=0)
        lines = (tmp_path / "t.txt").read_text().splitlines()
        assert (written, total) == (min(k, 3), 3)
        assert set(lines) <= {"un", "deux", "trois"} and len(lines) == written
