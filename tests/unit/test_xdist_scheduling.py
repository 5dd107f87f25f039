"""The fast suite's pytest-xdist scheduling (tests/conftest.py): whole modules per worker,
with the modules that share the Prefect test harness as one unit, so that one worker
starts it. The override point is private in pytest-xdist: an upgrade that stops using it
fails here instead of silently starting a harness per worker again."""

import inspect

from xdist.scheduler import LoadFileScheduling, LoadScopeScheduling

from tests.conftest import HARNESS_MODULES, harness_unit_scheduling


def test_pytest_xdist_still_groups_tests_by_split_scope():
    # the scheduler builds its units from `_split_scope(nodeid)` and loadfile overrides it
    assert "self._split_scope(nodeid)" in inspect.getsource(LoadScopeScheduling.schedule)
    assert "_split_scope" in LoadFileScheduling.__dict__


def test_harness_modules_are_one_unit_and_other_modules_their_own():
    cls = harness_unit_scheduling()
    split = cls._split_scope.__get__(object.__new__(cls))  # no session needed to split
    flows = [f"{HARNESS_MODULES}test_a.py::test_x", f"{HARNESS_MODULES}test_b.py::test_y[1]"]
    assert {split(n) for n in flows} == {HARNESS_MODULES}
    assert split("tests/unit/test_a.py::test_x") == "tests/unit/test_a.py"
    assert split("tests/unit/test_a.py::Class::test_y") == "tests/unit/test_a.py"
    assert split("tests/unit/test_b.py::test_x") == "tests/unit/test_b.py"
