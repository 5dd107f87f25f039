"""Unit tests of `mlm_pipeline.masking.keyed`: statistics, keyed determinism, the hash itself."""

from __future__ import annotations

import math

import pytest
import torch

from mlm_pipeline.config import MaskingConfig
from mlm_pipeline.masking.keyed import mask_tokens, mix64_
from mlm_pipeline.masking.maskers import DynamicMasker, Masker, build_masker

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# --- A pure-Python reference of the documented algorithm (unbounded ints, explicit mod 2**64).


def ref_mix64(z: int) -> int:
    z &= M64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def as_signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


def to_int64(z: int) -> int:
    return as_signed(z & M64)


def ref_t(q: float) -> int:
    """t(q) = floor(q * 2**32); exact for a float64 q (power-of-two scaling)."""
    return math.floor(q * 2**32)


def ref_words(ids, word_starts, special=frozenset(range(5)), word_ends=None):
    """Maskable positions grouped into selection units: single tokens when `word_starts` is
    None, else whole words (a word begins at position 0, after a non-maskable position or
    an id flagged in `word_ends`, or at an id flagged in `word_starts`)."""
    units = []
    for pos, tok in enumerate(ids):
        if tok in special:
            continue
        if (word_starts is None or pos == 0 or ids[pos - 1] in special or word_starts[tok]
                or (word_ends is not None and word_ends[ids[pos - 1]])):
            units.append([pos])
        else:
            units[-1].append(pos)
    return units


def ref_exact_k(n: int, p: float) -> int:
    return math.floor(p * n + 0.5)


def ref_mask_row(ids, row, *, seed, epoch, vocab_size, p, pm, pr, selection="bernoulli",
                 word_starts=None, special=frozenset(range(5)), mask_id=MASK,
                 word_ends=None):
    """The documented algorithm for one row, one position at a time, on Python ints
    (`special`: the ids never selected; the random ids are the others, ascending)."""
    key = ref_mix64(ref_mix64(seed) + (epoch + 1) * GOLDEN)
    bits = [ref_mix64(key + ((row << 20) | pos) * GOLDEN) for pos in range(len(ids))]
    high = [as_signed(b) >> 32 for b in bits]  # floor(s(bits) / 2**32): Python >> floors
    low = [b % 2**32 for b in bits]
    units = ref_words(ids, word_starts, special, word_ends)
    if selection == "bernoulli":
        chosen = [u for u in units if high[u[0]] < -(2**31) + ref_t(p)]
    else:
        k = ref_exact_k(sum(tok not in special for tok in ids), p)
        chosen, total = [], 0
        for unit in sorted(units, key=lambda u: (high[u[0]], u[0])):
            if total + len(unit) > k:
                break
            chosen.append(unit)
            total += len(unit)
    selected = {pos for unit in chosen for pos in unit}
    ordinary = [i for i in range(vocab_size) if i not in special]
    m, t_random, t_change = len(ordinary), ref_t(pr), ref_t(pr + pm)
    shift = 63 - m.bit_length()
    multiplier = (m << shift) // t_random if t_random else 0
    out, labels = [], []
    for pos, tok in enumerate(ids):
        if pos not in selected:
            out.append(tok)
            labels.append(-100)
            continue
        labels.append(tok)
        if low[pos] < t_random:
            out.append(ordinary[low[pos] * multiplier >> shift])
        elif low[pos] < t_change:
            out.append(mask_id)
        else:
            out.append(tok)
    return out, labels


# --- Fixtures


def make_rows(n_rows: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[CLS] ordinary... [SEP] inside ... [SEP] [PAD]*; pad tails of random length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (n_rows, seq_len), generator=g)
    n_real = seq_len - torch.randint(0, seq_len // 3, (n_rows,), generator=g)
    pos = torch.arange(seq_len).expand(n_rows, seq_len)
    inner_sep = torch.randint(2, seq_len // 2, (n_rows, 1), generator=g)
    ids[:, 0] = CLS
    ids[pos == inner_sep] = SEP
    ids[pos == (n_real - 1).unsqueeze(1)] = SEP
    ids[pos >= n_real.unsqueeze(1)] = PAD
    ids[:, 5] = UNK  # an [UNK] inside every row must never be selected either
    return ids


@pytest.fixture(scope="module")
def big_batch():
    vocab_size = 1000
    ids = make_rows(10_000, 64, vocab_size)
    original = ids.clone()
    corrupted, labels = mask_tokens(ids, vocab_size=vocab_size, seed=7, epoch=3)
    return vocab_size, ids, original, corrupted, labels


# --- The hash


def test_mix64_matches_published_splitmix64_outputs():
    # First outputs of SplitMix64 seeded with 1234567 (Vigna's splitmix64.c: state += GAMMA,
    # then mix), the standard check vector.
    expected = [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    states = torch.tensor([to_int64(1234567 + (i + 1) * GOLDEN) for i in range(5)])
    got = mix64_(states.clone())
    assert [v & M64 for v in got.tolist()] == expected


def test_mix64_tensor_wraps_like_unsigned_reference():
    g = torch.Generator().manual_seed(1)
    values = torch.randint(-(2**63), 2**63 - 1, (2000,), generator=g, dtype=torch.int64)
    edge = torch.tensor([0, 1, -1, -(2**63), 2**63 - 1, 2**62, -(2**62)], dtype=torch.int64)
    values = torch.cat([values, edge])
    got = mix64_(values.clone()).tolist()
    assert got == [to_int64(ref_mix64(v)) for v in values.tolist()]


def test_mask_tokens_matches_reference_algorithm():
    vocab_size, seq_len = 50, 40
    ids = make_rows(6, seq_len, vocab_size, seed=3)
    rows = torch.tensor([0, 1, 17, 2**41 + 5, 123456789, 2**30])
    # High probabilities so every branch (mask / random / keep) occurs in a small batch.
    kw = dict(seed=11, epoch=2, p=0.5, pm=0.4, pr=0.35)
    corrupted, labels = mask_tokens(
        ids, vocab_size=vocab_size, row_index=rows, seed=kw["seed"], epoch=kw["epoch"],
        mlm_probability=kw["p"], mask_replace_prob=kw["pm"], random_replace_prob=kw["pr"],
    )
    for b in range(ids.shape[0]):
        ref_out, ref_labels = ref_mask_row(
            ids[b].tolist(), int(rows[b]), vocab_size=vocab_size, **kw
        )
        assert corrupted[b].tolist() == ref_out
        assert labels[b].tolist() == ref_labels


@pytest.mark.parametrize("m", [1, 95, 31995, 249995])
@pytest.mark.parametrize("pr", [0.01, 0.1, 0.5, 0.999999, 1.0])
def test_random_id_formula_is_nearly_uniform(m, pr):
    # The documented random id floor(c * M / 2**S) over the t values of c in the random
    # bucket: id j comes from c in [ceil(j 2**S / M), ceil((j + 1) 2**S / M)) cut at t.
    # Each count must be t / m within the documented relative m / t + 2**(32 - S).
    t = ref_t(pr)
    shift = 63 - m.bit_length()
    multiplier = (m << shift) // t
    first_c = [min(t, -(-(j << shift) // multiplier)) for j in range(m + 1)]
    counts = [b - a for a, b in zip(first_c, first_c[1:])]
    assert sum(counts) == t  # every c of the bucket lands in [0, m)
    bound = m / t + 2.0 ** (32 - shift)
    assert max(abs(n * m / t - 1) for n in counts) <= bound


# --- Statistics (Devlin et al. 2019, §3.1)


def test_specials_and_padding_untouched(big_batch):
    _, ids, _, corrupted, labels = big_batch
    special = ids < 5
    assert special.sum() > 10_000 * 3  # the fixture really has [CLS], [SEP]x2, [UNK], [PAD]
    assert torch.equal(corrupted[special], ids[special])
    assert bool((labels[special] == -100).all())


def test_selection_rate(big_batch):
    _, ids, _, _, labels = big_batch
    maskable = ids >= 5
    selected = labels != -100
    assert not bool((selected & ~maskable).any())
    rate = selected.sum().item() / maskable.sum().item()
    assert abs(rate - 0.15) < 0.005


def test_replacement_shares(big_batch):
    vocab_size, ids, _, corrupted, labels = big_batch
    selected = labels != -100
    n_sel = selected.sum().item()
    orig, corr = ids[selected], corrupted[selected]
    to_mask = (corr == MASK).sum().item() / n_sel
    to_other = ((corr != orig) & (corr != MASK)).sum().item() / n_sel
    kept = (corr == orig).sum().item() / n_sel
    # A random replacement equals the original with probability 1 / (V - 5).
    n_ordinary = vocab_size - 5
    assert abs(to_mask - 0.8) < 0.01
    assert abs(to_other - 0.1 * (1 - 1 / n_ordinary)) < 0.005
    assert abs(kept - (0.1 + 0.1 / n_ordinary)) < 0.005


def test_labels_and_unselected_positions(big_batch):
    _, ids, _, corrupted, labels = big_batch
    selected = labels != -100
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(corrupted[~selected], ids[~selected])
    assert labels.dtype == torch.int64 and corrupted.dtype == torch.int64


def test_random_replacements_are_ordinary_and_uniform(big_batch):
    vocab_size, ids, _, corrupted, labels = big_batch
    replaced = (labels != -100) & (corrupted != ids) & (corrupted != MASK)
    values = corrupted[replaced]
    assert bool((values >= 5).all()) and bool((values < vocab_size).all())
    # 10 equal-width bins over [5, 1000): each holds ~1/10 of the draws.
    bins = torch.histc(values.double(), bins=10, min=5, max=vocab_size)
    shares = bins / bins.sum()
    assert bool(((shares - 0.1).abs() < 0.015).all()), shares


def test_neighbouring_selections_are_independent(big_batch):
    _, ids, _, _, labels = big_batch
    sel = labels != -100
    maskable = ids >= 5
    for a, b, m in [
        (sel[:, 1:], sel[:, :-1], maskable[:, 1:] & maskable[:, :-1]),  # same row, next position
        (sel[1:], sel[:-1], maskable[1:] & maskable[:-1]),  # next row, same position
    ]:
        joint = (a & b & m).sum().item() / m.sum().item()
        assert abs(joint - 0.15**2) < 0.002


def test_input_not_modified(big_batch):
    _, ids, original, _, _ = big_batch
    assert torch.equal(ids, original)


def test_extreme_replacement_probabilities():
    ids = make_rows(200, 32, 100)
    corr, labels = mask_tokens(ids, vocab_size=100, mask_replace_prob=1.0, random_replace_prob=0.0)
    sel = labels != -100
    assert sel.any() and bool((corr[sel] == MASK).all())
    corr, labels = mask_tokens(ids, vocab_size=6, mask_replace_prob=0.0, random_replace_prob=1.0)
    sel = labels != -100
    assert sel.any() and bool((corr[sel] == 5).all())  # the only ordinary id of vocab 6


# --- Keyed determinism


def test_same_key_same_mask_in_any_batch_composition():
    ids = make_rows(8, 48, 500, seed=5)
    rows = torch.arange(100, 108)
    a = mask_tokens(ids, vocab_size=500, row_index=rows, seed=3, epoch=1)
    b = mask_tokens(ids, vocab_size=500, row_index=rows, seed=3, epoch=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Rows 103 and 100 placed elsewhere, next to other rows.
    other = make_rows(3, 48, 500, seed=6)
    mixed = torch.stack([other[0], ids[3], other[1], ids[0], other[2]])
    mixed_rows = torch.tensor([7, 103, 9999, 100, 5])
    c = mask_tokens(mixed, vocab_size=500, row_index=mixed_rows, seed=3, epoch=1)
    for i_mixed, i_orig in [(1, 3), (3, 0)]:
        assert torch.equal(c[0][i_mixed], a[0][i_orig])
        assert torch.equal(c[1][i_mixed], a[1][i_orig])


def test_default_row_index_is_arange():
    ids = make_rows(5, 32, 300)
    a = mask_tokens(ids, vocab_size=300)
    b = mask_tokens(ids, vocab_size=300, row_index=torch.arange(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint16])
def test_narrow_input_dtypes_give_same_result(dtype):
    ids = make_rows(16, 32, 300)
    a = mask_tokens(ids, vocab_size=300, seed=1)
    rows = torch.arange(16, dtype=torch.int32)
    b = mask_tokens(ids.to(dtype), vocab_size=300, seed=1, row_index=rows)
    assert b[0].dtype == torch.int64 and b[1].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("change", [{"epoch": 1}, {"seed": 1}])
def test_new_epoch_or_seed_gives_new_mask(change):
    ids = make_rows(64, 64, 300)
    base = mask_tokens(ids, vocab_size=300, seed=0, epoch=0)[1] != -100
    other = mask_tokens(ids, vocab_size=300, **{"seed": 0, "epoch": 0, **change})[1] != -100
    # Independent masks agree on a selected position with probability 0.15 only.
    overlap = (base & other).sum().item() / base.sum().item()
    assert overlap < 0.3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("selection", ["bernoulli", "exact_k"])
@pytest.mark.parametrize("whole_word", [False, True])
def test_cuda_matches_cpu(selection, whole_word):
    ids = make_rows(512, 128, 8000)
    rows = torch.arange(10**9, 10**9 + 512)
    starts = torch.rand(8000, generator=torch.Generator().manual_seed(0)) < 0.5
    kw = dict(vocab_size=8000, seed=5, epoch=9, selection=selection)
    a = mask_tokens(ids, row_index=rows, word_starts=starts if whole_word else None, **kw)
    b = mask_tokens(ids.cuda(), row_index=rows.cuda(),
                    word_starts=starts.cuda() if whole_word else None, **kw)
    assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())


# --- Errors


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda: mask_tokens(torch.zeros(2, 4), vocab_size=10), TypeError),
        (lambda: mask_tokens(torch.zeros(8, dtype=torch.long), vocab_size=10), ValueError),
        (lambda: mask_tokens(torch.zeros(2, 4, dtype=torch.long), vocab_size=5), ValueError),
        (
            lambda: mask_tokens(
                torch.zeros(2, 4, dtype=torch.long), vocab_size=10, row_index=torch.arange(3)
            ),
            ValueError,
        ),
        (
            lambda: mask_tokens(
                torch.zeros(2, 4, dtype=torch.long), vocab_size=10,
                mask_replace_prob=0.9, random_replace_prob=0.2,
            ),
            ValueError,
        ),
        (
            lambda: mask_tokens(
                torch.zeros(2, 4, dtype=torch.long), vocab_size=10, mlm_probability=1.5
            ),
            ValueError,
        ),
    ],
)
def test_bad_input_raises(call, exc):
    with pytest.raises(exc, match="masking"):
        call()


# --- Masker


def test_build_masker_uses_config_and_restores_state():
    cfg = MaskingConfig(mlm_probability=0.3, mask_replace_prob=0.5, random_replace_prob=0.25)
    masker = build_masker(cfg.model_copy(update={"seed": 21}), vocab_size=400)
    assert isinstance(masker, Masker) and isinstance(masker, DynamicMasker)
    ids = make_rows(32, 40, 400)
    rows = torch.arange(1000, 1032)
    got = masker(ids, rows, 4)
    expected = mask_tokens(
        ids, vocab_size=400, row_index=rows, seed=21, epoch=4,
        mlm_probability=0.3, mask_replace_prob=0.5, random_replace_prob=0.25,
    )
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    resumed = build_masker(cfg, vocab_size=400)
    resumed.load_state_dict(masker.state_dict())
    again = resumed(ids, rows, 4)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])

    with pytest.raises(ValueError, match="vocab_size"):
        build_masker(cfg, vocab_size=401).load_state_dict(masker.state_dict())
