"""`Tokenizer.load` from manifests, stage directories, copies and bare model files; a
changed model file is refused, and retrained by the stage."""

from __future__ import annotations

import logging
import shutil

import pytest
import sentencepiece as spm

from mlm_pipeline.config import MASK_ID, TokenizerConfig
from mlm_pipeline.tokenizer import SentencePieceTokenizer, Tokenizer, train_tokenizer
from mlm_pipeline.tracking.records import outputs_exist


@pytest.fixture()
def stage(tmp_path, tiny_corpus_manifest):
    """A tokenizer stage of its own (tests here change its files)."""
    return train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest, tmp_path / "w")


def test_copied_stage_directory_loads_its_own_model(stage, tmp_path, caplog):
    copy = tmp_path / "copy"
    shutil.copytree(stage.path.parent, copy)
    shutil.rmtree(stage.path.parent)  # the manifest's output_dir no longer exists
    for source in (copy, copy / "manifest.json", copy / "spm.model"):
        with caplog.at_level(logging.WARNING):
            tok = Tokenizer.load(source)
        assert tok.path == copy / "spm.model" and tok.normalization == "NFC"
    assert "normalization is unknown" not in caplog.text
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString((copy / "spm.model").read_bytes())
    proto.pieces[10].score -= 1.0  # still a model, other bytes
    (copy / "spm.model").write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match=f"in its tokenizer manifest {copy.resolve()}"):
        Tokenizer.load(copy)


def test_bare_model_file_encodes_without_normalization_and_says_so(stage, tmp_path, caplog):
    alone = tmp_path / "alone.model"
    shutil.copy(stage.file(stage.model.path), alone)
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.load(alone)
    assert tok.normalization is None and "normalization is unknown" in caplog.text
    sp = spm.SentencePieceProcessor(model_file=str(alone))
    assert tok.encode(["cafe\u0301"]) == [sp.encode("cafe\u0301")]


def test_changed_model_is_refused_then_trained_again(stage, tiny_corpus_manifest, tmp_path):
    model = stage.file(stage.model.path)
    original = model.read_bytes()
    # Same size, other bytes: swap two pieces of equal length, as a hand edit would.
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(original)
    i, j = (k for k, p in enumerate(proto.pieces) if p.piece in ("\u2581de", "\u2581la"))
    proto.pieces[i].piece, proto.pieces[j].piece = proto.pieces[j].piece, proto.pieces[i].piece
    edited = proto.SerializeToString()
    assert edited != original and len(edited) == len(original)
    model.write_bytes(edited)
    with pytest.raises(ValueError, match="differs from .* in its tokenizer manifest"):
        Tokenizer.load(stage)
    assert not outputs_exist(stage)  # the orchestrator's cache is not reused
    again = train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest,
                            tmp_path / "w")
    assert model.read_bytes() == original and again.model.sha256 == stage.model.sha256
    assert outputs_exist(again)


def test_empty_file_is_not_a_model(tmp_path):
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.model: not a SentencePiece model"):
        Tokenizer.load(empty)


def test_nfkc_never_makes_a_mask_marker(stage):
    tok = SentencePieceTokenizer(stage.file(stage.model.path), "NFKC")
    fullwidth = "le \uff3b\uff2d\uff21\uff33\uff2b\uff3d est"  # "［ＭＡＳＫ］"; NFKC: "[MASK]"
    assert MASK_ID not in tok.encode_with_mask(fullwidth)
    assert tok.encode_with_mask("le [MASK] est").count(MASK_ID) == 1


def test_sample_too_small_for_the_vocab_points_at_the_sample(tiny_corpus_manifest, tmp_path):
    cfg = TokenizerConfig(vocab_size=128, input_sentence_size=1)
    with pytest.raises(ValueError, match=r"raise tokenizer\.input_sentence_size \(the trainer "
                                         r"saw 1 of the corpus's \d+ sentences\)"):
        train_tokenizer(cfg, tiny_corpus_manifest, tmp_path)
