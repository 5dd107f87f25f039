"""The library holds no test hooks: tests inject faults from outside (tests/faults/), so no
module under `mlm_pipeline/` names a test-only environment variable."""

import re
from pathlib import Path

from tests.faults import mlm_faults

LIBRARY = Path(__file__).resolve().parents[2] / "mlm_pipeline"
#: Names of test-only variables: MLM_..._TEST_..., MLM_..._FAULT_...
TEST_VARIABLE = re.compile(r"\bMLM_\w*(?:TEST|FAULT)\w*")


def test_the_pattern_catches_the_fault_variables():
    for name in (mlm_faults.NAN_AT_STEP, mlm_faults.KILL_IN_CHECKPOINT,
                 mlm_faults.FAIL_RANK_AT_STEP, "MLM_PIPELINE_TEST_NAN_AT_STEP"):
        assert TEST_VARIABLE.fullmatch(name), name


def test_no_library_module_names_a_test_variable():
    found = [f"{path.relative_to(LIBRARY.parent)}:{n}: {line.strip()}"
             for path in sorted(LIBRARY.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if TEST_VARIABLE.search(line)]
    assert not found, "\n".join(found)
