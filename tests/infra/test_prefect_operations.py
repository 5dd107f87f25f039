"""Production Prefect settings shipped in prefect.yaml and infra/: the zombie-run automation,
the failure alerts' reach (every project flow),
heartbeats in every job environment, and one run at a time on the retraining and GPU
deployments (checked offline against Prefect's own schemas)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
AUTOMATION = ROOT / "flows" / "automations" / "crash-zombie-flows.yaml"
TEMPLATE = ROOT / "infra" / "k8s" / "gpu-work-pool-template.json"


def _deployments() -> dict[str, dict]:
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in config["deployments"]}


def test_zombie_automation_is_a_valid_prefect_automation():
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import AutomationCore, Posture

    (spec,) = yaml.safe_load(AUTOMATION.read_text())["automations"]
    automation = AutomationCore.model_validate(spec)
    trigger = automation.trigger
    assert trigger.posture == Posture.Proactive
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.heartbeat" in trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    (action,) = automation.actions
    assert action.type == "change-flow-run-state" and action.state == StateType.CRASHED


def _heartbeat_s(env: dict) -> int:
    return int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])


#: The deployments of the base recipes' phase chains (the `mlm-phases` flow).
PHASE_DEPLOYMENTS = ["bert-base-phases", "modern-base-phases", "bert-base-phases-k8s",
                     "modern-base-phases-k8s"]


@pytest.mark.parametrize("name", ["local-cpu", "scheduled-retrain", "gpu", *PHASE_DEPLOYMENTS])
def test_every_deployment_sends_heartbeats_the_automation_can_see(name):
    (spec,) = yaml.safe_load(AUTOMATION.read_text())["automations"]
    env = _deployments()[name]["work_pool"]["job_variables"]["env"]
    beat = _heartbeat_s(env)
    # Prefect ignores values of 30 s or less; the automation waits for several missed beats.
    assert 30 < beat and spec["trigger"]["within"] >= 2 * beat
    assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "mlm_pipeline"


def test_gpu_job_template_sends_heartbeats():
    env = json.loads(TEMPLATE.read_text())["job_configuration"]["env"]
    assert _heartbeat_s(env) > 30


@pytest.mark.parametrize("name", ["scheduled-retrain", "gpu", *PHASE_DEPLOYMENTS])
def test_retraining_and_gpu_runs_queue_one_at_a_time(name):
    from prefect.client.schemas.objects import ConcurrencyOptions

    limit = _deployments()[name]["concurrency_limit"]
    assert limit["limit"] == 1
    assert ConcurrencyOptions(collision_strategy=limit["collision_strategy"]
                              ).collision_strategy.value == "ENQUEUE"


def _flow_names_in_flows_folder() -> set[str]:
    """The `name=` of every `@flow(...)` decorator in flows/*.py (read with `ast`)."""
    names = set()
    for path in sorted((ROOT / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "flow":
                names |= {kw.value.value for kw in node.keywords if kw.arg == "name"}
    return names


def test_failure_alerts_watch_every_project_flow():
    from mlm_pipeline_flows.alerts import FLOW_NAMES

    found = _flow_names_in_flows_folder()
    assert "mlm-pretraining" in found and "train-evaluate" in found
    assert set(FLOW_NAMES) == found, "add the new flow to alerts.FLOW_NAMES"


def test_alerts_without_the_console_script_names_the_entry_point(capsys):
    from mlm_pipeline import cli

    assert cli.main(["alerts", "remove"]) == 2
    err = capsys.readouterr().err
    assert "`alerts` needs Prefect" in err and "mlm_pipeline_flows.console" in err


@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({}, ValueError, "exactly one of --webhook-url"),
    ({"webhook_url": "http://h/x", "block": "custom-webhook/ops"}, ValueError,
     "exactly one of --webhook-url"),
    ({"webhook_url": "hooks.example.com/x"}, ValueError, "'hooks.example.com/x'"),
    ({"webhook_url": "http://h/x", "zombie_file": "/nonexistent/zombie.yaml"},
     FileNotFoundError, "/nonexistent/zombie.yaml"),
])
def test_alerts_install_refuses_bad_input_before_touching_a_server(kwargs, error, named):
    from mlm_pipeline_flows.alerts import install

    with pytest.raises(error, match=re.escape(named)):
        install(**kwargs)


def test_alerts_install_names_a_zombie_file_that_is_not_one_automation(tmp_path):
    from mlm_pipeline_flows.alerts import install

    bad = tmp_path / "two.yaml"
    bad.write_text(yaml.safe_dump({"automations": [{"name": "a"}, {"name": "b"}]}))
    with pytest.raises(ValueError, match=re.escape(f"{bad}: `automations` must list")):
        install(webhook_url="http://h/x", zombie_file=str(bad))


@pytest.mark.parametrize("name", PHASE_DEPLOYMENTS)
def test_a_phase_chain_deployment_names_its_last_phase_on_the_gpu_pools(name):
    from mlm_pipeline.app.phases import phase_chain

    spec = _deployments()[name]
    assert spec["entrypoint"] == "flows/phases.py:mlm_phases"
    recipe = name.removesuffix("-k8s").removesuffix("-phases")
    last = spec["parameters"]["params"]["config"]
    assert phase_chain(last) == [recipe, last]
    assert "train.device=cuda" in spec["parameters"]["params"]["overrides"]
    if name.endswith("-k8s"):  # the parent only waits; each phase trains on the GPU pool
        assert spec["work_pool"]["name"] == "local-cpu"
        assert spec["parameters"]["stages"] == _deployments()["gpu"]["parameters"]["stages"]
        assert spec["parameters"]["stages"]["train_evaluate"] == "train-evaluate/train-gpu"
    else:
        assert spec["work_pool"]["name"] == "local-gpu"
        assert "stages" not in spec["parameters"]
