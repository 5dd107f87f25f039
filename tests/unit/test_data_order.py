"""Deterministic, resumable batch order."""

import numpy as np
import pytest

from mlm_pipeline.train.data import RowCursor, epoch_order


def _take(cursor, n):
    return [cursor.next_batch() for _ in range(n)]


def test_epoch_covers_every_row_once_and_drops_only_the_tail():
    cursor = RowCursor(num_rows=103, batch_size=10, seed=7)
    batches = _take(cursor, 10)
    rows = np.concatenate([b for b, _ in batches])
    assert len(set(rows.tolist())) == 100  # 10 full batches, 3 rows left for this epoch
    assert {e for _, e in batches} == {0}
    rows_next, epoch = cursor.next_batch()
    assert epoch == 1
    assert not np.array_equal(rows_next, batches[0][0])  # a new permutation


def test_resume_continues_exactly():
    a = RowCursor(num_rows=50, batch_size=4, seed=3)
    straight = _take(a, 30)  # crosses two epoch boundaries (12 batches per epoch)
    b = RowCursor(num_rows=50, batch_size=4, seed=3)
    _take(b, 17)
    state = b.state_dict()
    c = RowCursor(num_rows=50, batch_size=4, seed=3)
    c.load_state_dict(state)
    resumed = _take(c, 13)
    for (x, ex), (y, ey) in zip(straight[17:], resumed):
        assert ex == ey
        np.testing.assert_array_equal(x, y)


def test_resume_refuses_other_data():
    state = RowCursor(num_rows=50, batch_size=4, seed=3).state_dict()
    with pytest.raises(ValueError, match="num_rows"):
        RowCursor(num_rows=51, batch_size=4, seed=3).load_state_dict(state)


def test_ranks_take_disjoint_rows_of_the_same_order():
    order = epoch_order(40, seed=1, epoch=0)
    r0 = RowCursor(40, batch_size=5, seed=1, rank=0, world_size=2)
    r1 = RowCursor(40, batch_size=5, seed=1, rank=1, world_size=2)
    rows0 = np.concatenate([r0.next_batch()[0] for _ in range(4)])
    rows1 = np.concatenate([r1.next_batch()[0] for _ in range(4)])
    np.testing.assert_array_equal(rows0, order[0::2])
    np.testing.assert_array_equal(rows1, order[1::2])


def test_too_few_rows_for_a_batch():
    with pytest.raises(ValueError, match="fewer than one batch"):
        RowCursor(num_rows=3, batch_size=4, seed=0)
