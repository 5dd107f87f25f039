"""A URL work directory (`mlm_pipeline.store`) against a real S3 API: moto's server on
loopback, configured through the environment (`s3_endpoint`, from test_s3_source).

Two machines are two cache directories (`MLM_PIPELINE_CACHE`) over one bucket. The
expected bytes and hashes are read here with boto3, not through the code under test.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from mlm_pipeline import store
from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.manifest import (
    CorpusManifest,
    ManifestPathError,
    load_if_complete,
)
from tests.integration.test_s3_source import s3_endpoint  # noqa: F401 - the fixture

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny_fr.txt"
BUCKET = "mlm-work"


@pytest.fixture()
def bucket(s3_endpoint, monkeypatch, tmp_path):  # noqa: F811 - the imported fixture
    """A boto3 client of the bucket."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture()
def work(bucket, tmp_path) -> str:
    """This test's own work directory in the bucket (moto's objects outlive one server)."""
    return f"s3://{BUCKET}/{tmp_path.name}"


def _machine(monkeypatch, tmp_path: Path, name: str, work: str) -> Path:
    """A machine: its own cache directory, holding its mirror of `work` (as a stage makes
    it, `store.work_root`)."""
    cache = tmp_path / name
    monkeypatch.setenv("MLM_PIPELINE_CACHE", str(cache))
    store.work_root(work)
    return cache


def _prefix(made, work: str) -> str:
    """The key prefix of an ingest stage directory of `work`."""
    return f"{work.split('/', 3)[3]}/ingest/{Path(made.output_dir).name}"


def _made_on_a(monkeypatch, tmp_path: Path, work: str):
    """(config, manifest) of the ingest stage run on machine `a`."""
    cfg = IngestConfig(sources=[str(ASSET)], validation_fraction=0.1)
    _machine(monkeypatch, tmp_path, "a", work)
    return cfg, ingest(cfg, work)


def _object(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_an_output_is_published_then_reused_and_fetched_lazily_elsewhere(
        bucket, work, monkeypatch, tmp_path):
    cfg, made = _made_on_a(monkeypatch, tmp_path, work)
    prefix = _prefix(made, work)
    stored = json.loads(_object(bucket, f"{prefix}/manifest.json"))
    assert stored["digest"] == made.digest
    entries = made.train + made.validation
    for e in entries:
        assert hashlib.sha256(_object(bucket, f"{prefix}/{e.path}")).hexdigest() == e.sha256

    b = _machine(monkeypatch, tmp_path, "b", work)
    again = ingest(cfg, work)
    assert again.digest == made.digest and Path(again.output_dir).is_relative_to(b)
    assert not list(Path(again.output_dir).glob("*.parquet"))  # nothing downloaded yet
    path = again.file(entries[0].path)
    assert path.read_bytes() == _object(bucket, f"{prefix}/{entries[0].path}")
    # The mirror's manifest names this machine's directory, not the one that made it.
    mirrored = json.loads((Path(again.output_dir) / "manifest.json").read_text())
    assert mirrored["output_dir"] == again.output_dir


def test_a_damaged_object_is_refused_when_fetched(bucket, work, monkeypatch, tmp_path):
    cfg, made = _made_on_a(monkeypatch, tmp_path, work)
    entry = made.train[0]
    key = f"{_prefix(made, work)}/{entry.path}"
    body = bytearray(_object(bucket, key))
    body[len(body) // 2] ^= 0xFF  # same size, other bytes
    bucket.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    _machine(monkeypatch, tmp_path, "b", work)
    again = ingest(cfg, work)  # reused: sizes match in the listing
    with pytest.raises(ValueError, match=rf"s3://{BUCKET}/{key}: sha256 .* records {entry.sha256}"):
        again.file(entry.path)
    assert not (Path(again.output_dir) / entry.path).exists()
    assert not list(Path(again.output_dir).glob(".*.tmp"))


def test_a_stored_manifest_naming_a_path_outside_is_refused_before_any_fetch(
        bucket, work, monkeypatch, tmp_path):
    _, made = _made_on_a(monkeypatch, tmp_path, work)
    prefix = _prefix(made, work)
    stored = json.loads(_object(bucket, f"{prefix}/manifest.json"))
    stored["train"][0]["path"] = "../../../secret.txt"
    bucket.put_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json",
                      Body=json.dumps(stored).encode())

    b = _machine(monkeypatch, tmp_path, "b", work)
    out = Path(made.output_dir.replace(str(tmp_path / "a"), str(b)))
    with pytest.raises(ManifestPathError, match=r"'\.\./\.\./\.\./secret\.txt'"):
        load_if_complete(out, CorpusManifest, made.digest)
    assert not (b / "secret.txt").exists()


def test_a_missing_object_makes_the_stage_run_again(bucket, work, monkeypatch, tmp_path):
    cfg, made = _made_on_a(monkeypatch, tmp_path, work)
    key = f"{_prefix(made, work)}/{made.validation[0].path}"
    bucket.delete_object(Bucket=BUCKET, Key=key)

    b = _machine(monkeypatch, tmp_path, "b", work)
    out = Path(made.output_dir.replace(str(tmp_path / "a"), str(b)))
    assert load_if_complete(out, CorpusManifest, made.digest) is None
    rebuilt = ingest(cfg, work)  # built here, and published again
    assert rebuilt.digest == made.digest
    assert hashlib.sha256(_object(bucket, key)).hexdigest() == made.validation[0].sha256


def test_a_rebuilt_stage_replaces_a_damaged_object_in_the_store(
        bucket, work, monkeypatch, tmp_path):
    cfg, made = _made_on_a(monkeypatch, tmp_path, work)
    entry = made.train[0]
    key = f"{_prefix(made, work)}/{entry.path}"
    body = bytearray(_object(bucket, key))
    body[0] ^= 0xFF  # same size, other bytes
    bucket.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    bucket.delete_object(Bucket=BUCKET, Key=f"{_prefix(made, work)}/manifest.json")

    _machine(monkeypatch, tmp_path, "b", work)
    rebuilt = ingest(cfg, work)  # no manifest in the store: built again, published whole
    assert rebuilt.digest == made.digest
    assert hashlib.sha256(_object(bucket, key)).hexdigest() == entry.sha256


def test_a_changed_file_in_the_mirror_is_fetched_again_from_the_store(
        bucket, work, monkeypatch, tmp_path):
    cfg, made = _made_on_a(monkeypatch, tmp_path, work)
    entry = made.train[0]
    local = Path(made.output_dir) / entry.path
    body = bytearray(local.read_bytes())
    body[0] ^= 0xFF
    local.write_bytes(bytes(body))

    again = ingest(cfg, work)  # reused: the store holds the output
    assert again.digest == made.digest
    assert hashlib.sha256(again.file(entry.path).read_bytes()).hexdigest() == entry.sha256


def _fake_checkpoint(root: Path, step: int, payload: bytes) -> Path:
    """A checkpoint directory as `verify_checkpoint` reads it: one file and `state.json`
    with its size and sha256, sealed with the state's digest."""
    from mlm_pipeline.train.checkpoint import checkpoint_name, seal_state

    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(payload)
    record = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    state = seal_state({"files": {"model.safetensors": record}})
    (path / "state.json").write_text(json.dumps(state))
    return path


def test_a_damaged_newest_checkpoint_in_the_store_falls_back_to_an_older_one(
        bucket, work, monkeypatch, tmp_path):
    from mlm_pipeline.train.checkpoint import latest_intact_checkpoint

    root_a = _machine(monkeypatch, tmp_path, "a", work)
    root = store.work_root(work) / "train" / "run" / "checkpoints"
    for step in (5, 10):
        _fake_checkpoint(root, step, f"weights at step {step}".encode())
    store.sync_children(root, last="state.json")
    key = f"{work.split('/', 3)[3]}/train/run/checkpoints/step-00000010/model.safetensors"
    bucket.put_object(Bucket=BUCKET, Key=key, Body=b"weights at step XX")  # same size

    root_b = _machine(monkeypatch, tmp_path, "b", work)
    here = Path(str(root).replace(str(root_a), str(root_b)))
    assert latest_intact_checkpoint(here) == here / "step-00000005"
    assert (here / "step-00000005" / "model.safetensors").read_bytes() == b"weights at step 5"
    assert not (here / "step-00000010").exists()  # the damaged download is not kept


def test_a_resumed_runs_metrics_log_is_the_longer_of_the_mirrors_and_the_stores(
        bucket, work, monkeypatch, tmp_path):
    from mlm_pipeline.train.stage import _truncate_metrics_log

    _machine(monkeypatch, tmp_path, "a", work)
    log = store.work_root(work) / "train" / "run" / "metrics.jsonl"
    log.parent.mkdir(parents=True)
    lines = [json.dumps({"step": s, "train/loss": 5.0 - s / 100}) for s in range(1, 51)]
    log.write_text("".join(line + "\n" for line in lines[:5]))  # this machine's old copy
    store.write_remote(log, "".join(line + "\n" for line in lines).encode())  # the store's
    _truncate_metrics_log(log, 45)
    assert log.read_text().splitlines() == lines[:45]


def test_a_work_dir_that_cannot_be_written_fails_at_once_naming_it(s3_endpoint):  # noqa: F811
    with pytest.raises(OSError, match=r"work_dir s3://no-such-bucket/w: cannot write .*"
                                      r"AWS_ACCESS_KEY_ID"):
        store.work_root("s3://no-such-bucket/w")
    with pytest.raises(ValueError, match=r"work_dir nope://x/w: .*nope"):
        store.work_root("nope://x/w")


def test_gc_removes_a_finished_runs_checkpoints_from_the_store_too(
        bucket, work, monkeypatch, tmp_path):
    from mlm_pipeline.tracking import MlflowTracker
    from mlm_pipeline.app.gc import apply_gc, plan_gc

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="gc")
    run_id = tracker.start_run({}, {})
    tracker.end_run(run_id, "FINISHED")
    _machine(monkeypatch, tmp_path, "a", work)  # trained there; gc runs on machine b
    root = store.work_root(work) / "train" / run_id / "checkpoints"
    _fake_checkpoint(root, 5, b"x" * 1000)
    store.sync_children(root, last="state.json")
    prefix = f"{work.split('/', 3)[3]}/train/{run_id}/checkpoints/"
    stored = sum(o["Size"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix=prefix)[
        "Contents"])

    _machine(monkeypatch, tmp_path, "b", work)
    [item] = plan_gc(tracker, work, keep=0)
    assert (item.run_id, item.action, item.bytes) == (run_id, "remove", stored)
    assert apply_gc([item]) == stored
    assert "Contents" not in bucket.list_objects_v2(Bucket=BUCKET, Prefix=prefix)


class _Killed(BaseException):
    """The machine is lost in the middle of an upload (not an `Exception`: nothing in the
    code under test may catch it)."""


def test_a_store_never_holds_a_checkpoint_whose_metrics_log_lacks_its_steps(
        bucket, work, monkeypatch, tmp_path):
    """Killed after any upload of a checkpoint save, the store's newest complete checkpoint
    at step N comes with a metrics log holding every step up to N, so a run resumed on
    another machine has its whole log (the log read here with boto3)."""
    from mlm_pipeline.train.checkpoint import Checkpointer, latest_intact_checkpoint
    from tests.unit.test_train_parts import _parts

    def saves(kill_after: int | None) -> int:
        """Two checkpoint saves (steps 5 and 10, a metrics line per step) on a fresh machine
        `a` in a fresh run directory; killed after the `kill_after`-th upload of the second
        save. Returns the uploads the second save made."""
        real_fs = store._fs
        puts = [0]

        class Dying:
            def __init__(self, fs):
                self.fs = fs

            def put_file(self, *args, **kwargs):
                if kill_after is not None and puts[0] == kill_after:
                    raise _Killed
                self.fs.put_file(*args, **kwargs)
                puts[0] += 1

            def __getattr__(self, name):
                return getattr(self.fs, name)

        _machine(monkeypatch, tmp_path, "a", work)
        run = store.work_root(work) / "train" / f"run-{kill_after}"
        log = run / "metrics.jsonl"
        log.parent.mkdir(parents=True)
        ckpt = Checkpointer(run / "checkpoints", _parts(0), {})
        with log.open("a") as f:
            f.writelines(json.dumps({"step": s}) + "\n" for s in range(1, 6))
        ckpt.save(5)
        with log.open("a") as f:
            f.writelines(json.dumps({"step": s}) + "\n" for s in range(6, 11))
        monkeypatch.setattr(store, "_fs", lambda url: (Dying(real_fs(url)[0]), real_fs(url)[1]))
        try:
            ckpt.save(10)
        except _Killed:
            pass
        finally:
            monkeypatch.setattr(store, "_fs", real_fs)
        return puts[0]

    uploads = saves(None)
    assert uploads >= 3  # the log, the checkpoint's files, its state.json
    for kill_after in range(uploads + 1):
        saves(kill_after)
        machine_b = _machine(monkeypatch, tmp_path, "b", work)
        run = store.work_root(work) / "train" / f"run-{kill_after}"
        newest = latest_intact_checkpoint(run / "checkpoints")
        step = int(newest.name.split("-")[1])
        key = f"{work.split('/', 3)[3]}/train/run-{kill_after}/metrics.jsonl"
        logged = [json.loads(line)["step"] for line in _object(bucket, key).decode().splitlines()]
        assert logged[:step] == list(range(1, step + 1)), (kill_after, step, logged)
        assert str(run).startswith(str(machine_b))
