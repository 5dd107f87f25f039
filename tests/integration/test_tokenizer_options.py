"""Tokenizer options: byte fallback, the training-text digest and `Tokenizer.word_starts`."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import SPECIAL_TOKENS, TokenizerConfig
from mlm_pipeline.tokenizer.stage import Tokenizer, train_tokenizer

#: Characters that appear nowhere in tests/assets/tiny_fr.txt (checked in the test).
UNSEEN = "龍𝔘"


def _reference_training_text(corpus) -> bytes:
    """The training text as the module's docstring specifies it, built independently:
    every non-blank line of every training document, in order, each followed by "\\n"."""
    out = []
    for entry in corpus.train:
        for text in pq.read_table(corpus.file(entry.path)).column("text").to_pylist():
            out += [line + "\n" for line in text.split("\n") if line.strip()]
    data = "".join(out).encode("utf-8")
    # No line reaches the default max_sentence_length, so no line is split.
    assert max(len(x.encode()) for x in out) < TokenizerConfig().max_sentence_length
    return data


@pytest.fixture(scope="module")
def byte_manifest(tiny_corpus_manifest, tmp_path_factory):
    """Unigram with byte fallback: 5 special + 256 byte pieces + the corpus's own."""
    cfg = TokenizerConfig(vocab_size=400, byte_fallback=True)
    return train_tokenizer(cfg, tiny_corpus_manifest, tmp_path_factory.mktemp("bytes"))


def test_unseen_characters_are_not_in_the_corpus(tiny_paragraphs):
    assert not any(c in p for p in tiny_paragraphs for c in UNSEEN)


def test_byte_fallback_encodes_unseen_characters_as_bytes(byte_manifest):
    m = byte_manifest
    assert m.byte_fallback is True and m.vocab_size == 400
    tok = Tokenizer.load(m)
    assert [tok.id_to_piece(i) for i in range(5)] == list(SPECIAL_TOKENS)
    text = f"Le chat {UNSEEN[0]} dort sur {UNSEEN[1]}."
    ids = tok.encode([text])[0]
    assert 1 not in ids  # nothing unknown
    pieces = [tok.id_to_piece(i) for i in ids]
    want_bytes = [f"<0x{b:02X}>" for c in UNSEEN for b in c.encode("utf-8")]
    assert [p for p in pieces if p.startswith("<0x")] == want_bytes
    assert tok.decode(ids) == text
    # Byte pieces are ids 5..260, in byte order, right after the special ids.
    assert [tok.id_to_piece(5 + b) for b in (0, 0x41, 0xFF)] == ["<0x00>", "<0x41>", "<0xFF>"]


def test_without_byte_fallback_unseen_is_unk(tiny_tokenizer_manifest):
    assert tiny_tokenizer_manifest.byte_fallback is False
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    ids = tok.encode([f"chat {UNSEEN[0]}"])[0]
    assert ids.count(1) == 1
    assert not any(tok.id_to_piece(i).startswith("<0x") for i in range(tok.vocab_size))


def test_byte_fallback_vocab_too_small_names_byte_pieces(tiny_corpus_manifest, tmp_path):
    # 5 special + 256 byte pieces alone exceed 260: the trainer refuses, we explain why.
    cfg = TokenizerConfig(vocab_size=260, byte_fallback=True)
    with pytest.raises(ValueError, match=r"vocab_size=260 is less than .* 256 byte pieces"):
        train_tokenizer(cfg, tiny_corpus_manifest, tmp_path)


def test_sample_digest_is_sha256_of_training_text(
    tiny_tokenizer_manifest, byte_manifest, tiny_corpus_manifest
):
    want = hashlib.sha256(_reference_training_text(tiny_corpus_manifest)).hexdigest()
    assert tiny_tokenizer_manifest.sample_digest == want
    assert byte_manifest.sample_digest == want  # same corpus, other options


def test_sample_digest_changes_with_the_corpus(
    tmp_path, make_corpus_manifest, tiny_paragraphs
):
    corpus = make_corpus_manifest(tmp_path / "c", tiny_paragraphs[:12])
    m = train_tokenizer(TokenizerConfig(vocab_size=90), corpus, tmp_path / "w")
    want = hashlib.sha256(_reference_training_text(corpus)).hexdigest()
    assert m.sample_digest == want


def test_word_starts_matches_pieces(byte_manifest):
    tok = Tokenizer.load(byte_manifest)
    sp = spm.SentencePieceProcessor(model_file=str(byte_manifest.file(byte_manifest.model.path)))
    n = sp.get_piece_size()
    want = np.array(
        [i < 5 or sp.id_to_piece(i).startswith("\u2581") for i in range(n)], dtype=bool
    )
    got = tok.word_starts()
    assert got.dtype == np.bool_ and got.shape == (n,)
    np.testing.assert_array_equal(got, want)
    assert not got[[i for i in range(n) if sp.is_byte(i)]].any()
    assert got[:5].all() and 0 < got[5:].sum() < n - 5
    got[:] = False  # a copy: the next call is unaffected
    np.testing.assert_array_equal(tok.word_starts(), want)


def test_word_starts_count_words_of_a_text(byte_manifest):
    tok = Tokenizer.load(byte_manifest)
    starts = tok.word_starts()
    text = f"Les chats du jardin {UNSEEN[0]} dorment paisiblement"
    ids = tok.encode([text])[0]
    assert int(starts[ids].sum()) == len(text.split())
    assert starts[ids[0]]  # a text starts with a word
