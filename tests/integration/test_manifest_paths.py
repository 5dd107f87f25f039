"""Paths read from a stage manifest stay inside its stage directory: a tampered
`manifest.json` (`../../../../secret.txt`, an absolute path, a symbolic link out) is refused
with the manifest named, and the outside file is never opened by tokenizer loading, the
stage's reuse check, `outputs_exist` or the MLflow artifact logging."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from mlm_pipeline.config import IngestConfig, TokenizerConfig
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.manifest import ManifestPathError, TokenizerManifest, read_manifest
from mlm_pipeline.tokenizer import Tokenizer, train_tokenizer
from mlm_pipeline.tracking.records import outputs_exist, record_data

SECRET = b"password=hunter2\n"
TINY_FR = Path(__file__).parents[1] / "assets" / "tiny_fr.txt"

_opened: list[str] | None = None  # paths opened while a test watches (audit hook)


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only while watched


@pytest.fixture()
def opened():
    """Every path opened during the test (Python's `open` audit event), resolved."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def _resolved(paths: list[str]) -> set[Path]:
    return {Path(p).resolve() for p in paths}


@pytest.fixture()
def stage(tmp_path, tiny_corpus_manifest):
    """A tokenizer stage in `<tmp>/a/b/work`, so `../../../../secret.txt` from its
    directory is `<tmp>/a/secret.txt`, where a secret file is."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "secret.txt").write_bytes(SECRET)
    return train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest,
                           tmp_path / "a" / "b" / "work")


def _tamper(manifest_path: Path, field: str, rel: str, target: Path) -> None:
    """Point `field` of the manifest at `rel`, with the target's true size and sha256
    (an attacker can compute them), so only the path check can refuse it."""
    data = json.loads(manifest_path.read_text())
    data[field] = {**data[field], "path": rel, "bytes": len(target.read_bytes()),
                   "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_tampered_tokenizer_manifest_is_refused_and_the_secret_never_read(
        how, stage, tiny_corpus_manifest, tiny_shard_manifest, tmp_path, opened):
    secret = tmp_path / "a" / "secret.txt"
    out_dir = Path(stage.output_dir)
    assert (out_dir / "../../../../secret.txt").resolve() == secret.resolve()
    if how == "symlink":
        (out_dir / "spm.model").unlink()
        (out_dir / "spm.model").symlink_to(secret)
        _tamper(stage.path, "model", "spm.model", secret)
    else:
        _tamper(stage.path, "model",
                "../../../../secret.txt" if how == "dotdot" else str(secret), secret)
    manifest_named = f"{stage.path}: path "
    opened.clear()

    with pytest.raises(ValueError, match=manifest_named):
        Tokenizer.load(out_dir)
    with pytest.raises(ManifestPathError, match=manifest_named):
        train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest,
                        tmp_path / "a" / "b" / "work")
    with pytest.raises(ManifestPathError, match=manifest_named):
        outputs_exist(stage)  # the orchestrator's cached manifest, read again from disk

    tampered = read_manifest(stage.path, TokenizerManifest)
    tracker = _RecordingTracker()
    with pytest.raises(ManifestPathError, match=manifest_named):
        record_data(tracker, "run", tiny_corpus_manifest, tampered, tiny_shard_manifest)
    assert not any(secret.resolve() == Path(p).resolve() for p in tracker.artifacts)
    assert secret.resolve() not in _resolved(opened)


class _RecordingTracker:
    """The `MlflowTracker` methods `record_data` calls; artifacts are only recorded."""

    def __init__(self) -> None:
        self.artifacts: list[str] = []

    def set_tags(self, run_id, tags) -> None:
        pass

    def log_metrics(self, run_id, metrics, step) -> None:
        pass

    def log_params(self, run_id, params) -> None:
        pass

    def log_inputs(self, run_id, datasets) -> None:
        pass

    def log_dict(self, run_id, obj, name) -> None:
        pass

    def log_artifacts(self, run_id, path, artifact_path) -> None:
        self.artifacts.append(str(path))


def test_tampered_corpus_manifest_is_refused_by_ingest(tmp_path, opened):
    cfg, work = IngestConfig(sources=[str(TINY_FR)]), tmp_path / "w"
    corpus = ingest(cfg, work)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    data = json.loads(corpus.path.read_text())
    data["train"][0] = {**data["train"][0], "path": "../../../secret.txt",
                        "bytes": len(SECRET), "sha256": hashlib.sha256(SECRET).hexdigest()}
    corpus.path.write_text(json.dumps(data))
    opened.clear()
    with pytest.raises(ManifestPathError, match=f"{corpus.path}: path '../../../secret.txt'"):
        ingest(cfg, work)
    assert secret.resolve() not in _resolved(opened)


def test_file_keeps_inside_paths_and_refuses_the_rest(stage, tmp_path):
    out_dir = Path(stage.output_dir)
    (out_dir / "sub").mkdir()
    (out_dir / "sub" / "link.model").symlink_to(out_dir / "spm.model")  # inside: fine
    assert stage.file("sub/link.model") == out_dir / "sub" / "link.model"
    assert stage.file("spm.model") == out_dir / "spm.model"
    assert stage.file("") == stage.file(".") == out_dir  # the stage directory itself
    (out_dir / "loop").symlink_to(out_dir / "loop")
    for rel in ("/etc/passwd", "sub/../../x", "..", "loop/x", "sub/../spm.model"):
        with pytest.raises(ManifestPathError, match=f"{stage.path}: path "):
            stage.file(rel)
