"""Ingest accounting with split and dropped documents: every record is accounted for."""

from __future__ import annotations

import json

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.stage import ingest

LIMIT = 1000  # IngestConfig's smallest max_document_chars
# Paragraphs of about 600 characters: each fits the limit, no two joined by a blank line do.
P1 = " ".join(f"Le chat numero {i} dort au soleil." for i in range(18))
P2 = " ".join(f"Le chien numero {i} court dans le pre." for i in range(16))
P3 = " ".join(f"L'oiseau numero {i} chante sur la branche." for i in range(15))
Q1 = " ".join(f"Une autre phrase, la {i}e, ouvre ce document." for i in range(14))
KEPT_ALONE = " ".join(f"Document court {i}." for i in range(25))  # also a split part


def test_split_and_dropped_documents_add_up(tmp_path):
    # Each paragraph fits the limit, no two joined by a blank line do: one part each.
    assert all(len(p) <= LIMIT for p in (P1, P2, P3, Q1, KEPT_ALONE))
    assert len(KEPT_ALONE) + 2 + min(len(P1), len(P2), len(P3), len(Q1)) > LIMIT
    lines = [
        json.dumps({"id": "three", "text": f"{P1}\n\n{P2}\n\n{P3}"}),  # 3 parts: +2
        json.dumps({"id": "solo", "text": KEPT_ALONE}),
        json.dumps({"id": "two", "text": f"{Q1}\n\n{KEPT_ALONE}"}),  # 2 parts: +1, 1 duplicate
        "{not json",  # bad_json
        json.dumps({"id": "no-text", "body": "x"}),  # missing_text
        json.dumps({"id": "blank", "text": "   "}),  # empty
        json.dumps({"id": "short", "text": "court"}),  # too_short (min_chars 10)
        json.dumps({"id": "again", "text": KEPT_ALONE}),  # duplicate
    ]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = IngestConfig(sources=[str(tmp_path / "docs.jsonl")], max_document_chars=LIMIT,
                       min_chars=10, validation_fraction=0.0)
    m = ingest(cfg, tmp_path / "work")
    # By construction: 8 records, 3 + 1 + 2 = 6 documents before dedup, 2 duplicates.
    assert m.documents_read == 8
    assert m.split_parts_extra == 3
    assert m.repaired["split"] == 2
    assert {k: v for k, v in m.dropped.items() if v} == {
        "bad_json": 1, "missing_text": 1, "empty": 1, "too_short": 1, "duplicate": 2}
    assert m.documents_kept == 5  # the P1, P2, P3 parts, solo, the Q1 part
    assert m.documents_read + m.split_parts_extra == m.documents_kept + sum(m.dropped.values())


def test_no_split_means_no_extra_parts(tmp_path):
    (tmp_path / "a.txt").write_text(f"{P1}\n\n{P2}\n", encoding="utf-8")
    m = ingest(IngestConfig(sources=[str(tmp_path / "a.txt")], validation_fraction=0.0),
               tmp_path / "work")
    assert m.split_parts_extra == 0 and m.documents_read == m.documents_kept == 2
