"""The holdout text (`eval.holdout_sources`): its digest, its pin, and that the ingest stage
removes its documents from the training corpus."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.ingest import ingest, ingest_digest, read_holdout
from mlm_pipeline.ingest.stage import read_documents

SHARED = "Le serveur web répond aux requêtes des clients sur le port 80."
HOLD_ONLY = "La commande   apt installe un paquet\net ses dépendances."
TRAIN = [f"Le document d'entraînement numéro {i} parle de paquets Debian." for i in range(12)]


def _config(tmp_path, **eval_kw) -> PipelineConfig:
    corpus, hold = tmp_path / "corpus", tmp_path / "holdout"
    corpus.mkdir(parents=True)
    hold.mkdir(parents=True)
    # The shared paragraph sits in the middle of the training file, NFD-written, so that
    # only the normalized texts (NFC) are equal.
    nfd = SHARED.replace("é", "e\u0301").replace("ê", "e\u0302")
    paragraphs = [*TRAIN[:6], nfd, *TRAIN[6:]]
    (corpus / "docs.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    (hold / "bench.txt").write_text(f"{HOLD_ONLY}\n\n{SHARED}\n", encoding="utf-8")
    return PipelineConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "ingest": {"sources": [str(corpus)], "validation_fraction": 0.2},
        "eval": {"holdout_sources": [str(hold)], **eval_kw}})


def test_holdout_document_in_the_corpus_is_dropped_and_counted(tmp_path):
    cfg = _config(tmp_path)
    holdout = read_holdout(cfg)
    # The digest, computed here from its definition: words joined by one space, documents
    # by one line feed, sha256 of the UTF-8.
    scored = [" ".join(HOLD_ONLY.split()), SHARED]
    assert holdout.documents == tuple(scored)
    assert holdout.digest == hashlib.sha256("\n".join(scored).encode()).hexdigest()
    assert holdout.chars == sum(len(w) + 1 for d in scored for w in d.split())

    m = ingest(cfg.ingest, cfg.work_dir, holdout=holdout)
    assert m.dropped["holdout_overlap"] == 1
    assert m.documents_read == len(TRAIN) + 1
    assert m.documents_kept == len(TRAIN)
    texts = [t for _, t in read_documents([m.file(e.path) for e in (*m.train, *m.validation)])]
    assert sorted(texts) == sorted(TRAIN)  # the holdout document is in neither split
    assert m.digest == ingest_digest(cfg.ingest, cfg.work_dir, holdout)

    # Without a holdout nothing is dropped, and the corpus has another digest.
    plain = ingest(cfg.ingest, tmp_path / "plain")
    assert "holdout_overlap" not in plain.dropped
    assert plain.documents_kept == len(TRAIN) + 1 and plain.digest != m.digest


def test_the_cap_cuts_the_scored_text(tmp_path):
    # Words count len + 1: La 3, commande 9, apt 4, installe 9, un 3, paquet 7, et 3
    # make 38 characters; "ses" would make 42 > 40. The second document is not used.
    holdout = read_holdout(_config(tmp_path, bpc_max_chars=40))
    assert holdout.documents == ("La commande apt installe un paquet et",)
    assert holdout.chars == 38


def test_a_pinned_digest_that_differs_refuses_in_one_line(tmp_path):
    cfg = _config(tmp_path)
    right = read_holdout(cfg).digest
    assert read_holdout(_config(tmp_path / "again", holdout_digest=right)).digest == right
    wrong = "0" * 64
    with pytest.raises(ValueError) as err:
        read_holdout(_config(tmp_path / "pinned", holdout_digest=wrong))
    message = str(err.value)
    assert "\n" not in message
    assert "eval.holdout_digest" in message and wrong in message and right in message
    assert str(tmp_path / "pinned" / "holdout") in message


def test_the_run_command_refuses_a_wrong_pin_before_starting(tmp_path):
    # A fresh process, as a user meets it: `mlm-pipeline run` checks the holdout before
    # Prefect starts, and says what is wrong in one line.
    cfg = _config(tmp_path)
    holdout_dir = tmp_path / "holdout"
    right = hashlib.sha256(f"{' '.join(HOLD_ONLY.split())}\n{SHARED}".encode()).hexdigest()
    wrong = "f" * 64
    tiny = Path(__file__).resolve().parents[2] / "tests" / "assets" / "tiny_fr.txt"
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
           "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing may reach a Prefect API
    done = subprocess.run(
        [shutil.which("mlm-pipeline"), "run", "tiny", "--set", f"work_dir={cfg.work_dir}",
         "--set", f"ingest.sources=[{tiny}]", "--set", f"eval.holdout_sources=[{holdout_dir}]",
         "--set", f"eval.holdout_digest={wrong}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mlm-pipeline: error: eval.holdout_digest: ")
    assert wrong in lines[0] and right in lines[0] and str(holdout_dir) in lines[0]
