"""The flows are one package, `mlm_pipeline_flows`, however they are loaded: through the
package (tests, the console script) or as the script of a prefect.yaml entry point, which
is how a worker loads them. Two copies of `pretrain_params` would make two `PretrainParams`
classes, and pydantic rejects an instance of one where the other is declared."""

import importlib
import sys
import typing
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]


def _file_entrypoints() -> list[str]:
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    return sorted({d["entrypoint"] for d in deployments})


def test_prefect_yaml_names_the_four_flow_files():
    assert _file_entrypoints() == [
        "flows/phases.py:mlm_phases",
        "flows/prepare_data.py:prepare_data_flow",
        "flows/pretraining.py:mlm_pretraining",
        "flows/train_evaluate.py:train_evaluate_flow",
    ]


@pytest.mark.parametrize("entrypoint", _file_entrypoints())
def test_a_file_entrypoint_shares_the_package_classes(entrypoint, monkeypatch):
    from mlm_pipeline_flows.pretrain_params import PreparedData, PretrainParams

    # Prefect's loader puts the file's folder and the working directory first on sys.path
    # and registers the script as a module: undo both after this test.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)
    before = set(sys.modules)
    flow = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    loaded = set(sys.modules) - before
    try:
        script = sys.modules[flow.fn.__module__]
        # loaded as a script, not found in the package: the case a worker meets
        assert not flow.fn.__module__.startswith("mlm_pipeline_flows")
        assert Path(script.__file__) == ROOT / entrypoint.split(":")[0]
        hints = typing.get_type_hints(flow.fn)
        assert hints["params"] is PretrainParams
        if "data" in hints:  # train-evaluate
            assert hints["data"] is PreparedData
    finally:
        sys.modules.pop(flow.fn.__module__, None)
    # no second copy of a neighbour: as `flows.*` or under a bare name (`pretrain_params`)
    neighbours = {p.stem for p in (ROOT / "flows").glob("*.py")} | {"flows"}
    assert not {n for n in loaded if n.split(".")[0] in neighbours} - {flow.fn.__module__}

def test_the_folder_is_not_importable_as_flows():
    with pytest.raises(ImportError, match="mlm_pipeline_flows"):
        importlib.import_module("flows")
