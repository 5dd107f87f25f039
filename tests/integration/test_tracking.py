"""MLflow tracking against a real SQLite backend (one database for the whole module)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_pipeline.config import PipelineConfig, TrackingConfig
from mlm_pipeline.config_files import flatten
from mlm_pipeline.tracking.sink import MlflowSink
from mlm_pipeline.tracking.tracker import (
    MlflowTracker,
    git_commit,
    resolve_tracking_uri,
)

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "tracking-tests"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def uri(root) -> str:
    return f"sqlite:///{root}/mlflow.db"  # root is absolute: sqlite:////...


@pytest.fixture(scope="module")
def tracker(uri) -> MlflowTracker:
    return MlflowTracker(uri, experiment_name=EXPERIMENT, run_name="unit-run")


@pytest.fixture(scope="module")
def client(uri) -> MlflowClient:
    """An independent reader of the same database."""
    return MlflowClient(tracking_uri=uri)


def _expected_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def test_git_commit_is_the_checkout_head():
    assert git_commit() == _expected_commit()


def test_start_run_logs_flattened_config_and_tags(tracker, client, root):
    params = flatten(PipelineConfig())
    tags = {"prefect.flow_run_id": "0b1c-flow", "digest.shards": "f" * 64,
            "mlflow.source.git.commit": str(git_commit())}
    run_id = tracker.start_run(params, tags)

    run = client.get_run(run_id)
    assert run.data.params == {k: str(v) for k, v in params.items()}
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.params["train.betas"] == "0.9,0.98"
    for key, value in tags.items():
        assert run.data.tags[key] == value
    assert run.info.run_name == "unit-run"
    assert run.info.status == "RUNNING"
    # New experiment on SQLite: artifacts next to the database, not under the cwd.
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == EXPERIMENT
    assert exp.artifact_location == str(root / "mlartifacts" / EXPERIMENT)
    assert run.info.artifact_uri == f"{root}/mlartifacts/{EXPERIMENT}/{run_id}/artifacts"
    # The same experiment is reused, not created twice.
    assert client.get_run(tracker.start_run({}, {})).info.experiment_id == exp.experiment_id


def test_many_and_long_params_are_batched_and_truncated(tracker, client, caplog):
    params = {f"p.{i:03d}": i for i in range(250)}
    params["long"] = "x" * (MAX_PARAM_VAL_LENGTH + 1000)
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.tracker"):
        run_id = tracker.start_run(params, {})
    got = client.get_run(run_id).data.params
    assert len(got) == 251
    assert got["p.249"] == "249"
    assert got["long"] == "x" * MAX_PARAM_VAL_LENGTH
    assert any("'long'" in r.getMessage() for r in caplog.records)


def test_experiment_name_is_made_path_safe(uri, root, client):
    tracker = MlflowTracker(uri, experiment_name="team a/exp:1")
    exp = client.get_experiment(tracker.experiment_id())
    assert exp.name == "team a/exp:1"
    assert exp.artifact_location == str(root / "mlartifacts" / "team_a_exp_1")


def test_deleted_experiment_is_an_error(uri, client):
    tracker = MlflowTracker(uri, experiment_name="..")
    assert client.get_experiment(tracker.experiment_id()).artifact_location.endswith(
        "/mlartifacts/_"
    )
    client.delete_experiment(tracker.experiment_id())
    with pytest.raises(ValueError, match="'..'.*deleted"):
        tracker.start_run({}, {})


class CountingSink(MlflowSink):
    """Counts `log_batch` requests; every request still reaches MLflow."""

    def __init__(self, *args, fail_first: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.sends: list[int] = []
        self.fail_first = fail_first

    def _send(self, batch):
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("tracking server unreachable")
        self.sends.append(len(batch))
        super()._send(batch)


def _history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                key=lambda m: m.step)]


def test_mlflow_sink_sends_every_value_in_few_batches(tracker, client, uri):
    run_id = tracker.start_run({}, {})
    sink = CountingSink(run_id, uri, flush_every=50, flush_interval_s=3600)
    expected: dict[str, list[tuple[int, float]]] = {
        "train/loss": [], "train/lr": [], "train/tokens_per_s": []
    }
    for step in range(1, 121):
        metrics = {"train/loss": 10.0 / step, "train/lr": 1e-3 * step / 120,
                   "train/tokens_per_s": 1000.0 + 3 * step}
        for key, value in metrics.items():
            expected[key].append((step, value))
        sink.log(metrics, step)
    sink.close()

    assert len(sink.sends) <= math.ceil(120 / 50) + 1
    assert sum(sink.sends) == sink.sent == 360
    for key, values in expected.items():
        assert _history(client, run_id, key) == values
    assert client.get_run(run_id).data.metrics["train/loss"] == 10.0 / 120


def test_mlflow_sink_caps_batches_at_1000_metrics(tracker, client, uri):
    run_id = tracker.start_run({}, {})
    sink = CountingSink(run_id, uri, flush_every=10_000, flush_interval_s=3600)
    for step in range(333):
        sink.log({"a": float(step), "b": 2.0 * step, "c": 3.0 * step}, step)
    assert sink.sends == []  # 999 metrics buffered: not due yet
    for step in range(333, 400):
        sink.log({"a": float(step), "b": 2.0 * step, "c": 3.0 * step}, step)
    sink.close()
    # Due at 1002 buffered metrics (record 334): 1000 + 2; the last 66 records on close.
    assert sink.sends == [1000, 2, 198]
    assert _history(client, run_id, "c") == [(s, 3.0 * s) for s in range(400)]


def test_mlflow_sink_drops_and_counts_non_finite(tracker, client, uri, caplog):
    run_id = tracker.start_run({}, {})
    sink = tracker.sink(run_id)
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.sink"):
        sink.log({"train/loss": 1.0}, 0)
        sink.log({"train/loss": float("nan"), "train/grad_norm": 2.0}, 1)
        sink.log({"train/loss": float("inf")}, 2)
        sink.close()
    assert sink.dropped_nonfinite == {"train/loss": 2}
    assert _history(client, run_id, "train/loss") == [(0, 1.0)]
    assert _history(client, run_id, "train/grad_norm") == [(1, 2.0)]
    assert any("non-finite" in r.getMessage() for r in caplog.records)


def test_mlflow_sink_rejects_illegal_key_and_buffers_nothing(tracker, client, uri):
    run_id = tracker.start_run({}, {})
    sink = tracker.sink(run_id)
    with pytest.raises(ValueError, match=r"'train/mfu\(%\)'"):
        sink.log({"train/loss": 1.0, "train/mfu(%)": 40.0}, 0)
    sink.close()
    assert client.get_run(run_id).data.metrics == {}
    with pytest.raises(RuntimeError, match="closed"):
        sink.log({"train/loss": 1.0}, 1)


def test_mlflow_sink_keeps_metrics_when_an_automatic_send_fails(tracker, client, uri, caplog):
    run_id = tracker.start_run({}, {})
    sink = CountingSink(run_id, uri, flush_every=1, flush_interval_s=3600, fail_first=1)
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.sink"):
        for step in range(3):
            sink.log({"train/loss": float(step)}, step)
    sink.close()
    assert any("kept for retry" in r.getMessage() for r in caplog.records)
    assert _history(client, run_id, "train/loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_log_metrics_at_a_step(tracker, client):
    run_id = tracker.start_run({}, {})
    tracker.log_metrics(run_id, {"eval/loss": 2.5, "eval/perplexity": float("inf")}, step=7)
    tracker.log_metrics(run_id, {"eval/loss": 2.0})
    assert _history(client, run_id, "eval/loss") == [(0, 2.0), (7, 2.5)]
    assert "eval/perplexity" not in client.get_run(run_id).data.metrics


def test_artifacts_dict_and_failed_status(tracker, client, tmp_path, root):
    ckpt = tmp_path / "step_000010"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 10}')
    (ckpt / "sub" / "model.bin").write_bytes(bytes(range(256)) * 4)
    note = tmp_path / "tokenizer.model"
    note.write_bytes(b"spm")

    run_id = tracker.start_run({}, {})
    tracker.log_artifacts(run_id, ckpt, "checkpoint")
    tracker.log_artifacts(run_id, note, "tokenizer")
    tracker.log_dict(run_id, {"digest": "ab", "path": Path("/data/x")}, "manifests/train.json")

    top = {f.path: f.is_dir for f in client.list_artifacts(run_id)}
    assert top == {"checkpoint": True, "tokenizer": True, "manifests": True}
    assert {f.path for f in client.list_artifacts(run_id, "checkpoint")} == {
        "checkpoint/state.json", "checkpoint/sub"
    }
    [model] = client.list_artifacts(run_id, "checkpoint/sub")
    assert (model.path, model.file_size) == ("checkpoint/sub/model.bin", 1024)
    stored = root / "mlartifacts" / EXPERIMENT / run_id / "artifacts"
    assert (stored / "checkpoint" / "sub" / "model.bin").read_bytes() == bytes(range(256)) * 4
    assert (stored / "tokenizer" / "tokenizer.model").read_bytes() == b"spm"
    assert json.loads((stored / "manifests" / "train.json").read_text()) == {
        "digest": "ab", "path": "/data/x"
    }
    with pytest.raises(FileNotFoundError, match="missing"):
        tracker.log_artifacts(run_id, tmp_path / "missing", "x")

    tracker.end_run(run_id, "FAILED")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None
    with pytest.raises(ValueError, match="DONE"):
        tracker.end_run(run_id, "DONE")  # type: ignore[arg-type]


def test_resolve_tracking_uri_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env-host:5000")
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="sqlite:////srv/m.db")) == (
        "sqlite:////srv/m.db"
    )
    assert resolve_tracking_uri(TrackingConfig()) == "http://env-host:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    expected = f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri(TrackingConfig()) == expected
    assert mlflow.get_tracking_uri() == expected  # MLflow's own default, same database


def test_from_config_and_run_url(uri):
    cfg = TrackingConfig(tracking_uri=uri, experiment_name="e", run_name="r")
    tracker = MlflowTracker.from_config(cfg)
    assert (tracker.tracking_uri, tracker.experiment_name, tracker.run_name) == (uri, "e", "r")
    assert tracker.run_url("abc") is None  # no UI for a SQLite URI
    remote = MlflowTracker("http://127.0.0.1:5000/")  # no connection is made
    assert remote.run_url("abc", experiment_id="3") == (
        "http://127.0.0.1:5000/#/experiments/3/runs/abc/model-metrics"
        "?workflowType=machine_learning")


def test_import_is_cheap_and_telemetry_is_off_by_default(tmp_path):
    code = (
        "import os, sys\n"
        "import mlm_pipeline.tracking.tracker as t\n"
        "heavy = [m for m in ('mlflow', 'torch', 'prefect') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "t.MlflowTracker('http://127.0.0.1:9').client\n"
        "print(os.environ.get('MLFLOW_DISABLE_TELEMETRY'), 'mlflow' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["true", "True"]


@pytest.fixture
def moved_to_server(tmp_path):
    """An experiment created on a local SQLite store, then an MLflow server (served
    artifacts under `served/`) started on that same database: (http URI, served dir)."""
    from tests.deploy.conftest import _stop, _wait_healthy, free_port

    db = f"sqlite:///{tmp_path}/mlflow.db"
    local = MlflowTracker(db, experiment_name="made-locally")
    local.end_run(local.start_run({}, {}))
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", db,
         "--artifacts-destination", str(tmp_path / "served"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}", tmp_path / "served"
    finally:
        _stop(proc)


@pytest.mark.parametrize(("uri", "location", "warns"), [
    ("http://127.0.0.1:5000", "/srv/mlartifacts/exp", True),
    ("https://mlflow.example", "file:///srv/mlartifacts/exp", True),
    ("http://127.0.0.1:5000", "mlflow-artifacts:/1", False),
    ("http://127.0.0.1:5000", "s3://bucket/mlflow/1", False),
    ("sqlite:////srv/mlflow.db", "/srv/mlartifacts/exp", False),  # local store: as it should
])
def test_local_artifact_location_rule(uri, location, warns, caplog):
    tracker = MlflowTracker(uri, experiment_name=f"rule-{warns}")
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.tracker"):
        tracker._check_artifact_location(location, location)  # a distinct id per case
        tracker._check_artifact_location(location, location)
    found = [r for r in caplog.records if "local artifact location" in r.message]
    assert len(found) == (1 if warns else 0)


# Starting the MLflow server takes ~10-25 s on 2 busy cores.
@pytest.mark.slow
@pytest.mark.full
def test_local_artifact_location_on_a_server_warns_once_new_experiments_go_through_it(
        moved_to_server, caplog, tmp_path):
    uri, served = moved_to_server
    client = MlflowClient(tracking_uri=uri)
    old = MlflowTracker(uri, experiment_name="made-locally")
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.tracker"):
        old_id = old.experiment_id()
        old.experiment_id()  # once per experiment, not per call
    assert client.get_experiment(old_id).artifact_location == str(
        tmp_path / "mlartifacts" / "made-locally")
    warnings = [r.getMessage() for r in caplog.records if "local artifact location" in r.message]
    assert len(warnings) == 1
    assert "'made-locally'" in warnings[0] and str(tmp_path / "mlartifacts") in warnings[0]
    assert f"mlflow experiments rename --experiment-id {old_id}" in warnings[0]

    caplog.clear()
    new = MlflowTracker(uri, experiment_name="made-on-the-server")
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.tracking.tracker"):
        run_id = new.start_run({}, {})
    assert not [r for r in caplog.records if "local artifact location" in r.message]
    exp = client.get_experiment(new.experiment_id())
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    # an artifact of the new experiment's run lands in the server's artifact store
    new.log_dict(run_id, {"a": 1}, "probe/a.json")
    new.end_run(run_id)
    assert [p.name for p in served.rglob("a.json")] == ["a.json"]


def test_summary_ui_lines_open_the_runs_table_in_training_mode():
    """The UI links of the run summary: the experiment's runs and the run's charts with
    `workflowType=machine_learning` (a fresh browser profile would otherwise open MLflow's
    GenAI view), after the `mlflow ui` command for a SQLite store."""
    from mlm_pipeline.app.runlog import ui_lines

    local = {"mlflow_tracking_uri": "sqlite:////tmp/x/mlflow.db", "mlflow_experiment_id": "4",
             "mlflow_run_id": "0123abcd"}
    assert ui_lines(local) == [
        "Open the UI:   mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db --port 5000",
        "Runs, charts:  http://127.0.0.1:5000/#/experiments/4/runs"
        "?workflowType=machine_learning&compareRunsMode=CHART",
        "Run page:      http://127.0.0.1:5000/#/experiments/4/runs/0123abcd/model-metrics"
        "?workflowType=machine_learning",
    ]
    served = {**local, "mlflow_tracking_uri": "https://mlflow.example.org/"}
    assert ui_lines(served) == [
        "Runs, charts:  https://mlflow.example.org/#/experiments/4/runs"
        "?workflowType=machine_learning&compareRunsMode=CHART",
        "Run page:      https://mlflow.example.org/#/experiments/4/runs/0123abcd/model-metrics"
        "?workflowType=machine_learning",
    ]
