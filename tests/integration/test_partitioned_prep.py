"""Partitioned data preparation (`ingest.partitions`, `shards.parallel`) with a plain
in-process mapper (builtin `map`) writes the same bytes and manifests as one process.

Inputs: `tiny_fr.txt` cut into three `.txt` files (one with CRLF line ends) and one large
`.jsonl` holding every paragraph again (exact duplicates across files, which the merge must
drop in input order), blank lines and bad JSON lines, cut by byte range.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.partitions import partitioned, plan_partitions
from mlm_pipeline.ingest.sources import resolve_sources
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.shards.parallel import partitioned_encoder, plan_documents
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer

_VOLATILE = {"created_at", "wall_time_s", "output_dir"}


def _write_inputs(root: Path, paragraphs: list[str]) -> Path:
    """Three .txt files and one .jsonl under `root/in`; returns that directory."""
    src = root / "in"
    src.mkdir()
    thirds = [paragraphs[i::3] for i in range(3)]
    (src / "a.txt").write_text("\n\n".join(thirds[0]) + "\n", encoding="utf-8")
    (src / "b.txt").write_bytes(("\r\n\r\n".join(thirds[1]) + "\r\n").encode("utf-8"))
    (src / "c.txt").write_text("\n\n\n".join(thirds[2]), encoding="utf-8")
    lines = []
    for k, p in enumerate(paragraphs * 3):  # each paragraph three times: duplicates
        lines.append(json.dumps({"text": f"{p} ({k // len(paragraphs)})"}, ensure_ascii=False))
        if k % 7 == 3:
            lines.append("")  # a blank line: no record
        if k % 11 == 5:
            lines.append("{not json")  # bad_json
    lines.append(json.dumps({"text": "\n\n".join(paragraphs[:6])}))  # > 1000 chars
    lines.extend(json.dumps({"text": p}) for p in paragraphs[:5])  # duplicates of a.txt/b.txt
    (src / "z.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return src


def _tree_sha256(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` except the manifest, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def _stable(manifest) -> dict:
    return manifest.model_dump(mode="json", exclude=_VOLATILE)


@pytest.mark.parametrize("extra", [{}, {"max_documents": 70}, {"validation_fraction": 0.2,
                                                                  "max_document_chars": 1000}])
def test_partitioned_ingest_equals_single_process(tmp_path, tiny_paragraphs, extra):
    src = _write_inputs(tmp_path, tiny_paragraphs)
    cfg = IngestConfig(sources=[str(src)], **extra)
    plan = plan_partitions(resolve_sources(cfg), cfg, 9)
    cut = {Path(p.path).name for p in plan if p.start > 0}
    assert {"z.jsonl"} <= cut  # the large file is read in byte ranges

    one = ingest(cfg, tmp_path / "one")
    many = ingest(cfg, tmp_path / "many", accounting=partitioned(map, 9))

    assert many.digest == one.digest
    assert _stable(many) == _stable(one)
    assert one.dropped["bad_json"] > 0
    if "max_document_chars" in extra:
        assert one.repaired["split"] == 1 and one.split_parts_extra > 0
    if not extra:  # the whole corpus read: the last lines of z.jsonl repeat a.txt / b.txt
        assert one.dropped["duplicate"] == 5
    assert _tree_sha256(Path(many.output_dir)) == _tree_sha256(Path(one.output_dir))


def test_byte_ranges_start_at_line_and_paragraph_starts(tmp_path, tiny_paragraphs):
    src = _write_inputs(tmp_path, tiny_paragraphs)
    cfg = IngestConfig(sources=[str(src)])
    for part in plan_partitions(resolve_sources(cfg), cfg, 40):
        data = Path(part.path).read_bytes()
        head = data[:part.start]
        # The line number is the count of line ends before the range, plus one.
        assert part.first_line == head.count(b"\n") + 1
        if part.start and Path(part.path).suffix == ".txt":
            assert head.endswith((b"\n\n", b"\r\n\r\n"))
        elif part.start:
            assert head.endswith(b"\n")


def test_partitioned_shards_are_byte_identical(tmp_path, tiny_shard_config,
                                               tiny_corpus_manifest, tiny_tokenizer_manifest):
    corpus, tokenizer = tiny_corpus_manifest, tiny_tokenizer_manifest
    paths = [corpus.file(e.path) for e in corpus.train]
    assert len(plan_documents(paths, 5)) >= 5

    one = write_shards(tiny_shard_config, corpus, tokenizer, tmp_path / "one")
    encode = partitioned_encoder(Tokenizer.load(tokenizer).path, tiny_shard_config, map, 5)
    many = write_shards(tiny_shard_config, corpus, tokenizer, tmp_path / "many", encode=encode)

    assert many.digest == one.digest
    assert _stable(many) == _stable(one)
    assert len(one.train.shards) > 1
    assert _tree_sha256(Path(many.output_dir)) == _tree_sha256(Path(one.output_dir))


@pytest.mark.parametrize("on_bad_file", ["skip", "fail"])
def test_partitioned_ingest_bad_files_as_single_process(tmp_path, tiny_paragraphs, on_bad_file):
    src = _write_inputs(tmp_path, tiny_paragraphs)
    (src / "b2.json").write_text('{"text": "not an array"}', encoding="utf-8")
    (src / "b3.json").write_text('[{"text": "un"}] [2]', encoding="utf-8")
    cfg = IngestConfig(sources=[str(src)], on_bad_file=on_bad_file)
    if on_bad_file == "fail":
        with pytest.raises(ValueError) as one:
            ingest(cfg, tmp_path / "one")
        with pytest.raises(ValueError) as many:
            ingest(cfg, tmp_path / "many", accounting=partitioned(map, 9))
        assert str(many.value) == str(one.value)
        assert "b2.json" in str(one.value) and "b3.json" in str(one.value)
        return
    one = ingest(cfg, tmp_path / "one")
    many = ingest(cfg, tmp_path / "many", accounting=partitioned(map, 9))
    assert [b.path for b in one.bad_files] == [str(src / "b2.json"), str(src / "b3.json")]
    assert _stable(many) == _stable(one)
    assert _tree_sha256(Path(many.output_dir)) == _tree_sha256(Path(one.output_dir))
