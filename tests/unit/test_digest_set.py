"""`cleaning.DigestSet` (exact deduplication's digests) against Python's `set`."""

from __future__ import annotations

import hashlib
import random

import pytest

from mlm_pipeline.ingest.cleaning import DigestSet


def _check_against_set(digests: list[bytes], capacity: int) -> DigestSet:
    table, ref = DigestSet(capacity), set()
    for d in digests:
        assert table.add(d) == (d in ref)
        ref.add(d)
    assert len(table) == len(ref)
    assert all(table.add(d) for d in ref)  # everything inserted is found again
    assert len(table) == len(ref)
    return table


def test_matches_a_python_set_through_many_doublings():
    keys = [hashlib.blake2b(str(i % 3000).encode(), digest_size=16).digest()
            for i in range(10_000)]
    table = _check_against_set(keys, capacity=8)
    assert len(table) == 3000
    slots = (table.nbytes) // 17
    assert slots & (slots - 1) == 0 and 3000 <= slots * DigestSet.MAX_LOAD < 6000


def test_probing_with_equal_home_slots_and_half_collisions():
    rng = random.Random(0)
    low = rng.randbytes(8)
    # Same second half (same home slot in any table): every insert probes past the others.
    same_home = [rng.randbytes(8) + low for _ in range(200)]
    # Same first half, other second halves; and the zero digest, and all-ones.
    same_first = [low + rng.randbytes(8) for _ in range(200)]
    edge = [bytes(16), b"\xff" * 16, b"\x80" + bytes(15), bytes(15) + b"\x80"]
    keys = same_home + same_first + edge
    _check_against_set(keys + rng.sample(keys, len(keys)), capacity=8)


def test_rejects_other_digest_sizes():
    with pytest.raises(ValueError, match="16 bytes, got 8"):
        DigestSet().add(bytes(8))
