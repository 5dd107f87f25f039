"""The `--slice K/N` rule of tests/conftest.py that CI uses to run one part of the `full`
tier per landing: slices partition the modules, keep each module whole, balance the
estimated seconds, and do not depend on the order the modules come in."""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import assign_slices, parse_slice


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
