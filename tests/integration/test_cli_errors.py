"""Clean errors and small frictions of the `mlm-pipeline` console script, in fresh processes:
one line per failure (the traceback behind `--verbose` or in the log file it names), the
nearest valid key for a mistyped one, `--version`, `run --help` examples, and `tokenize`
that never asks apt about a `debian:` corpus."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import sentencepiece as spm
import yaml

from mlm_pipeline.config_files import load_config
from mlm_pipeline.ingest.corpora import EXTRACTOR_VERSION
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.tokenizer.stage import train_tokenizer

MLM = shutil.which("mlm-pipeline")


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MLM, *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env, check=False)


def _small(tmp_path: Path, source: str) -> list[str]:
    """Overrides for a small, fast run reading `source`."""
    sets = [f"work_dir={tmp_path / 'work'}", f"ingest.sources=[{source!r}]",
            "ingest.allowed_sources=[]", "tokenizer.vocab_size=128", "shards.seq_len=16",
            "train.max_steps=2", "linear_probe.enabled=false", "eval.probes=[]",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    return [a for s in sets for a in ("--set", s)]


def test_missing_source_is_one_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    out = _cli("run", "tiny", *_small(tmp_path, str(missing)), cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in out.stderr, out.stderr
    assert sum(str(missing) in line for line in lines) == 1


@pytest.mark.slow
def test_failure_inside_a_stage_is_one_line_and_logged(tmp_path, prefect_api_url):
    """An unknown `debian:` corpus fails inside the ingest task (after the flow started, on
    the session's Prefect server)."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    out = _cli("run", "tiny", *_small(tmp_path, "debian:nope"), cwd=tmp_path, env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mlm-pipeline:")]
    assert len(errors) == 1 and "stage 'ingest' failed: unknown Debian corpus 'nope'" in errors[0]
    assert sum("Debian corpus 'nope'" in line for line in out.stderr.splitlines()) == 1
    log = Path(re.search(r"traceback in (\S+\.log)", errors[0]).group(1))
    assert log.parent == tmp_path / "work" / "logs"
    text = log.read_text()
    assert "Traceback" in text and "ValueError: unknown Debian corpus 'nope'" in text

    verbose = _cli("--verbose", "run", "tiny", *_small(tmp_path, "debian:nope"), cwd=tmp_path,
                   env=env)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert "stage 'ingest' failed" in verbose.stderr.splitlines()[-1]


def test_unknown_key_suggests_the_nearest(tmp_path):
    out = _cli("config", "tiny", "--set", "train.max_step=5", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean train.max_steps?" in out.stderr
    assert "Traceback" not in out.stderr


def test_other_command_errors_are_one_line_unless_verbose(tmp_path):
    args = ("promote", "not-a-run-id", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}")
    out = _cli(*args, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"mlm-pipeline: error: no MLflow database at {tmp_path / 'm.db'} "
        "(give --tracking-uri or set MLFLOW_TRACKING_URI)"]
    verbose = _cli(*args, "--verbose", cwd=tmp_path)  # accepted after the command too
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_version_names_the_packages(tmp_path):
    import mlflow
    import prefect
    import torch

    out = _cli("--version", cwd=tmp_path)
    assert out.returncode == 0
    assert out.stdout.startswith("mlm-pipeline ")
    for name, module in (("torch", torch), ("prefect", prefect), ("mlflow", mlflow)):
        assert f"{name} {module.__version__}" in out.stdout


def test_run_help_shows_examples(tmp_path):
    out = _cli("run", "--help", cwd=tmp_path).stdout
    examples = out[out.index("examples:"):]
    for shown in ("--set train.max_steps=", "--fresh", "ingest.sources=", "tracking.run_name=",
                  "continues the unfinished run"):
        assert shown in examples


def test_tokenize_never_asks_apt(tmp_path, monkeypatch, tiny_paragraphs):
    """A `debian:` corpus already in the work dir: `tokenize` finds its tokenizer without
    running `apt-cache`/`apt-get` (stand-ins on PATH record every call)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir()
    for tool in ("apt-cache", "apt-get", "dpkg-deb"):
        (bin_dir / tool).write_text(
            f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\n"
            "[ \"$1\" = policy ] && echo 'stardict-xmlittre:' && echo '  Candidate: 1.0'\n"
            "exit 0\n")
        (bin_dir / tool).chmod(0o755)
    cache = tmp_path / "cache" / "corpora"
    cache.mkdir(parents=True)
    (cache / "littre-fr.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "text": t}, ensure_ascii=False) + "\n"
        for i, t in enumerate(tiny_paragraphs)))
    (cache / "littre-fr.stamp.json").write_text(json.dumps(
        {"extractor": EXTRACTOR_VERSION, "packages": {"stardict-xmlittre": "1.0"}}))
    config = tmp_path / "littre.yaml"
    config.write_text(yaml.safe_dump({
        "name": "littre", "work_dir": str(tmp_path / "work"),
        "ingest": {"sources": ["debian:littre-fr"], "cache_dir": str(tmp_path / "cache"),
                   "validation_fraction": 0.1},
        "tokenizer": {"vocab_size": 128}}))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    monkeypatch.setenv("PATH", env["PATH"])
    cfg = load_config(str(config), [])
    corpus = ingest(cfg.ingest, cfg.work_dir)  # the run's stages: these do ask apt
    tok = train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir)
    ref = spm.SentencePieceProcessor(model_file=str(tok.file(tok.model.path)))
    assert "apt-cache policy stardict-xmlittre" in calls.read_text()  # the stand-ins work
    calls.unlink()

    text = "Le chat dort sur le canapé."
    for _ in range(2):
        out = _cli("tokenize", str(config), "--text", text, "--json", cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert Path(got["tokenizer"]) == tok.file(tok.model.path)
        assert got["results"][0]["ids"] == ref.encode(text)
    assert not calls.exists(), calls.read_text()
