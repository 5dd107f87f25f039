"""Ingestion from `s3://` URLs against a real S3 API: moto's server on loopback.

The endpoint and credentials reach s3fs through fsspec's configuration from the
environment (`FSSPEC_S3_ENDPOINT_URL`, `FSSPEC_S3_KEY`, `FSSPEC_S3_SECRET`: fsspec turns
`FSSPEC_<PROTOCOL>_<KWARG>` into a keyword argument of that protocol's file system), so
neither the pipeline config nor `mlm_pipeline.ingest.sources` needs an S3 option.
"""

from __future__ import annotations

import gzip
import hashlib
import json

import pyarrow.parquet as pq
import pytest

moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from mlm_pipeline.config import IngestConfig  # noqa: E402
from mlm_pipeline.ingest.stage import ingest  # noqa: E402

BUCKET = "mlm-corpus"
JSONL_DOCS = ["Le chat dort sur le canapé du salon.", "Les oiseaux chantent dans le jardin.",
              "Une phrase de plus pour le corpus."]
TXT_DOCS = ["Premier paragraphe du fichier texte.", "Second paragraphe, bien distinct."]


@pytest.fixture()
def s3_endpoint(monkeypatch):
    """A moto S3 server on 127.0.0.1 (free port), with fsspec configured to use it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": url,
           "FSSPEC_S3_KEY": "testing", "FSSPEC_S3_SECRET": "testing"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import fsspec.config

    # fsspec reads FSSPEC_* variables once, when it is first imported (possibly before
    # this test): apply them again; monkeypatch restores the previous "s3" entry after.
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(fsspec.config.conf.get("s3", {})))
    fsspec.config.set_conf_env(fsspec.config.conf)
    try:
        yield url
    finally:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # cached clients point at this server
        server.stop()


def test_ingest_from_s3(s3_endpoint, tmp_path):
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    jsonl = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in JSONL_DOCS).encode())
    txt = "\n\n".join(TXT_DOCS).encode("utf-8") + b"\n"
    uploads = {"corpus/part-1.jsonl.gz": jsonl, "corpus/notes.txt": txt,
               "corpus/skipped.csv": b"text\nnot matched by the glob\n"}
    for key, body in uploads.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)

    cfg = IngestConfig(sources=[f"s3://{BUCKET}/corpus/*.jsonl.gz",
                                f"s3://{BUCKET}/corpus/notes.txt"],
                       validation_fraction=0.0)
    m = ingest(cfg, tmp_path / "work")

    want_sources = [(f"s3://{BUCKET}/corpus/part-1.jsonl.gz", jsonl, len(JSONL_DOCS)),
                    (f"s3://{BUCKET}/corpus/notes.txt", txt, len(TXT_DOCS))]
    assert [(s.path, s.bytes, s.sha256, s.documents) for s in m.sources] == [
        (url, len(body), hashlib.sha256(body).hexdigest(), n) for url, body, n in want_sources]
    assert m.documents_read == m.documents_kept == len(JSONL_DOCS) + len(TXT_DOCS)
    texts = [t for e in m.train for t in pq.read_table(m.file(e.path)).column("text").to_pylist()]
    assert texts == JSONL_DOCS + TXT_DOCS
    # The `source` column holds the file's basename, as for local files (readers module).
    sources = [s for e in m.train
               for s in pq.read_table(m.file(e.path)).column("source").to_pylist()]
    assert sources == ["part-1.jsonl.gz"] * len(JSONL_DOCS) + ["notes.txt"] * len(TXT_DOCS)

    # Same bytes again: the stage is found by content digest and not recomputed.
    again = ingest(cfg, tmp_path / "work")
    assert again.digest == m.digest and again.created_at == m.created_at


def test_cached_rerun_downloads_nothing_and_a_new_version_is_read(s3_endpoint, tmp_path,
                                                                   monkeypatch):
    import s3fs

    opened: list[str] = []
    real_open = s3fs.S3FileSystem._open

    def counting_open(self, path, *args, **kwargs):
        opened.append(path)
        return real_open(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_open", counting_open)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    body = "\n\n".join(TXT_DOCS).encode("utf-8") + b"\n"
    client.put_object(Bucket=BUCKET, Key="c/notes.txt", Body=body)
    cfg = IngestConfig(sources=[f"s3://{BUCKET}/c/notes.txt"], validation_fraction=0.0)
    first = ingest(cfg, tmp_path / "work")
    assert len(opened) == 2  # hashed once, read once

    from mlm_pipeline.ingest import hashing

    monkeypatch.setattr(hashing, "_memory", {})  # nothing remembered in this process
    opened.clear()
    again = ingest(cfg, tmp_path / "work")
    assert again.digest == first.digest and again.created_at == first.created_at
    assert opened == []  # the ETag in the work directory's memo: no download

    # Same size, other bytes: a new ETag, so the object is read again.
    changed = body.replace(b"Premier", b"Dernier")
    assert len(changed) == len(body)
    client.put_object(Bucket=BUCKET, Key="c/notes.txt", Body=changed)
    third = ingest(cfg, tmp_path / "work")
    assert third.digest != first.digest
    assert third.sources[0].sha256 == hashlib.sha256(changed).hexdigest()
