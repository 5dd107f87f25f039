"""Unit tests of `mask_tokens` selection modes: `exact_k`, whole words, and both together.

Every expected value is computed here from the rows themselves (words from `word_starts`
by a plain loop, k = floor(p * n + 0.5)) or by the pure-Python reference of the documented
algorithm in `test_masking.py`; statistical bounds are 6 standard deviations.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_masking import MASK, make_rows, ref_exact_k, ref_mask_row, ref_words

from mlm_pipeline.config import MaskingConfig
from mlm_pipeline.masking import KeyedMasking, build_masker
from mlm_pipeline.masking.keyed import mask_tokens

VOCAB = 300
P, PM, PR = 0.15, 0.8, 0.1
#: (selection, whole_word) for every mode.
MODES = [("bernoulli", False), ("exact_k", False), ("bernoulli", True), ("exact_k", True)]
MODE_IDS = ["bernoulli", "exact_k", "ww-bernoulli", "ww-exact_k"]


def make_word_starts(vocab_size: int, share: float = 0.5, seed: int = 0) -> torch.Tensor:
    """Bool (V,): ordinary ids begin a word with probability `share`; specials do."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(vocab_size, generator=g) < share
    starts[:5] = True
    return starts


WORD_STARTS = make_word_starts(VOCAB)


def run(ids, selection, whole_word, **kw):
    options = {"vocab_size": VOCAB, "selection": selection, **kw}
    if whole_word:
        options["word_starts"] = WORD_STARTS
    return mask_tokens(ids, **options)


@pytest.fixture(scope="module", params=MODES, ids=MODE_IDS)
def big(request):
    selection, whole_word = request.param
    ids = make_rows(4000, 64, VOCAB, seed=1)
    corrupted, labels = run(ids, selection, whole_word, seed=5, epoch=2)
    return selection, whole_word, ids, corrupted, labels


# --- Equality with the reference


@pytest.mark.parametrize(("selection", "whole_word"), MODES, ids=MODE_IDS)
def test_matches_reference(selection, whole_word):
    vocab_size = 50
    ids = make_rows(8, 40, vocab_size, seed=3)
    ids[7] = 0  # an all-[PAD] row: n = 0, nothing selectable
    starts = make_word_starts(vocab_size, share=0.4, seed=2)
    continuation = int(torch.nonzero(~starts)[0])
    ids[5:7, 0] = continuation  # rows that begin inside a word (no [CLS])
    rows = torch.tensor([0, 1, 17, 2**43 + 5, 123456789, 2**30, 99, 7])
    assert_matches_reference(ids, rows, vocab_size, selection,
                             starts if whole_word else None)


def assert_matches_reference(ids, rows, vocab_size, selection, word_starts, word_ends=None,
                             special_ids=None, **ref):
    """`mask_tokens` of `ids` equals `ref_mask_row` row by row, at rates high enough that
    every branch (mask / random / keep) occurs in a small batch; `ref` passes the special
    ids and [MASK] id to the reference."""
    kw = dict(seed=11, epoch=2, p=0.4, pm=0.4, pr=0.35)
    corrupted, labels = mask_tokens(
        ids, vocab_size=vocab_size, row_index=rows, seed=kw["seed"], epoch=kw["epoch"],
        mlm_probability=kw["p"], mask_replace_prob=kw["pm"], random_replace_prob=kw["pr"],
        selection=selection, word_starts=word_starts, word_ends=word_ends,
        special_ids=special_ids,
    )
    for b in range(ids.shape[0]):
        ref_out, ref_labels = ref_mask_row(
            ids[b].tolist(), int(rows[b]), vocab_size=vocab_size, selection=selection,
            word_starts=None if word_starts is None else word_starts.tolist(),
            word_ends=None if word_ends is None else word_ends.tolist(), **ref, **kw,
        )
        assert labels[b].tolist() == ref_labels, b
        assert corrupted[b].tolist() == ref_out, b


# --- Invariants of every mode


def test_specials_never_selected_and_labels_consistent(big):
    _, _, ids, corrupted, labels = big
    special = ids < 5
    selected = labels != -100
    assert selected.any()
    assert not bool((selected & special).any())
    assert torch.equal(corrupted[~selected], ids[~selected])
    assert torch.equal(labels[selected], ids[selected])


def test_replacement_shares_within_six_sigma(big):
    _, _, ids, corrupted, labels = big
    selected = labels != -100
    n = selected.sum().item()
    orig, corr = ids[selected], corrupted[selected]
    n_ordinary = VOCAB - 5
    # A random replacement equals the original id with probability 1 / (V - 5).
    expected = {
        "mask": PM,
        "other": PR * (1 - 1 / n_ordinary),
        "kept": 1 - PM - PR + PR / n_ordinary,
    }
    observed = {
        "mask": (corr == MASK).sum().item() / n,
        "other": ((corr != orig) & (corr != MASK)).sum().item() / n,
        "kept": (corr == orig).sum().item() / n,
    }
    for name, q in expected.items():
        assert abs(observed[name] - q) < 6 * math.sqrt(q * (1 - q) / n), (name, observed)


def test_random_replacements_are_ordinary(big):
    _, _, ids, corrupted, labels = big
    replaced = (labels != -100) & (corrupted != ids) & (corrupted != MASK)
    values = corrupted[replaced]
    assert values.numel() > 100
    assert bool((values >= 5).all()) and bool((values < VOCAB).all())


def test_selected_count_per_row(big):
    selection, whole_word, ids, _, labels = big
    selected = labels != -100
    counts = selected.sum(1).tolist()
    if selection == "exact_k":
        for b, row in enumerate(ids.tolist()):
            k = ref_exact_k(sum(tok >= 5 for tok in row), P)
            if not whole_word:
                assert counts[b] == k, b
                continue
            # Words are taken while the running count stays <= k: the first word left out
            # is longer than what remained.
            lengths = [len(u) for u in ref_words(row, WORD_STARTS.tolist())]
            assert counts[b] <= k, b
            assert counts[b] == sum(lengths) or k - counts[b] < max(lengths), b
        return
    # Bernoulli: E = p * sum(len), Var = p (1 - p) * sum(len**2) over selection units.
    starts = WORD_STARTS.tolist() if whole_word else None
    lengths = [len(u) for row in ids.tolist() for u in ref_words(row, starts)]
    mean = P * sum(lengths)
    sd = math.sqrt(P * (1 - P) * sum(x * x for x in lengths))
    assert abs(sum(counts) - mean) < 6 * sd


@pytest.mark.parametrize("selection", ["bernoulli", "exact_k"])
def test_whole_words_are_selected_whole(selection):
    ids = make_rows(1000, 64, VOCAB, seed=2)
    selected = (run(ids, selection, True, seed=5)[1] != -100).tolist()
    starts = WORD_STARTS.tolist()
    n_partial = n_words = 0
    for row, sel in zip(ids.tolist(), selected):
        for word in ref_words(row, starts):
            flags = {sel[pos] for pos in word}
            n_partial += len(flags) > 1
            n_words += flags == {True}
    assert n_words > 500 and n_partial == 0


# --- Exact k: uniform among maskable positions


def test_exact_k_is_uniform_over_positions():
    # One row repeated under 4000 row ids: each maskable position is chosen with k / n.
    row = make_rows(1, 64, VOCAB, seed=9)[0]
    ids = row.expand(4000, -1).clone()
    n = int((row >= 5).sum())
    k = ref_exact_k(n, P)
    labels = mask_tokens(ids, vocab_size=VOCAB, selection="exact_k", seed=1)[1]
    freq = (labels != -100).double().mean(0)
    maskable = row >= 5
    q = k / n
    assert bool(((freq[maskable] - q).abs() < 6 * math.sqrt(q * (1 - q) / 4000)).all())
    assert bool((freq[~maskable] == 0).all())


@pytest.mark.parametrize(("p", "seq_len"), [(0.15, 3), (0.01, 40), (1.0, 32)])
def test_exact_k_edges(p, seq_len):
    ids = make_rows(16, max(seq_len, 8), VOCAB, seed=4)[:, :seq_len]
    for whole_word in (False, True):
        labels = run(ids, "exact_k", whole_word, mlm_probability=p)[1]
        counts = (labels != -100).sum(1).tolist()
        for b, row in enumerate(ids.tolist()):
            k = ref_exact_k(sum(tok >= 5 for tok in row), p)
            assert counts[b] <= k
            if not whole_word or p == 1.0:
                assert counts[b] == k


def test_round_half_up():
    # n = 10, p = 0.25 -> 2.5 -> 3 (Python's round would give 2); p = 0.15 -> 1.5 -> 2.
    ids = torch.full((2, 12), 7)
    ids[:, 0], ids[:, -1] = 2, 3
    for p, k in [(0.25, 3), (0.15, 2), (0.05, 1), (0.04, 0)]:
        labels = mask_tokens(ids, vocab_size=VOCAB, selection="exact_k", mlm_probability=p)[1]
        assert (labels != -100).sum(1).tolist() == [k, k]


# --- Keyed determinism


@pytest.mark.parametrize(("selection", "whole_word"), MODES, ids=MODE_IDS)
def test_same_row_same_mask_in_any_batch(selection, whole_word):
    ids = make_rows(8, 48, VOCAB, seed=5)
    rows = torch.arange(100, 108)
    a = run(ids, selection, whole_word, row_index=rows, seed=3, epoch=1)
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 4, 3])
    b = run(ids[perm], selection, whole_word, row_index=rows[perm], seed=3, epoch=1)
    assert torch.equal(b[0], a[0][perm]) and torch.equal(b[1], a[1][perm])
    other = make_rows(3, 48, VOCAB, seed=6)
    mixed = torch.stack([other[0], ids[3], other[1], ids[0], other[2]])
    c = run(mixed, selection, whole_word, row_index=torch.tensor([7, 103, 9, 100, 5]),
            seed=3, epoch=1)
    for i_mixed, i_orig in [(1, 3), (3, 0)]:
        assert torch.equal(c[0][i_mixed], a[0][i_orig])
        assert torch.equal(c[1][i_mixed], a[1][i_orig])


@pytest.mark.parametrize(("selection", "whole_word"), MODES, ids=MODE_IDS)
def test_new_epoch_gives_new_mask(selection, whole_word):
    ids = make_rows(64, 64, VOCAB)
    a = run(ids, selection, whole_word, epoch=0)[1] != -100
    b = run(ids, selection, whole_word, epoch=1)[1] != -100
    # Independent masks share a selected position with probability about 0.15.
    assert (a & b).sum().item() / a.sum().item() < 0.3


# --- Maskers and errors


def test_dynamic_masker_passes_selection_and_word_starts():
    cfg = MaskingConfig(selection="exact_k", whole_word=True)
    ids = make_rows(16, 40, VOCAB)
    rows = torch.arange(50, 66)
    masker = build_masker(cfg.model_copy(update={"seed": 4}), VOCAB,
                          word_starts=WORD_STARTS.numpy())
    got = masker(ids, rows, 3)
    want = mask_tokens(ids, vocab_size=VOCAB, row_index=rows, seed=4, epoch=3,
                       selection="exact_k", word_starts=WORD_STARTS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    state = masker.state_dict()
    assert state["selection"] == "exact_k" and state["whole_word"] is True

    resumed = build_masker(cfg, VOCAB, word_starts=WORD_STARTS)
    resumed.load_state_dict(state)
    again = resumed(ids, rows, 3)
    assert torch.equal(again[1], got[1])
    for other in (MaskingConfig(selection="bernoulli", whole_word=True),
                  MaskingConfig(selection="exact_k")):
        with pytest.raises(ValueError, match="selection|whole_word"):
            build_masker(other, VOCAB, word_starts=WORD_STARTS).load_state_dict(state)
    with pytest.raises(ValueError, match="algorithm"):
        resumed.load_state_dict({**state, "algorithm": 1})


def test_whole_word_needs_word_starts():
    with pytest.raises(ValueError, match="word_starts"):
        build_masker(MaskingConfig(whole_word=True), VOCAB)
    with pytest.raises(ValueError, match="word_starts"):
        KeyedMasking(MaskingConfig(whole_word=True), VOCAB, np.ones(VOCAB - 1, bool))
    # Without whole_word, word starts are ignored (token selection).
    masker = build_masker(MaskingConfig(), VOCAB, word_starts=WORD_STARTS)
    ids = make_rows(4, 20, VOCAB)
    assert torch.equal(masker(ids, torch.arange(4), 0)[1], mask_tokens(ids, vocab_size=VOCAB)[1])


@pytest.mark.parametrize(
    "kw",
    [
        {"selection": "topk"},
        {"word_starts": torch.ones(VOCAB - 1, dtype=torch.bool)},
        {"word_starts": torch.ones(VOCAB, dtype=torch.int64)},
    ],
)
def test_bad_mode_arguments_raise(kw):
    with pytest.raises(ValueError, match="selection|word_starts"):
        mask_tokens(torch.full((2, 4), 7), vocab_size=VOCAB, **kw)
