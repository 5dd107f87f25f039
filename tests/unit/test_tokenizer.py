"""Tokenizer API on the session's tiny model, and long-line splitting."""

from __future__ import annotations

import hashlib

import pytest
import sentencepiece as spm

from mlm_pipeline.config import SPECIAL_TOKENS
from mlm_pipeline.ingest.documents import split_long_line
from mlm_pipeline.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_manifest) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_manifest)


@pytest.fixture(scope="module")
def raw_sp(tiny_tokenizer_manifest) -> spm.SentencePieceProcessor:
    """The same model through plain SentencePiece, as an independent reference."""
    m = tiny_tokenizer_manifest
    return spm.SentencePieceProcessor(model_file=str(m.file(m.model.path)))


def test_special_ids_and_pieces(tok):
    expected = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert SPECIAL_TOKENS == expected
    for piece, i in expected.items():
        assert tok.id_to_piece(i) == piece
        assert tok.piece_to_id(piece) == i
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.vocab_size == 128


def test_literal_mask_text_is_ordinary_text(tok):
    text = "Le [MASK] du chat est doux."
    (ids,) = tok.encode([text])
    assert 4 not in ids
    assert all(5 <= i < tok.vocab_size or i == tok.unk_id for i in ids)


def test_encode_with_mask_inserts_mask_id_at_each_marker(tok, raw_sp):
    text = "Le [MASK] du chat est [MASK] et chaud."
    ids = tok.encode_with_mask(text)
    expected = (
        raw_sp.encode("Le ") + [4] + raw_sp.encode(" du chat est ") + [4]
        + raw_sp.encode(" et chaud.")
    )
    assert ids == expected
    assert ids.count(4) == 2


def test_encode_with_mask_gives_every_special_name_its_id(tok, raw_sp):
    # A probe's special names are their ids (as transformers reads them); in a document
    # (`encode`) they are ordinary text.
    text = "[CLS] Le chat [SEP] dort[PAD][UNK]"
    expected = ([2] + raw_sp.encode(" Le chat ") + [3] + raw_sp.encode(" dort")
                + [0, 1])
    assert tok.encode_with_mask(text) == expected
    assert tok.encode([text])[0] == raw_sp.encode(text)
    assert not {0, 2, 3, 4} & set(tok.encode([text])[0])


def test_encode_matches_sentencepiece_and_adds_no_bos_eos(tok, raw_sp):
    texts = ["Le chat dort dans la maison.", "Il pleut à Lyon depuis 3 jours."]
    assert tok.encode(texts) == [raw_sp.encode(t) for t in texts]
    assert tok.encode(texts, num_threads=1) == tok.encode(texts, num_threads=2)
    assert all(2 not in ids and 3 not in ids for ids in tok.encode(texts))


def test_whitespace_variants_encode_like_a_space(tok):
    plain = tok.encode(["le chat dort ici"])[0]
    variants = ["le\tchat\ndort  ici", "le\u00a0chat\u202fdort\r\nici", " le chat dort ici "]
    for text in variants:
        assert tok.encode([text])[0] == plain, repr(text)
    assert tok.unk_id not in plain


def test_decode_round_trip(tok):
    text = "le chat dort dans la maison"
    assert tok.decode(tok.encode([text])[0]) == text
    ids = [2] + tok.encode([text])[0] + [3]
    assert tok.decode(ids, skip_special_tokens=True) == text  # special ids left out
    assert tok.decode(ids) == f"[CLS] {text}[SEP]"  # or written as their names
    assert tok.decode([1, 4, 0]) == "[UNK][MASK][PAD]"
    assert tok.decode([1, 4, 0], skip_special_tokens=True) == ""


def test_model_sha256_and_load_forms(tok, tiny_tokenizer_manifest):
    m = tiny_tokenizer_manifest
    model_path = m.file(m.model.path)
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert tok.model_sha256 == digest == m.model.sha256
    assert Tokenizer.load(model_path).model_sha256 == digest
    assert Tokenizer.load(m.output_dir).model_sha256 == digest
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(model_path.with_name("missing.model"))


@pytest.mark.parametrize("max_bytes", [16, 40, 100])
def test_split_long_line_keeps_every_word_within_limit(max_bytes):
    line = "Le  petit déjeuner à 7 h 30 : café, pain grillé et confiture d'abricots. " * 3
    pieces = list(split_long_line(line, max_bytes))
    assert all(0 < len(p.encode("utf-8")) <= max_bytes for p in pieces)
    assert " ".join(pieces).split() == line.split()
    assert len(pieces) > 1


def test_split_long_line_short_line_unchanged():
    line = "Deux  espaces\tet une tabulation"
    assert list(split_long_line(line, 1000)) == [line]


def test_split_long_line_cuts_long_word_at_character_boundaries():
    word = "é" * 25  # 50 bytes, no whitespace
    pieces = list(split_long_line("a " + word + " b", 8))
    assert pieces[0] == "a" and pieces[-1] == "b"
    assert "".join(pieces[1:-1]) == word
    assert [len(p.encode("utf-8")) for p in pieces[1:-1]] == [8] * 6 + [2]
