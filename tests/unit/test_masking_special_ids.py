"""Masking with a tokenizer's own special ids (a BERT vocabulary's [PAD] 0, [UNK] 100,
[CLS] 101, [SEP] 102, [MASK] 103 and other special tokens), word ends, and the two
implementations of `mask_tokens` (numpy on CPU tensors, torch elsewhere) against each
other and against the pure-Python reference of `test_masking.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_masking import make_rows
from test_masking_modes import assert_matches_reference

from mlm_pipeline.config import MaskingConfig, SpecialIds
from mlm_pipeline.masking import KeyedMasking, build_masker, keyed, keyed_numpy
from mlm_pipeline.masking.keyed import mask_tokens

VOCAB = 400
#: A BERT-like layout with two more special tokens (7, 250) that are no role.
BERT = SpecialIds(pad_id=0, unk_id=100, cls_id=101, sep_id=102, mask_id=103,
                  all_special_ids=(0, 7, 100, 101, 102, 103, 250))
SPECIAL = frozenset(BERT.all_special_ids)
MODES = [("bernoulli", False), ("exact_k", False), ("bernoulli", True), ("exact_k", True)]
MODE_IDS = ["bernoulli", "exact_k", "ww-bernoulli", "ww-exact_k"]


def bert_rows(n_rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[CLS] ordinary ... [SEP] ... [SEP] [PAD]*, with the other special ids inside."""
    g = torch.Generator().manual_seed(seed)
    ordinary = torch.tensor([i for i in range(VOCAB) if i not in SPECIAL])
    ids = ordinary[torch.randint(0, len(ordinary), (n_rows, seq_len), generator=g)]
    n_real = seq_len - torch.randint(0, seq_len // 3, (n_rows,), generator=g)
    pos = torch.arange(seq_len).expand(n_rows, seq_len)
    ids[:, 0] = BERT.cls_id
    ids[pos == torch.randint(2, seq_len // 2, (n_rows, 1), generator=g)] = BERT.sep_id
    ids[pos == (n_real - 1).unsqueeze(1)] = BERT.sep_id
    ids[pos >= n_real.unsqueeze(1)] = BERT.pad_id
    ids[:, 3] = BERT.unk_id
    ids[:, 4] = 7
    ids[:, 6] = 250
    return ids


def tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(VOCAB, generator=g) < 0.5
    ends = torch.rand(VOCAB, generator=g) < 0.2
    starts[list(SPECIAL)] = True
    return starts, ends


def torch_implementation(ids, **kw):
    """`mask_tokens` with the numpy implementation switched off: the torch ops, on CPU."""
    real = keyed_numpy.mask_numpy
    keyed_numpy.mask_numpy = lambda *a, **k: None
    try:
        return mask_tokens(ids, **kw)
    finally:
        keyed_numpy.mask_numpy = real


@pytest.mark.parametrize(("selection", "whole_word"), MODES, ids=MODE_IDS)
def test_matches_reference_with_bert_ids_and_word_ends(selection, whole_word):
    ids = bert_rows(8, 40, seed=3)
    starts, ends = tables(2)
    rows = torch.tensor([0, 1, 17, 2**43 + 5, 123456789, 2**30, 99, 7])
    assert_matches_reference(ids, rows, VOCAB, selection, starts if whole_word else None,
                             ends if whole_word else None, special_ids=BERT,
                             special=SPECIAL, mask_id=BERT.mask_id)


@pytest.mark.parametrize(("selection", "whole_word"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("special_ids", [None, BERT], ids=["ours", "bert"])
@pytest.mark.parametrize(("batch", "seq_len"), [(33, 128), (300, 17), (2, 1)])
def test_numpy_and_torch_implementations_agree(selection, whole_word, special_ids, batch,
                                               seq_len):
    rows = bert_rows if special_ids is BERT else lambda n, length, seed: make_rows(
        n, length, VOCAB, seed=seed)
    ids = rows(batch, max(seq_len, 8), seed=batch)[:, :seq_len].contiguous()
    starts, ends = tables(1)
    kw = dict(vocab_size=VOCAB, row_index=torch.arange(batch) * 3 + 1000, seed=4, epoch=1,
              selection=selection, special_ids=special_ids,
              word_starts=starts if whole_word else None, word_ends=ends if whole_word else None)
    for p, pr in ((0.15, 0.1), (0.6, 0.0), (1.0, 0.5)):
        a = mask_tokens(ids.to(torch.int32), mlm_probability=p, random_replace_prob=pr,
                        mask_replace_prob=min(0.8, 1 - pr), **kw)
        b = torch_implementation(ids, mlm_probability=p, random_replace_prob=pr,
                                 mask_replace_prob=min(0.8, 1 - pr), **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (p, pr)


def test_bert_ids_never_selected_and_replacements_ordinary():
    ids = bert_rows(4000, 64, seed=5)
    corrupted, labels = mask_tokens(ids, vocab_size=VOCAB, special_ids=BERT, seed=1,
                                    mask_replace_prob=0.5, random_replace_prob=0.5)
    special = torch.isin(ids, torch.tensor(sorted(SPECIAL)))
    assert bool((labels[special] == -100).all())
    assert torch.equal(corrupted[special], ids[special])
    selected = labels != -100
    rate = selected.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.005
    assert (corrupted[selected] == BERT.mask_id).float().mean().item() == pytest.approx(0.5, abs=0.01)
    drawn = corrupted[selected & (corrupted != BERT.mask_id) & (corrupted != ids)]
    assert not bool(torch.isin(drawn, torch.tensor(sorted(SPECIAL))).any())
    # Uniform over the ordinary ids: each of 10 equal groups of them holds ~1/10.
    ordinary = np.array([i for i in range(VOCAB) if i not in SPECIAL])
    group = np.searchsorted(ordinary, drawn.numpy()) * 10 // len(ordinary)
    shares = np.bincount(group, minlength=10) / len(group)
    assert np.abs(shares - 0.1).max() < 0.02, shares


def test_keyed_masking_carries_the_ids_and_refuses_ids_outside_the_vocabulary():
    cfg = MaskingConfig(whole_word=True, selection="exact_k")
    starts, ends = tables()
    masking = KeyedMasking(cfg, VOCAB, starts, special_ids=BERT, word_ends=ends)
    ids = bert_rows(16, 32)
    got = masking(ids, torch.arange(16), 3)
    want = mask_tokens(ids, vocab_size=VOCAB, row_index=torch.arange(16), epoch=3,
                       selection="exact_k", word_starts=starts, word_ends=ends,
                       special_ids=BERT)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    masker = build_masker(cfg, VOCAB, word_starts=starts, special_ids=BERT, word_ends=ends)
    again = masker(ids, torch.arange(16), 3)
    assert torch.equal(again[0], want[0])
    with pytest.raises(ValueError, match="special id 250 is outside the vocabulary of 200"):
        KeyedMasking(MaskingConfig(), 200, special_ids=BERT)


def test_exact_k_tie_of_h_defers_to_the_exact_path():
    # Two maskable positions share h at the k-th place: 32-bit ranking cannot order them.
    seq_len = 20
    k = int(np.floor(0.15 * seq_len + 0.5))  # 3
    high = np.arange(seq_len, dtype=np.int64) * 1000
    high[k] = high[k - 1]  # the k-th and (k+1)-th smallest h are equal
    bits = (high << 32) | 12345
    special = np.zeros(seq_len, dtype=bool)
    assert keyed_numpy._selected_tokens_exact_k(bits, special, 1, seq_len, 0.15) is None
    high[k] += 1  # no tie: the k smallest
    bits = (high << 32) | 12345
    got = keyed_numpy._selected_tokens_exact_k(bits, special, 1, seq_len, 0.15)
    assert got.nonzero()[0].tolist() == [0, 1, 2]


def test_cpu_tensors_take_the_numpy_implementation(monkeypatch):
    calls = []
    real = keyed_numpy.mask_numpy
    monkeypatch.setattr(keyed_numpy, "mask_numpy", lambda *a, **k: calls.append(1) or real(*a, **k))
    mask_tokens(bert_rows(2, 16), vocab_size=VOCAB, special_ids=BERT)
    assert calls == [1]
    assert keyed.mask_tokens is mask_tokens


def reference_words_exact_k(ids_row, high, starts, special, p):
    """Selected positions of one row, as the module docstring of `keyed` says: words in
    `(h of the first position, first position)` order while their tokens fit in k."""
    words = []
    for pos, tok in enumerate(ids_row):
        if tok in special:
            continue
        if pos == 0 or ids_row[pos - 1] in special or starts[tok]:
            words.append([pos])
        else:
            words[-1].append(pos)
    k = int(np.floor(p * sum(t not in special for t in ids_row) + 0.5))
    chosen, total = [], 0
    for word in sorted(words, key=lambda w: (high[w[0]], w[0])):
        if total + len(word) > k:
            break
        chosen += word
        total += len(word)
    return sorted(chosen)


@pytest.mark.parametrize("tie", [False, True], ids=["distinct", "boundary-tie"])
def test_whole_word_exact_k_ranking_and_its_tie_resolution(tie):
    # One row of 40 tokens; words begin at even ids. The draws' high halves are chosen so
    # that, with `tie`, two words share h right at the k-th token.
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 60, 40)
    ids[0], ids[20] = 2, 3  # [CLS], a [SEP]
    starts = np.zeros(60, dtype=bool)
    starts[::2] = True
    starts[:5] = True
    special = ids < 5
    high = rng.permutation(40).astype(np.int64) * 1000 - 20000
    bits = (high << 32) | 777
    first, start = keyed_numpy._word_starts_index(ids, special, 1, 40, starts, None)
    p = 0.3
    want = reference_words_exact_k(ids.tolist(), high.tolist(), starts, set(range(5)), p)
    if tie:  # give the first word past the boundary the h of the last word taken
        words = sorted(set(start[~special].tolist()), key=lambda q: high[q])
        taken = sorted({int(start[q]) for q in want}, key=lambda q: high[q])
        nxt = words[len(taken)]
        high[nxt] = high[taken[-1]]
        bits = (high << 32) | 777
        want = reference_words_exact_k(ids.tolist(), high.tolist(), starts, set(range(5)), p)
    got = keyed_numpy._selected_words_exact_k(bits, special, first, start, 1, 40, p)
    packed = keyed_numpy._selected_words_exact_k_packed(bits, special, first, start, 1, 40, p)
    assert sorted(got.tolist()) == want == sorted(packed.tolist())
