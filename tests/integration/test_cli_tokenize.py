"""`mlm-pipeline tokenize` with a real SentencePiece model, by path and by config."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import yaml

from mlm_pipeline.cli import main
from mlm_pipeline.config_files import load_config
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.tokenizer.stage import train_tokenizer

TINY_FR = Path(__file__).parents[1] / "assets" / "tiny_fr.txt"
TEXTS = ["Le chat dort sur le canapé.", "Les documents sont écrits en français"]


def _reference(model_path, text):
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    return sp.encode(text, out_type=str), sp.encode(text, out_type=int)


def _plain(out: str) -> list[tuple[list[str], list[int]]]:
    """Parse the plain output: `pieces: ...` / `ids: ...` pairs separated by blank lines."""
    blocks = [b.splitlines() for b in out.strip().split("\n\n")]
    got = []
    for pieces, ids in blocks:
        assert pieces.startswith("pieces: ") and ids.startswith("ids: ")
        got.append((pieces[len("pieces: "):].split(" "), [int(x) for x in ids[5:].split()]))
    return got


@pytest.fixture()
def model_path(tiny_tokenizer_manifest):
    return tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path)


def test_tokenize_with_model_path(model_path, capsys):
    assert main(["tokenize", "--tokenizer", str(model_path),
                 "--text", TEXTS[0], "--text", TEXTS[1]]) == 0
    got = _plain(capsys.readouterr().out)
    assert got == [_reference(model_path, t) for t in TEXTS]
    assert got[0][0][0].startswith("\u2581")  # pieces show the word-boundary marker


def test_tokenize_json_from_stdin(model_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    assert main(["tokenize", "--tokenizer", str(model_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    assert out["vocab_size"] == sp.get_piece_size()
    assert [r["text"] for r in out["results"]] == TEXTS
    for r, text in zip(out["results"], TEXTS):
        assert (r["pieces"], r["ids"]) == _reference(model_path, text)


def test_tokenize_finds_the_tokenizer_of_a_config(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    tree = {"name": "t", "work_dir": str(tmp_path / "work"),
            "ingest": {"sources": [str(TINY_FR)], "validation_fraction": 0.1},
            "tokenizer": {"vocab_size": 120}}
    config.write_text(yaml.safe_dump(tree), encoding="utf-8")

    # Before `run`: a clear error naming the command to run.
    assert main(["tokenize", str(config), "--text", TEXTS[0]]) == 1
    err = capsys.readouterr().err
    assert "no ingest output" in err and "mlm-pipeline run" in err

    cfg = load_config(config)
    corpus = ingest(cfg.ingest, cfg.work_dir)
    assert main(["tokenize", str(config), "--text", TEXTS[0]]) == 1
    assert "no tokenizer output" in capsys.readouterr().err

    m = train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir)
    assert main(["tokenize", str(config), "--text", TEXTS[0]]) == 0
    assert _plain(capsys.readouterr().out) == [_reference(m.file(m.model.path), TEXTS[0])]
    # An override that changes the tokenizer digest points at a stage not yet run.
    assert main(["tokenize", str(config), "--set", "tokenizer.vocab_size=110",
                 "--text", TEXTS[0]]) == 1


def test_tokenize_needs_config_or_tokenizer(capsys):
    assert main(["tokenize", "--text", "x"]) == 2
    assert "either CONFIG or --tokenizer" in capsys.readouterr().err


def test_tokenize_normalizes_like_ingestion(model_path, tiny_tokenizer_manifest, capsys):
    # The tiny corpus was ingested with NFC: "e" + U+0301 must read as "é", as in training.
    assert tiny_tokenizer_manifest.normalization == "NFC"
    composed, decomposed = "Le café du canapé", "Le cafe\u0301 du canape\u0301"
    assert _reference(model_path, decomposed) != _reference(model_path, composed)
    assert main(["tokenize", "--tokenizer", str(model_path), "--text", decomposed]) == 0
    assert _plain(capsys.readouterr().out) == [_reference(model_path, composed)]


def test_nfkc_tokenizer_folds_compatibility_characters(model_path):
    from mlm_pipeline.tokenizer import SentencePieceTokenizer

    ligature = "Le \ufb01let"  # "ﬁ" (U+FB01); NFKC gives "fi"
    assert SentencePieceTokenizer(model_path, "NFKC").encode([ligature]) == [
        _reference(model_path, "Le filet")[1]]
    assert SentencePieceTokenizer(model_path).encode([ligature]) == [_reference(model_path, ligature)[1]]


def test_not_a_model_names_the_file(tmp_path, capsys):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not a model\n")
    assert main(["tokenize", "--tokenizer", str(bogus), "--text", "x"]) == 1
    err = capsys.readouterr().err
    assert str(bogus) in err and "not a SentencePiece model" in err
    assert len(err.strip().splitlines()) == 1
