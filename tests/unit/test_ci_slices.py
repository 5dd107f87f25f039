"""The `--slice K/N` rule of tests/conftest.py that CI uses to run one part of the `full`
tier per landing: slices partition the modules, keep each module whole, balance the
estimated seconds, and do not depend on the order the modules come in. And the order CI's
workers take the slow modules in: longest first, by the tiers selected."""

from __future__ import annotations

import itertools

import pytest

from tests import conftest
from tests.conftest import assign_slices, longest_modules_first, parse_slice


def test_costliest_first_each_to_the_least_loaded_slice():
    # By hand: a (300) -> 1; b (270) -> 2; c (240) -> 2 (270 < 300); d (60, the default)
    # -> 1 (300 < 510); e (60) -> 1 (360 < 510).
    cost = {"t/a.py": 300, "t/b.py": 270, "t/c.py": 240}
    got = assign_slices(["t/e.py", "t/d.py", "t/c.py", "t/b.py", "t/a.py"], 2, cost, 60)
    assert got == {"t/a.py": 1, "t/b.py": 2, "t/c.py": 2, "t/d.py": 1, "t/e.py": 1}


def test_equal_costs_go_by_path_and_fill_every_slice():
    got = assign_slices([f"t/m{i}.py" for i in range(7)], 3, {}, 60)
    assert got == {"t/m0.py": 1, "t/m1.py": 2, "t/m2.py": 3, "t/m3.py": 1, "t/m4.py": 2,
                   "t/m5.py": 3, "t/m6.py": 1}


def test_the_order_of_the_modules_does_not_matter():
    modules = ["t/a.py", "t/b.py", "t/c.py", "t/d.py"]
    cost = {"t/b.py": 100, "t/d.py": 100}
    results = {tuple(sorted(assign_slices(list(p), 3, cost, 10).items()))
               for p in itertools.permutations(modules)}
    assert len(results) == 1


def test_more_slices_than_modules_leaves_slices_empty():
    assert assign_slices(["t/a.py"], 4, {}, 60) == {"t/a.py": 1}


@pytest.mark.parametrize("text, k, n", [("1/3", 1, 3), ("4/4", 4, 4), ("1/1", 1, 1)])
def test_parse_slice(text, k, n):
    assert parse_slice(text) == (k, n)


@pytest.mark.parametrize("text", ["0/3", "4/3", "3", "a/b", "1/2/3", "", "-1/3"])
def test_bad_slice_is_a_usage_error_naming_the_option(text):
    with pytest.raises(pytest.UsageError, match="--slice"):
        parse_slice(text)


class _Item:
    """What `longest_modules_first` reads of a pytest item: its node id and marks."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.marks = nodeid, set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def test_slow_modules_longest_first_by_the_selected_tiers(monkeypatch):
    monkeypatch.setattr(conftest, "PUSH_COST_S", {"t/readme.py": 800, "t/both.py": 100})
    monkeypatch.setattr(conftest, "FULL_COST_S", {"t/both.py": 900, "t/full.py": 300})
    fast = _Item("t/both.py::fast")
    items = [fast, _Item("t/full.py::a", "slow", "full"), _Item("t/both.py::push", "slow"),
             _Item("t/new.py::a", "slow", "full"), _Item("t/readme.py::a", "slow"),
             _Item("t/readme.py::b", "slow")]
    order = list(items)
    longest_modules_first(order)
    # readme 800 (push only); full 300; both 100 (its full tests not selected: 100, not
    # 1,000); new: DEFAULT_FULL_COST_S (60); then the fast test, as collected.
    assert [i.nodeid for i in order] == [
        "t/readme.py::a", "t/readme.py::b", "t/full.py::a", "t/both.py::push", "t/new.py::a",
        "t/both.py::fast"]
    assert order[-1] is fast
