"""A shard written around a body file equals, byte for byte, the shard written from memory."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlm_pipeline.shards.format import open_shard, write_arrow, write_arrow_from_body


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_body_file_shard_is_byte_identical(tmp_path, dtype, rows):
    seq_len = 16
    ids = np.random.default_rng(rows).integers(0, 60_000, size=(rows, seq_len)).astype(dtype)
    mem = write_arrow(tmp_path, tmp_path / "mem.arrow", {"input_ids": ids}, seq_len)
    body = tmp_path / ".body.tmp"
    with open(body, "wb") as f:  # appended in pieces, as the shard writer does
        f.writelines(part.tobytes() for part in np.array_split(ids, 3))
    spilled = write_arrow_from_body(tmp_path, tmp_path / "body.arrow", "input_ids", body,
                                    np.dtype(dtype), seq_len)
    a, b = (tmp_path / "mem.arrow").read_bytes(), (tmp_path / "body.arrow").read_bytes()
    assert a == b
    assert spilled.sha256 == mem.sha256 == hashlib.sha256(b).hexdigest()
    assert (spilled.bytes, spilled.rows, spilled.tokens) == (len(b), rows, rows * seq_len)
    np.testing.assert_array_equal(open_shard(tmp_path / "body.arrow"), ids)
    assert not (tmp_path / ".body.arrow.tmp").exists()


def test_body_of_partial_row_is_refused(tmp_path):
    body = tmp_path / ".body.tmp"
    body.write_bytes(b"\x00" * 33)  # 16 uint16 ids per row = 32 bytes
    with pytest.raises(ValueError, match=r"\.body\.tmp: 33 bytes is not a whole number"):
        write_arrow_from_body(tmp_path, tmp_path / "x.arrow", "input_ids", body,
                              np.dtype(np.uint16), 16)
    assert not (tmp_path / "x.arrow").exists()
