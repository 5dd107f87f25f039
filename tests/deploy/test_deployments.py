"""Deployments from prefect.yaml on a real Prefect server, worker and MLflow server.

Slow (servers start in about 20 s): run with `pytest -m slow`. On every push CI runs the
first deployment run (model registered, data stages reused) and the checks that only read the
server (schedule, trigger, concurrency limits, a rejected parameter); the event-started
retrain, five runs at once and the two-pool split are the `full` tier (one slice per push,
all with CI_FULL=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _prefect(stack, *args, timeout=600, check=True):
    return subprocess.run([str(stack["bin"] / "prefect"), *args], cwd=stack["root"], env=stack["env"],
                          capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def deployed(stack):
    template = stack["root"] / "infra" / "k8s" / "gpu-work-pool-template.json"
    _prefect(stack, "work-pool", "create", "gpu-k8s", "--type", "kubernetes",
             "--base-job-template", str(template), "--overwrite")
    # the compose GPU worker's pool (prefect deploy refuses a deployment's missing pool)
    _prefect(stack, "work-pool", "create", "local-gpu", "--type", "process", "--overwrite")
    out = _prefect(stack, "--no-prompt", "deploy", "--all", check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "local-cpu" in out.stdout + out.stderr
    config = stack["tmp"] / "deploy-test.yaml"
    config.write_text(yaml.safe_dump({
        "name": "deploy-test",
        "work_dir": str(stack["tmp"] / "work"),
        "ingest": {"sources": [str(ASSETS / "tiny_fr.txt")], "validation_fraction": 0.15,
                   "allowed_sources": [str(ASSETS)]},
        "tokenizer": {"vocab_size": 128},
        "shards": {"seq_len": 16},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "train": {"micro_batch_size": 4, "max_steps": 6, "warmup_steps": 2, "log_every": 2},
        "eval": {"max_rows": 20, "probes": []},
        "tracking": {"experiment_name": "deploy-test"},
    }))
    return {**stack, "config": str(config)}


def _flow_run_id(output: str) -> str:
    for line in output.splitlines():
        if "UUID:" in line:
            return line.split("UUID:")[1].strip()
    raise AssertionError(f"no flow run id in:\n{output}")


def _run_deployment(deployed, *overrides) -> tuple[str, float]:
    params = json.dumps({"config_file": deployed["config"], "overrides": list(overrides)})
    start = time.monotonic()
    out = _prefect(deployed, "deployment", "run", "mlm-pretraining/local-cpu",
                   "--param", f"params={params}", "--watch", "--watch-timeout", "500")
    return _flow_run_id(out.stdout), time.monotonic() - start


@contextlib.contextmanager
def _client(deployed):
    """A sync Prefect client (and settings) pointed at the test server.

    On exit, the events emitted meanwhile are sent and this process's events worker is
    stopped: Prefect keeps one per client type, bound to the API URL current when it
    started, so it would otherwise send the later tests' events (on this pytest-xdist
    worker, to its flows harness) to this module's server after it stopped, and they
    would be lost.
    """
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: deployed["env"]["PREFECT_API_URL"]}):
        try:
            with get_client(sync_client=True) as client:
                yield client
        finally:
            EventsWorker.drain_all(timeout=60)


def _run_tree(deployed, flow_run_id: str) -> list:
    """A flow run's id and its child flow runs' (the prepare-data and train-evaluate
    subflows or deployment runs under mlm-pretraining)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    with _client(deployed) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    return [flow_run_id, *(str(c.id) for c in children)]


def _task_states(deployed, flow_run_id: str) -> dict[str, str]:
    """Task run name (without its suffix) -> state name, in the flow run and its children."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with _client(deployed) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=_run_tree(deployed, flow_run_id))))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


def test_deployment_run_completes_and_logs_to_the_mlflow_server(deployed):
    flow_run_id, seconds = _run_deployment(deployed)
    with _client(deployed) as client:
        flow_run = client.read_flow_run(flow_run_id)
    assert flow_run.state.is_completed(), flow_run.state
    mlflow = MlflowClient(tracking_uri=deployed["env"]["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("deploy-test")
    runs = mlflow.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.deployment_name"] == "local-cpu"
    # One name for the flow run and the MLflow run (config name, preset, steps, suffix).
    assert run.info.run_name == flow_run.name
    assert re.fullmatch(r"deploy-test-6-[0-9a-f]{6}", flow_run.name)  # no model.preset
    # Source, user and the flow run's page on the Prefect server's UI.
    tags = run.data.tags
    assert tags["mlflow.source.type"] == "JOB"
    assert tags["mlflow.source.name"] == "flows/pretraining.py:mlm_pretraining"
    assert tags["mlflow.user"]
    ui = deployed["env"]["PREFECT_API_URL"].removesuffix("/").removesuffix("/api")
    assert tags["prefect.flow_run_url"] == f"{ui}/runs/flow-run/{flow_run_id}"
    assert tags["mlflow.note.content"].startswith("# mlm-pretraining run")
    # Both shard splits are dataset inputs under the shards digest, found by it.
    contexts = {{t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset.digest
                for i in run.inputs.dataset_inputs}
    assert contexts == {"training": tags["digest.shards"][:36],
                        "validation": tags["digest.shards"][:36]}
    assert run.info.run_id in {r.info.run_id for r in mlflow.search_runs(
        [experiment.experiment_id], f"dataset.digest = '{tags['digest.shards'][:36]}'")}
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert any(k.startswith("system/") for k in run.data.metrics)
    assert not [k for k in run.data.metrics if k.startswith("data/")]
    assert int(run.data.params["data.documents_read"]) > 0
    assert [m.step for m in mlflow.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6]
    assert "eval/mlm_accuracy" in run.data.metrics
    # artifacts went through the server into its artifact store
    assert {a.path for a in mlflow.list_artifacts(run.info.run_id, "tokenizer")} == {
        "tokenizer/spm.model", "tokenizer/spm.vocab", "tokenizer/manifest.json"}
    local = mlflow.download_artifacts(run.info.run_id, "tokenizer/spm.model",
                                      str(deployed["tmp"]))
    assert Path(local).stat().st_size > 0
    print(f"\nfirst deployment run: {seconds:.1f} s from `prefect deployment run` to Completed")
    # the library's INFO logs (the MLflow run id, training metrics) reach Prefect
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with _client(deployed) as client:
        logs = client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=_run_tree(deployed, flow_run_id))))
    library = [log for log in logs if log.name.startswith("mlm_pipeline")]
    assert any(run.info.run_id in log.message for log in library), [l.message for l in logs]
    assert any("train/loss" in log.message for log in library)

    # The run's model is registered on the server, champion (the first version), and loads
    # back by alias in a fresh process through the server's artifact store.
    version = mlflow.get_model_version_by_alias("deploy-test", "champion")
    assert version.run_id == run.info.run_id
    assert run.data.tags["registry.decision"] == "first"
    load = subprocess.run(
        [sys.executable, "-c",
         ("import mlflow, sys; m = mlflow.pyfunc.load_model('models:/deploy-test@champion');"
          " print(m.predict(['Le [MASK] du chat.']))")],
        env={**os.environ, "MLFLOW_TRACKING_URI": deployed["env"]["MLFLOW_TRACKING_URI"]},
        capture_output=True, text=True, timeout=300, check=False)
    assert load.returncode == 0, load.stderr[-3000:]
    assert "token_str" in load.stdout or "[" in load.stdout

    # Second run of the same config: each data stage finds its output by digest and
    # reuses it (the tasks complete; the run summary shows them reused).
    second_id, seconds = _run_deployment(deployed)
    states = _task_states(deployed, second_id)
    assert {states["ingest"], states["tokenizer"], states["shards"]} == {"Completed"}
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with _client(deployed) as client:
        summaries = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["run-summary"])))
    (summary,) = [a for a in summaries if str(a.flow_run_id) in map(
        str, _run_tree(deployed, second_id))]
    rows = {line.split("|")[1].strip(): line for line in summary.data.splitlines()
            if line.startswith("| ")}
    for stage in ("ingest", "tokenizer", "shards"):
        assert "reused" in rows[stage], rows[stage]
    print(f"second deployment run (reused data): {seconds:.1f} s")
    for name, proc in deployed["procs"].items():
        print(f"RSS {name}: {deployed['rss_mib'](proc.pid):.0f} MiB")


def test_schedule_and_trigger_are_registered(deployed):
    with _client(deployed) as client:
        dep = client.read_deployment_by_name("mlm-pretraining/scheduled-retrain")
        assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * 1"]
        assert dep.schedules[0].parameters["params"]["overrides"] == [
            "tracking.run_name=weekly-retrain"]
        # retraining continues from the champion: the deployment, its schedule, its trigger
        assert dep.parameters["params"]["retrain"] == "continue"
        assert dep.schedules[0].parameters["params"]["retrain"] == "continue"
        # the server checks parameters against the flow's schema: the mode is one of two
        retrain = dep.parameter_openapi_schema["definitions"]["PretrainParams"][
            "properties"]["retrain"]
        assert retrain["enum"] == ["scratch", "continue"] and retrain["default"] == "scratch"
        automations = [a for a in client.read_automations()
                       if any(getattr(act, "deployment_id", None) == dep.id for act in a.actions)]
    assert len(automations) == 1
    trigger = automations[0].trigger
    assert trigger.expect == {"corpus.updated"}
    action = automations[0].actions[0]
    assert "event.payload.corpus" in json.dumps(action.parameters)
    assert action.parameters["params"]["retrain"] == "continue"


@pytest.mark.full
def test_corpus_updated_event_starts_a_retrain(deployed):
    """The event's corpus arrives as a typed parameter; the config file it names (planted
    beside the corpus, allowing everything) is refused before it is read: the run fails
    on it, and its state message names the file, never its content."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.events import emit_event

    secret = "planted-s3cr3t-never-quoted"
    planted = deployed["tmp"] / "incoming" / "wide-open.yaml"
    planted.parent.mkdir(exist_ok=True)
    planted.write_text(yaml.safe_dump({"name": "planted", "ingest": {
        "sources": [str(ASSETS / "tiny_fr.txt")], "allowed_sources": ["/"]}})
        + f"{secret}: [unclosed\n")
    with _client(deployed) as client:
        dep = client.read_deployment_by_name("mlm-pretraining/scheduled-retrain")
        emit_event(event="corpus.updated",
                   resource={"prefect.resource.id": "mlm-pipeline.corpus.test"},
                   payload={"corpus": str(ASSETS / "tiny_fr.txt"),
                            "config_file": str(planted)})
        deadline = time.monotonic() + 90
        runs = []
        while time.monotonic() < deadline and not runs:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                id=DeploymentFilterId(any_=[dep.id])))
            # the cron schedule's future runs are not the event's
            runs = [r for r in runs if "weekly-retrain" not in str(r.parameters)]
            time.sleep(1)
        assert runs, "no flow run was created by the corpus.updated event"
        params = runs[0].parameters["params"]
        # the event's file is a choice to vet, not the deployment's config
        assert params["event_config_file"] == str(planted)
        assert params["config"] == "tiny" and params["config_dirs"] == []
        # the corpus arrives as a typed parameter, checked against ingest.allowed_sources
        assert params["event_sources"] == [str(ASSETS / "tiny_fr.txt")]
        assert not any(o.startswith("ingest.") for o in params["overrides"])
        deadline, run = time.monotonic() + 300, runs[0]
        while time.monotonic() < deadline and not run.state.is_final():
            time.sleep(2)
            run = client.read_flow_run(run.id)
    assert run.state.is_failed(), (run.state.name, run.state.message)
    assert str(planted) in run.state.message and "refused" in run.state.message
    assert secret not in run.state.message and "unclosed" not in run.state.message


@pytest.mark.full
def test_five_deployment_runs_at_once_on_a_cold_cache_all_complete(deployed):
    """Runs sharing a work directory each build a stage once, under its
    lock, and reuse it; none fails on another's temporary files."""
    work = deployed["tmp"] / "work-concurrent"  # cold: no stage built yet
    params = json.dumps({"config_file": deployed["config"],
                         "overrides": [f"work_dir={work}", "train.max_steps=2",
                                       "tracking.log_model=false"]})
    ids = [_flow_run_id(_prefect(deployed, "deployment", "run", "mlm-pretraining/local-cpu",
                                 "--param", f"params={params}").stdout) for _ in range(5)]
    deadline, states = time.monotonic() + 600, {}
    with _client(deployed) as client:
        while time.monotonic() < deadline:
            states = {i: client.read_flow_run(i).state for i in ids}
            if all(s is not None and s.is_final() for s in states.values()):
                break
            time.sleep(2)
    names = {i: s.name if s else None for i, s in states.items()}
    print(f"\n5 concurrent deployment runs (cold): 5 started, "
          f"{sum(n == 'Completed' for n in names.values())} completed")
    assert list(names.values()) == ["Completed"] * 5, names
    for stage in ("ingest", "tokenizer", "shards"):
        assert len(list((work / stage).iterdir())) == 1, stage  # built once


def test_the_server_rejects_a_bad_parameter_before_a_worker_starts(deployed):
    schema = None
    with _client(deployed) as client:
        dep = client.read_deployment_by_name("mlm-pretraining/local-cpu")
        schema = dep.parameter_openapi_schema
        before = len(client.read_flow_runs())
    props = schema["definitions"]["PretrainParams"]["properties"]
    assert props["max_steps"]["anyOf"][0]["minimum"] == 1
    assert props["lr"]["description"].startswith("Peak learning rate")
    assert props["config"]["default"] == "tiny"
    bad = json.dumps({"config": "tiny", "max_steps": 0})
    out = _prefect(deployed, "deployment", "run", "mlm-pretraining/local-cpu",
                   "--param", f"params={bad}", check=False)
    assert out.returncode != 0
    assert "max_steps" in out.stdout + out.stderr or "validation" in (out.stdout + out.stderr)
    with _client(deployed) as client:
        assert len(client.read_flow_runs()) == before  # no run was created


def test_retraining_and_gpu_deployments_queue_one_run_at_a_time(deployed):
    with _client(deployed) as client:
        for name in ("mlm-pretraining/scheduled-retrain", "mlm-pretraining/gpu",
                     "mlm-phases/bert-base-phases", "mlm-phases/modern-base-phases",
                     "mlm-phases/bert-base-phases-k8s", "mlm-phases/modern-base-phases-k8s"):
            dep = client.read_deployment_by_name(name)
            assert dep.global_concurrency_limit is not None, name
            assert dep.global_concurrency_limit.limit == 1
            assert dep.concurrency_options.collision_strategy.value == "ENQUEUE"


def test_phase_chain_deployments_are_registered_on_the_gpu_pools(deployed):
    """The server holds the mlm-phases deployments with the parameters prefect.yaml gives
    them (the last phase of each chain), and checks them against the flow's schema."""
    expected = {"bert-base-phases": ("local-gpu", "bert-base-512", False),
                "modern-base-phases": ("local-gpu", "modern-base-8k", False),
                "bert-base-phases-k8s": ("local-cpu", "bert-base-512", True),
                "modern-base-phases-k8s": ("local-cpu", "modern-base-8k", True)}
    with _client(deployed) as client:
        for name, (pool, config, staged) in expected.items():
            dep = client.read_deployment_by_name(f"mlm-phases/{name}")
            assert dep.work_pool_name == pool, name
            assert dep.entrypoint == "flows/phases.py:mlm_phases"
            assert dep.parameters["params"]["config"] == config
            assert ("stages" in dep.parameters) == staged, name
            schema = dep.parameter_openapi_schema
            assert {"params", "phases", "stages"} <= set(schema["properties"])
        before = len(client.read_flow_runs())
    # a chain that names no shipped config is refused before a worker starts
    out = _prefect(deployed, "deployment", "run", "mlm-phases/bert-base-phases", "--param",
                   'params={"config": "no-such-config"}', check=False)
    assert out.returncode != 0
    assert "config" in out.stdout + out.stderr
    with _client(deployed) as client:
        assert len(client.read_flow_runs()) == before  # no run was created


@pytest.mark.full
def test_two_pool_deployment_runs_its_halves_as_deployments(deployed):
    """With `stages`, mlm-pretraining runs prepare-data and train-evaluate
    as deployments of their own (here both on the process pool), waits for each, and the
    MLflow run it opened is finished by the train-evaluate child on the prepared shards."""
    params = json.dumps({"config_file": deployed["config"],
                         "overrides": ["train.max_steps=2", "tracking.log_model=false"]})
    stages = json.dumps({"prepare_data": "prepare-data/prepare-cpu",
                         "train_evaluate": "train-evaluate/train-cpu"})
    out = _prefect(deployed, "deployment", "run", "mlm-pretraining/local-cpu",
                   "--param", f"params={params}", "--param", f"stages={stages}",
                   "--watch", "--watch-timeout", "500")
    parent_id = _flow_run_id(out.stdout)
    with _client(deployed) as client:
        parent = client.read_flow_run(parent_id)
        children = [client.read_flow_run(i) for i in _run_tree(deployed, parent_id)[1:]]
        by_deployment = {client.read_deployment(c.deployment_id).name: c for c in children
                         if c.deployment_id is not None}
    assert parent.state.is_completed(), parent.state
    assert {k: c.state.name for k, c in by_deployment.items()} == {
        "prepare-cpu": "Completed", "train-cpu": "Completed"}
    prepare, train = by_deployment["prepare-cpu"], by_deployment["train-cpu"]
    assert "shards" in _task_states(deployed, str(prepare.id))
    assert not {"ingest", "tokenizer", "shards"} & set(_task_states(deployed, str(train.id)))
    mlflow = MlflowClient(tracking_uri=deployed["env"]["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("deploy-test")
    (run,) = mlflow.search_runs([experiment.experiment_id],
                                filter_string=f"tags.`prefect.flow_run_id` = '{parent_id}'")
    assert run.info.status == "FINISHED"
    # The child got the run's id and the prepared manifests (JSON): the same shards.
    assert train.parameters["mlflow_run_id"] == run.info.run_id
    assert train.parameters["data"]["shards"]["digest"] == run.data.tags["digest.shards"]
    assert run.data.params["train.max_steps"] == "2"
    # One name: the parent flow run's, the MLflow run's and the train-evaluate child's.
    assert run.info.run_name == parent.name == train.name
    assert "eval/mlm_accuracy" in run.data.metrics
