"""A URL work directory (`mlm_pipeline.store`) against a real S3 API: moto's server on
loopback, configured through the environment (`s3_endpoint`, from test_s3_source).

Two machines are two cache directories (`MLM_PIPELINE_CACHE_DIR`) over one bucket. The
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
    monkeypatch.setenv("MLM_PIPELINE_CACHE_DIR", str(cache))
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
