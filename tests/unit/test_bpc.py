"""`evaluate.bpc.bits_per_char`: whole-word masked bits per character, checked against
bits computed here from the model's own logits, and invariant to how the pieces are
numbered (the same model under a tokenizer whose ids are permuted)."""

from __future__ import annotations

import hashlib
import math

import torch

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.evaluate.bpc import bits_per_char, text_words
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.model import BertMLM

SEED = 7


def _chosen(doc: int, word: int, rate: float, seed: int = SEED) -> bool:
    """The keyed rule as the module docstring states it, written out."""
    h = hashlib.sha256(f"{seed}:{doc}:{word}".encode()).digest()
    return int.from_bytes(h[:8], "big") < rate * 2**64


def _model(vocab: int, seq_len: int = 64) -> BertMLM:
    torch.manual_seed(0)
    cfg = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64)
    return BertMLM(cfg, vocab, seq_len).eval()


def _single_piece_words(tok: Tokenizer, n: int) -> list[str]:
    """Words the tokenizer encodes as one piece: "\u2581word" pieces of its vocabulary."""
    words = []
    for i in range(5, tok.vocab_size):
        piece = tok.id_to_piece(i)
        word = piece[1:]
        if piece.startswith("\u2581") and word.isalpha() and tok.encode([word]) == [[i]]:
            words.append(word)
    assert len(words) >= n, words
    return words[:n]


def single_piece_bits(model: BertMLM, tok: Tokenizer, docs: list[str], seed: int,
                      rate: float) -> tuple[float, int, int]:
    """(bits, characters, words) of the chosen words of `docs` (each word one piece, each
    document one window), computed from the model's logits: one row per document, the
    chosen words' single pieces masked."""
    bits, chars, n = 0.0, 0, 0
    for d, text in enumerate(docs):
        ws = text.split()
        ids = [tok.cls_id] + [tok.piece_to_id("\u2581" + w) for w in ws] + [tok.sep_id]
        chosen = [j for j in range(len(ws)) if _chosen(d, j, rate, seed)]
        x = torch.tensor([ids])
        for j in chosen:
            x[0, j + 1] = tok.mask_id
        with torch.no_grad():
            p = torch.softmax(model(x).logits[0].double(), dim=-1)
        for j in chosen:
            bits += -math.log2(p[j + 1, ids[j + 1]].item())
            chars += len(ws[j]) + 1
            n += 1
    return bits, chars, n


def test_bits_equal_the_logits_of_single_piece_words(tiny_tokenizer_manifest):
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    model = _model(tok.vocab_size)
    words = _single_piece_words(tok, 12)
    docs = [" ".join(words), " ".join(reversed(words))]
    rate = 0.5
    got = bits_per_char(model, tok, docs, seed=SEED, max_chars=10_000, rate=rate)
    bits, chars, n = single_piece_bits(model, tok, docs, SEED, rate)
    assert 0 < n < 24 and got.words == n and got.pieces == n and got.chars == chars
    assert math.isclose(got.bits, bits, rel_tol=1e-4)
    assert math.isclose(got.bits_per_char, bits / chars, rel_tol=1e-4)
    # Batching does not change it.
    again = bits_per_char(model, tok, docs, seed=SEED, max_chars=10_000, rate=rate,
                          batch_size=1)
    assert math.isclose(again.bits, got.bits, rel_tol=1e-5)


class _Permuted:
    """A tokenizer with the same pieces as `tok`, numbered otherwise (ordinary ids
    reversed; the special ids 0-4 are fixed): another vocabulary numbering."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.vocab_size, self.path = tok, tok.vocab_size, tok.path
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = (
            tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id)

    def perm(self, i: int) -> int:
        return i if i < 5 else self.vocab_size - 1 - (i - 5)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[self.perm(i) for i in ids] for ids in self.tok.encode(texts)]


def test_invariant_to_the_numbering_of_pieces(tiny_tokenizer_manifest, tiny_paragraphs):
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    model = _model(tok.vocab_size)
    other = _Permuted(tok)
    permuted = _model(tok.vocab_size)
    order = torch.tensor([other.perm(i) for i in range(tok.vocab_size)])
    inverse = torch.argsort(order)
    with torch.no_grad():
        state = model.state_dict()
        for key, value in state.items():
            # The rows indexed by vocabulary id: embedding table, head weights/bias.
            if value.shape[:1] == (model.padded_vocab_size,):
                value = value.clone()
                value[:tok.vocab_size] = value[:tok.vocab_size][inverse]
            state[key] = value
        permuted.load_state_dict(state)
    docs = tiny_paragraphs[:6]
    a = bits_per_char(model, tok, docs, seed=SEED, max_chars=3000)
    b = bits_per_char(permuted, other, docs, seed=SEED, max_chars=3000)
    assert a.words > 10 and a.pieces > a.words  # multi-piece words are scored too
    assert (a.words, a.chars, a.pieces) == (b.words, b.chars, b.pieces)
    assert math.isclose(a.bits_per_char, b.bits_per_char, rel_tol=1e-4)


def test_budget_takes_whole_words_in_order():
    docs = ["ab cd ef", "ghi", "jk lm"]
    assert text_words(docs, 100) == [["ab", "cd", "ef"], ["ghi"], ["jk", "lm"]]
    # 3 + 3 + 3 + 4 = 13 characters (each word plus its space); "jk" would make 16.
    assert text_words(docs, 15) == [["ab", "cd", "ef"], ["ghi"]]
    assert text_words(docs, 7) == [["ab", "cd"]]
