"""The whole pipeline with its work directory and its MLflow artifacts on an S3 API.

A real S3 API: moto's server on loopback (in this process, behind a WSGI wrapper that
records every request), a real MLflow server whose artifact store is a bucket of it
(`--artifacts-destination s3://...`, the runs upload through the server), and
`mlm-pipeline run` in fresh processes, each with its own local cache directory
(`MLM_PIPELINE_CACHE`) and Prefect home: a second machine. The corpus itself is an
`s3://` source. Credentials and the endpoint reach s3fs only from the environment.

What is checked, independently of the code under test:
* the store holds every stage's output, each object with the sha256 its manifest records
  (hashed here from the bytes boto3 reads), and exactly the checkpoints the run kept;
* the MLflow run's artifacts are objects of the bucket, under the server's destination;
* a second machine re-running the same config reads no byte of the corpus (no GET of a
  corpus object: the stage digest comes from the store's hash memo and the objects' ETags)
  and none of the ingested documents, trains from the store's shards, and adds no data
  stage output to the store;
* a run killed on one machine after a checkpoint resumes on another from that checkpoint,
  in the same MLflow run.

The machines share one Prefect server (`prefect_api_url`, as a team's machines would) instead
of each run starting its own local API. Both tests are the `full` tier: CI runs them in one
slice of the landings, every one with CI_FULL=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")
pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

pytestmark = [pytest.mark.slow, pytest.mark.full]
ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "mlm-pipeline"
BUCKET = "mlm"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1"}


class RecordingMotoServer(moto_server.ThreadedMotoServer):
    """moto's threaded server, recording (method, path, query) of every request."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.requests: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def _server_entry(self) -> None:
        app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)

        def recording(environ, start_response):
            with self._lock:
                self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                      environ.get("QUERY_STRING", "")))
            return app(environ, start_response)

        self._server = moto_server.make_server(self._ip_address, self._port, recording, True,
                                               request_handler=moto_server.MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    def object_gets(self, since: int = 0) -> list[str]:
        """Keys (`bucket/key`) of the GetObject requests after the first `since` requests."""
        with self._lock:
            return [path.lstrip("/") for method, path, query in self.requests[since:]
                    if method == "GET" and path.count("/") >= 2 and "list-type" not in query
                    and not path.endswith("/")]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(endpoint URL, recording server, boto3 client) with the bucket and the corpus."""
    server = RecordingMotoServer()
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="corpus/tiny_fr.txt",
                      Body=(ROOT / "tests" / "assets" / "tiny_fr.txt").read_bytes())
    try:
        yield url, server, client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mlflow_server(s3, tmp_path_factory):
    """An MLflow server (SQLite backend) whose artifacts go to `s3://mlm/mlflow`."""
    from tests.servers import free_port
    from tests.servers import stop as _stop
    from tests.servers import wait_healthy as _wait_healthy

    url, _, _ = s3
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port, log = free_port(), tmp / "server.log"
    env = {**os.environ, **KEYS, "MLFLOW_S3_ENDPOINT_URL": url,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
         f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", f"s3://{BUCKET}/mlflow",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _config(tmp: Path, tracking_uri: str, name: str, max_steps: int = 30,
            work: str = "work") -> Path:
    cfg = {
        "name": name,
        "work_dir": f"s3://{BUCKET}/{work}",
        "ingest": {"sources": [f"s3://{BUCKET}/corpus/tiny_fr.txt"], "validation_fraction": 0.1},
        "tokenizer": {"vocab_size": 128},
        "shards": {"seq_len": 32, "rows_per_shard": 16},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
        "train": {"micro_batch_size": 4, "max_steps": max_steps, "warmup_steps": 3,
                  "log_every": 1, "checkpoint_every": 5, "keep_last_checkpoints": 2,
                  "precision": "fp32", "seed": 3},
        "eval": {"batch_size": 8, "probes": []},
        "linear_probe": {"enabled": False},
        "tracking": {"tracking_uri": tracking_uri, "experiment_name": name, "log_model": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(machine: Path, endpoint: str, **extra: str) -> dict[str, str]:
    """A machine: its own cache directory and Prefect home; S3 from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "AWS_"))}
    env.update(KEYS, FSSPEC_S3_ENDPOINT_URL=endpoint, FSSPEC_S3_KEY="testing",
               FSSPEC_S3_SECRET="testing", MLM_PIPELINE_CACHE=str(machine / "cache"),
               PREFECT_HOME=str(machine / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true", **extra)
    return env


def _run(machine: Path, config: Path, endpoint: str, api_url: str) -> subprocess.CompletedProcess:
    machine.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([str(CLI), "run", str(config)], cwd=machine,
                         env=_env(machine, endpoint, PREFECT_API_URL=api_url),
                         capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _keys(client, prefix: str) -> dict[str, int]:
    """{key: size} of every object under `prefix`."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def _sha256(client, key: str) -> str:
    return hashlib.sha256(client.get_object(Bucket=BUCKET, Key=key)["Body"].read()).hexdigest()


def _manifest(client, stage: str) -> tuple[str, dict]:
    """(directory key, manifest) of the one output of `stage` in the store."""
    [key] = [k for k in _keys(client, f"work/{stage}/") if k.endswith("/manifest.json")
             and k.count("/") == 3]
    return key.rsplit("/", 1)[0], json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"]
                                              .read())


def _listed(manifest: dict) -> list[tuple[str, int, str]]:
    """(path, bytes, sha256) of every file entry of a manifest (JSON), at any depth."""
    found = []

    def walk(obj):
        if isinstance(obj, dict):
            if {"path", "bytes", "sha256"} <= obj.keys():
                found.append((obj["path"], obj["bytes"], obj["sha256"]))
            else:
                for v in obj.values():
                    walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk({k: v for k, v in manifest.items() if k not in ("sources", "config")})
    return found


def test_work_dir_and_artifacts_in_s3_and_a_second_machine_reads_no_corpus(
        s3, mlflow_server, prefect_api_url, tmp_path):
    from mlflow import MlflowClient

    endpoint, server, client = s3
    config = _config(tmp_path, mlflow_server, "s3-work")
    _run(tmp_path / "machine-1", config, endpoint, prefect_api_url)

    # Every data stage's output is in the store, byte for byte what its manifest records.
    for stage in ("ingest", "tokenizer", "shards"):
        prefix, manifest = _manifest(client, stage)
        files = _listed(manifest)
        assert files, stage
        for path, size, sha in files:
            assert _keys(client, f"{prefix}/{path}") == {f"{prefix}/{path}": size}
            assert _sha256(client, f"{prefix}/{path}") == sha
    # The training run: its kept checkpoints (2 of the 6 saved), metrics and manifest.
    runs = {k.split("/")[2] for k in _keys(client, "work/train/")}
    assert len(runs) == 1
    [run_id] = runs
    train_keys = _keys(client, f"work/train/{run_id}/")
    steps = sorted({k.split("/")[4] for k in train_keys if "/checkpoints/" in k})
    assert steps == ["step-00000025", "step-00000030"]
    for step in steps:
        state = json.loads(client.get_object(
            Bucket=BUCKET, Key=f"work/train/{run_id}/checkpoints/{step}/state.json")["Body"].read())
        for name, want in state["files"].items():
            assert _sha256(client, f"work/train/{run_id}/checkpoints/{step}/{name}") == \
                want["sha256"]
    assert f"work/train/{run_id}/metrics.jsonl" in train_keys
    assert f"work/train/{run_id}/manifest.json" in train_keys
    assert _manifest(client, "evaluate")[1]["metrics"]["eval/loss"] > 0
    # The memo of the corpus object's sha256 (keyed by its ETag) is in the store too.
    assert len(_keys(client, "work/.hash-memo/")) == 1

    # MLflow: the run's artifacts are objects under the server's S3 destination.
    mlflow = MlflowClient(tracking_uri=mlflow_server)
    run = mlflow.get_run(run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    artifacts = _keys(client, "mlflow/")
    assert any(f"/{run_id}/artifacts/" in k for k in artifacts), sorted(artifacts)[:20]

    # A second machine, same config: the data stages come from the store.
    data_before = {s: _keys(client, f"work/{s}/") for s in ("ingest", "tokenizer", "shards")}
    since = len(server.requests)
    machine_2 = tmp_path / "machine-2"
    out = _run(machine_2, config, endpoint, prefect_api_url)
    gets = server.object_gets(since)
    kinds = {"corpus": "/corpus/", "documents": ".parquet", "manifests": "/manifest.json",
             "tokenizer": "/spm.", "shards": ".arrow", "memo": "/.hash-memo/"}
    by_kind = {k: sum(p in f"/{g}" for g in gets) for k, p in kinds.items()}
    print(f"machine 2: {len(server.requests) - since} requests, GetObject by prefix: {by_kind}")
    corpus_size = len((ROOT / "tests" / "assets" / "tiny_fr.txt").read_bytes())
    assert not [k for k in gets if k.startswith(f"{BUCKET}/corpus/")], (corpus_size, gets)
    assert not [k for k in gets if k.startswith(f"{BUCKET}/work/ingest/")
                and k.endswith(".parquet")], gets
    assert [k for k in gets if k.startswith(f"{BUCKET}/work/shards/") and k.endswith(".arrow")], "\n".join(gets)
    assert {s: _keys(client, f"work/{s}/") for s in data_before} == data_before
    assert len({k.split("/")[2] for k in _keys(client, "work/train/")}) == 2
    mirror = next((machine_2 / "cache").iterdir())
    assert not list(mirror.glob("ingest/*/*.parquet"))  # documents never downloaded
    assert "Reused:        ingest, tokenizer, shards" in out.stdout
    assert str(machine_2) in out.stdout.split("Tokenizer:", 1)[1].split("\n", 1)[0]


def test_a_run_killed_on_one_machine_resumes_on_another(s3, mlflow_server, prefect_api_url,
                                                        tmp_path):
    from mlflow import MlflowClient

    endpoint, _, client = s3
    config = _config(tmp_path, mlflow_server, "s3-resume", max_steps=400, work="resume")
    machine_1 = tmp_path / "machine-1"
    machine_1.mkdir()
    proc = subprocess.Popen([str(CLI), "run", str(config)], cwd=machine_1,
                            env=_env(machine_1, endpoint, PREFECT_API_URL=prefect_api_url),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    done = []
    while time.monotonic() < deadline and proc.poll() is None:
        done = [k for k in _keys(client, "resume/train/") if k.endswith("/state.json")]
        if done:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the machine is lost: no graceful stop
    output = proc.communicate()[0]
    assert done, output[-3000:]
    [run_id] = {k.split("/")[2] for k in done}

    machine_2 = tmp_path / "machine-2"
    out = _run(machine_2, config, endpoint, prefect_api_url)
    text = out.stdout + out.stderr
    assert "resuming at step" in text, text[-3000:]
    resumed_at = int(text.split("resuming at step", 1)[1].split()[0])
    assert resumed_at >= 5
    mlflow = MlflowClient(tracking_uri=mlflow_server)
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("s3-resume").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # the same MLflow run, continued
    assert runs[0].info.status == "FINISHED"
    history = mlflow.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 401))
    # The run's own log, continued on machine 2 from machine 1's up to the checkpoint.
    log = client.get_object(Bucket=BUCKET, Key=f"resume/train/{run_id}/metrics.jsonl")
    steps = [json.loads(line)["step"] for line in log["Body"].read().decode().splitlines()]
    assert steps == list(range(1, 401))
