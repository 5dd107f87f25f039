"""The mlm-pretraining flow on the tiny test corpus, with a real Prefect API and MLflow."""

import importlib
import json
import pkgutil
import shutil
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import mlm_pipeline_flows
from mlm_pipeline_flows.prepare_data import prepare_data_flow
from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
from tests.faults.mlm_faults import nan_at_step
from tests.mlflow_history import assert_one_point_per_step

ASSETS = Path(__file__).resolve().parents[1] / "assets"
#: For the tests not about the model: no export, MLflow model or registry (which cost a
#: `transformers` pipeline and `mlflow.transformers.log_model` per run).
NO_MODEL = "tracking.log_model=false"


@pytest.mark.parametrize(
    "name", [m.name for m in pkgutil.iter_modules(mlm_pipeline_flows.__path__)])
def test_every_flow_module_imports(name):
    importlib.import_module(f"mlm_pipeline_flows.{name}")


def _overrides(tmp_path, uri):
    return [
        f"work_dir={tmp_path / 'work'}",
        f"ingest.sources=[{ASSETS / 'tiny_fr.txt'}]",
        "ingest.validation_fraction=0.15",
        "tokenizer.vocab_size=128",
        "shards.seq_len=16",
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.intermediate_size=64",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.log_every=2",
        "eval.max_rows=20",
        "linear_probe.enabled=false",  # its data comes from PyPI (tests/flows/test_flow_evaluation.py)
        f"tracking.tracking_uri={uri}",
        "tracking.experiment_name=flow-test",
    ]


def test_flow_logs_a_complete_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    state = mlm_pretraining(
        PretrainParams(config="tiny", overrides=_overrides(tmp_path, uri)), return_state=True
    )
    assert state.is_completed()
    summary = state.result()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    # params: the flattened config, overrides applied
    assert run.data.params["train.max_steps"] == "6"
    assert run.data.params["tokenizer.vocab_size"] == "128"
    assert run.data.params["train.warmup_in_effect"] == "2"  # warmup_steps=2 overrides
    # lineage tags: every data stage digest, as the manifests record it
    for stage in ("corpus", "tokenizer", "shards"):
        path = summary["manifests"]["ingest" if stage == "corpus" else stage]
        assert run.data.tags[f"digest.{stage}"] in Path(path).read_text()
    assert run.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    # per-step training metrics (steps 2, 4, 6) and eval metrics
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6]
    for key in ("eval/loss", "eval/mlm_accuracy", "eval/perplexity", "eval/baseline_accuracy"):
        assert key in run.data.metrics
    assert run.data.metrics["eval/mlm_accuracy"] == summary["metrics"]["eval/mlm_accuracy"]
    # artifacts: tokenizer and final checkpoint
    names = {a.path for a in client.list_artifacts(run.info.run_id, "tokenizer")}
    assert names == {"tokenizer/spm.model", "tokenizer/spm.vocab", "tokenizer/manifest.json"}
    # The downloaded model knows its corpus's normalization (tiny ingests with NFC).
    from mlm_pipeline.tokenizer import Tokenizer

    got = Path(client.download_artifacts(run.info.run_id, "tokenizer", str(tmp_path)))
    assert Tokenizer.load(got / "spm.model").normalization == "NFC"
    # The resumable state stays local (tracking.log_training_state is off by default) ...
    assert client.list_artifacts(run.info.run_id, "checkpoints") == []
    assert (Path(summary["checkpoint"]) / "optimizer.pt").is_file()
    # ... the exported model is the run's MLflow model, registered under the experiment
    # name: the first version is champion and challenger.
    version = client.get_model_version_by_alias("flow-test", "champion")
    assert int(version.version) == 1 and version.run_id == run.info.run_id
    assert int(client.get_model_version_by_alias("flow-test", "challenger").version) == 1
    assert run.data.tags["registry.decision"] == "first"
    assert run.data.tags["registry.shards"] == run.data.tags["digest.shards"]
    assert run.data.metrics["registry/eval_loss"] == run.data.metrics["eval/loss"]
    assert summary["registry"]["decision"] == "first" and summary["registry"]["version"] == 1
    assert summary["registry"]["eval_loss"] == run.data.metrics["eval/loss"]
    logged = client.get_logged_model(run.data.tags["mlm.model_uri"].removeprefix("models:/"))
    assert logged.source_run_id == run.info.run_id
    assert {m.key: m.step for m in logged.metrics}["eval/loss"] == 6  # step = final step
    # The model logged and linked to the final points: each metric once per step.
    assert assert_one_point_per_step(client, run.info.run_id) > 10
    from mlm_pipeline.app.summary import summary_markdown

    assert "## Model registry" in summary_markdown(summary)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One completed flow run of `_overrides` without the model (`NO_MODEL`), shared by the
    module's tests that only read a finished run or start from it: (its folder, tracking
    URI, final state, run summary). A test adds runs to its store only where it says so."""
    folder = tmp_path_factory.mktemp("finished-run")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    state = mlm_pretraining(
        PretrainParams(config="tiny", overrides=_overrides(folder, uri) + [NO_MODEL]),
        return_state=True,
    )
    assert state.is_completed()
    # No model logged: each metric once per step.
    assert_one_point_per_step(MlflowClient(tracking_uri=uri), state.result()["mlflow_run_id"])
    return folder, uri, state, state.result()


def test_a_failing_stage_fails_the_flow_and_the_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = _overrides(tmp_path, uri) + [f"ingest.sources=[{tmp_path / 'missing.txt'}]"]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_failed()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def run_tree(flow_run_id) -> list:
    """The ids of a flow run and of its child flow runs (subflows: prepare-data and
    train-evaluate under mlm-pretraining)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    return [flow_run_id, *(c.id for c in children)]


def _stage_states(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_tree(flow_run_id)))
        )
    states: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: r.expected_start_time):
        stage = r.name.rsplit("-", 1)[0]
        if stage in ("ingest", "tokenizer", "shards"):
            states.setdefault(stage, []).append(r.state.name)
    return {k: v[0] if len(v) == 1 else v for k, v in states.items()}


def _result_files() -> set[Path]:
    """Every file in Prefect's local result storage (this session's `PREFECT_HOME`)."""
    from prefect.settings import get_current_settings

    storage = Path(get_current_settings().results.local_storage_path)
    return {p for p in storage.rglob("*") if p.is_file()} if storage.exists() else set()


@pytest.mark.slow  # 20 s of whole pipelines: in the push tier, not the fast suite
def test_data_stages_are_reused_by_content(tmp_path):
    """A rerun finds each data stage's complete output by its digest (the stages' own
    lookup: Prefect persists no result, so there is no record to plant or to read); the
    tasks complete, and the run summary lists the stages made by an earlier run.

    The first two runs are whole pipelines (the summary's `reused_stages`); the variations
    after them run the `prepare-data` flow, the same three tasks with the same lookup,
    and tell reuse the way the summary does: a stage whose manifest was created before the
    run started was reused."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ASSETS / "tiny_fr.txt").read_bytes())
    base = _overrides(tmp_path, uri) + [f"ingest.sources=[{corpus}]", "train.max_steps=2",
                                        "train.warmup_steps=1", "eval.probes=[]", NO_MODEL]
    data_stages = ("ingest", "tokenizer", "shards")
    completed = dict.fromkeys(data_stages, "Completed")
    records_before = _result_files()

    def run(*extra):
        """The data stages reused by one pipeline run (a set of names)."""
        state = mlm_pretraining(PretrainParams(config="tiny", overrides=base + list(extra)),
                                return_state=True)
        assert state.is_completed()
        assert _stage_states(state.state_details.flow_run_id) == completed
        return set(state.result()["reused_stages"]) & set(data_stages)

    def prepare(*extra):
        """The data stages reused by one prepare-data run (a set of names)."""
        params = PretrainParams(config="tiny", overrides=base + list(extra))
        started_at = time.time()
        state = prepare_data_flow(params, return_state=True)
        assert state.is_completed()
        assert _stage_states(state.state_details.flow_run_id) == completed
        manifests = state.result().load(params.load())
        return {m.stage for m in manifests if m.created_at < started_at}

    assert run() == set()
    shards_dir = tmp_path / "work" / "shards"
    made = {p: p.stat().st_mtime_ns for p in shards_dir.rglob("*") if p.is_file()}
    # Same config and bytes: every data stage is reused, its files untouched.
    assert run() == set(data_stages)
    assert {p: p.stat().st_mtime_ns for p in shards_dir.rglob("*") if p.is_file()} == made
    assert prepare() == set(data_stages)
    # Only the vocabulary changes: ingestion is reused, the rest reruns.
    assert prepare("tokenizer.vocab_size=120") == {"ingest"}
    # The same bytes under another name and directory: still reused (content, not paths).
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "corpus.txt").write_bytes(corpus.read_bytes())
    assert prepare(f"ingest.sources=[{moved / 'corpus.txt'}]") == set(data_stages)
    # One byte of the input changes: everything downstream reruns.
    data = bytearray(corpus.read_bytes())
    data[10] = ord("X") if data[10] != ord("X") else ord("Y")
    corpus.write_bytes(bytes(data))
    assert prepare() == set()
    # Another work directory (another checkout, say) builds its own outputs there.
    other = tmp_path / "work2"
    assert prepare(f"work_dir={other}") == set()
    assert {p.name for p in other.iterdir()} >= {"ingest", "tokenizer", "shards"}
    # Outputs deleted behind the flow's back: recomputed, not reused.
    shutil.rmtree(tmp_path / "work" / "shards")
    assert prepare() == {"ingest", "tokenizer"}
    # No Prefect result record was written: nothing a later run would read back.
    assert _result_files() == records_before


def test_flow_run_publishes_prefect_artifacts(finished_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    _, _, state, summary = finished_run
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=run_tree(state.state_details.flow_run_id))))
    by_key = {a.key: a for a in artifacts}
    assert summary["mlflow_run_id"] in by_key["run-summary"].data
    assert f"{summary['metrics']['eval/mlm_accuracy']:,.4f}" in by_key["run-summary"].data
    rows = json.loads(by_key["ingestion-accounting"].data)
    manifest = json.loads(Path(summary["manifests"]["ingest"]).read_text())
    counts = {(r["what"], r["reason"]): r["documents"] for r in rows}
    assert counts[("read", "")] == manifest["documents_read"]
    assert counts[("kept (validation)", "")] == manifest["documents_validation"]
    for reason, n in manifest["dropped"].items():
        assert counts[("dropped", reason)] == n
    assert float(by_key["training-progress"].data) == 100.0


def test_resume_a_crashed_run(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _overrides(tmp_path, uri) + ["train.checkpoint_every=2", "eval.probes=[]", NO_MODEL]
    first = mlm_pretraining(PretrainParams(config="tiny", overrides=base), return_state=True)
    run_id = first.result()["mlflow_run_id"]
    # What a crash after step 4's checkpoint leaves: no final checkpoint, a FAILED run.
    run_dir = tmp_path / "work" / "train" / run_id
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    (run_dir / "manifest.json").unlink()
    client = MlflowClient(tracking_uri=uri)
    client.set_terminated(run_id, "FAILED")

    caplog.set_level("INFO", logger="mlm_pipeline")
    second = mlm_pretraining(
        PretrainParams(config="tiny", overrides=base + [f"tracking.resume_run_id={run_id}"]),
        return_state=True,
    )
    summary = second.result()
    assert summary["mlflow_run_id"] == run_id
    assert "resuming at step 4" in caplog.text
    # The continued run keeps its name, which the continuing flow run takes.
    assert client.get_run(run_id).info.run_name == _flow_run_name(
        first.state_details.flow_run_id) == _flow_run_name(second.state_details.flow_run_id)
    # ... and so do its subflows, and the run's tag naming the flow run
    name = client.get_run(run_id).info.run_name
    assert {_flow_run_name(i) for i in run_tree(second.state_details.flow_run_id)} == {name}
    assert client.get_run(run_id).data.tags["prefect.flow_run_name"] == name
    assert client.get_run(run_id).info.status == "FINISHED"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    # Resumed from step 4: each metric once per step, the steps trained twice included.
    assert assert_one_point_per_step(client, run_id) > 10


def test_resume_refuses_a_changed_config(finished_run):
    # The refusal comes before the run is touched: the shared run stays as it was.
    folder, uri, _, summary = finished_run
    base = _overrides(folder, uri) + [NO_MODEL]
    run_id = summary["mlflow_run_id"]
    state = mlm_pretraining(
        PretrainParams(config="tiny", overrides=base + ["train.lr=0.5",
                                                        f"tracking.resume_run_id={run_id}"]),
        return_state=True,
    )
    assert state.is_failed()
    assert "train.lr" in str(state.message)


def test_a_non_finite_loss_fails_the_run_with_its_reason_and_no_retry(tmp_path, monkeypatch):
    nan_at_step(3, monkeypatch.setattr)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = _overrides(tmp_path, uri) + ["train.checkpoint_every=2"]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_failed()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert run.info.status == "FAILED"
    tags = run.data.tags
    assert tags["mlm.error"].startswith("NonFiniteLossError: ")
    assert tags["mlm.error_step"] == "3"
    assert tags["mlm.last_checkpoint"].endswith("step-00000002")
    assert "step 3" in tags["mlflow.note.content"]
    # nothing non-finite was logged, and no checkpoint exists past the bad step
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2]
    ckpts = sorted((tmp_path / "work" / "train" / run.info.run_id / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-00000002"]
    # the train task ran once: a non-finite loss is not something a retry cures
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        runs = prefect.read_task_runs()
    train_runs = [r for r in runs if r.name.rsplit("-", 1)[0] == "train"  # not train-evaluate
                  and r.flow_run_id in run_tree(state.state_details.flow_run_id)]
    assert len(train_runs) == 1 and train_runs[0].run_count == 1


def _flow_run_name(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name


def test_the_mlflow_run_is_complete_and_shares_the_flow_runs_name(tmp_path, finished_run):
    import getpass
    import re

    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    folder, uri, state, summary = finished_run
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    flow_run_id = state.state_details.flow_run_id
    # One name: the flow run's, from the config name, the preset (tiny: modern) and steps.
    assert run.info.run_name == _flow_run_name(flow_run_id)
    assert re.fullmatch(r"tiny-modern-6-[0-9a-f]{6}", run.info.run_name)
    # The two shard splits are dataset inputs with the shards manifest's digest.
    shards = json.loads(Path(summary["manifests"]["shards"]).read_text())
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"shards-train", "shards-validation"}
    for split, context in (("train", "training"), ("validation", "validation")):
        given = inputs[f"shards-{split}"]
        assert given.dataset.digest == shards["digest"][:36]
        assert {t.key: t.value for t in given.tags}[MLFLOW_DATASET_CONTEXT] == context
        profile = json.loads(given.dataset.profile)
        assert profile["rows"] == shards[split]["rows"]
        assert profile["tokens"] == shards[split]["rows"] * shards["seq_len"]
        assert json.loads(given.dataset.source)["uri"] == Path(
            summary["manifests"]["shards"]).parent.resolve().as_uri()
    exp_id = run.info.experiment_id
    found = client.search_runs([exp_id], f"dataset.digest = '{shards['digest'][:36]}'")
    assert [r.info.run_id for r in found] == [run.info.run_id]
    # System metrics were sampled while training ran.
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)
    assert any(k.startswith("system/system_memory_usage") for k in run.data.metrics)
    # Tags: user, source, commit (when run from a checkout), the Prefect flow run.
    tags = run.data.tags
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["mlflow.source.name"] == "flows/pretraining.py:mlm_pretraining"
    assert tags["mlflow.source.type"] == "LOCAL"
    assert re.fullmatch(r"[0-9a-f]{40}", tags.get("mlflow.source.git.commit", "0" * 40))
    assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")
    assert tags["mlflow.note.content"].startswith("# mlm-pretraining run")
    assert f"`{run.info.run_id}`" in tags["mlflow.note.content"]
    # The experiment opens on the UI's training view.
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    # Data accounting: params and an artifact, no one-point metrics.
    corpus = json.loads(Path(summary["manifests"]["ingest"]).read_text())
    assert not [k for k in run.data.metrics if k.startswith("data/")]
    assert run.data.params["data.documents_read"] == str(corpus["documents_read"])
    assert run.data.params["data.train_rows"] == str(shards["train"]["rows"])
    got = Path(client.download_artifacts(run.info.run_id, "data/accounting.json", str(tmp_path)))
    assert json.loads(got.read_text())["documents_validation"] == corpus["documents_validation"]

    # tracking.run_name names both runs (a new run in the shared store: the first one is
    # FINISHED).
    named = mlm_pretraining(PretrainParams(config="tiny", overrides=_overrides(folder, uri) + [
        "tracking.run_name=my-named-run", "train.max_steps=2", "train.warmup_steps=1",
        NO_MODEL]),
        return_state=True)
    run = client.get_run(named.result()["mlflow_run_id"])
    assert run.info.run_name == "my-named-run"
    assert {_flow_run_name(i) for i in run_tree(named.state_details.flow_run_id)} == {
        "my-named-run"}  # the subflows too
