"""The CPU implementation of `keyed.mask_tokens`: the same algorithm, the same bits, in numpy.

`mask_tokens` on CPU tensors runs here, on zero-copy numpy views; elsewhere as torch ops
(`keyed`). Both follow the `keyed` module docstring exactly, so a row gets the same mask
on any device (`tests/unit/test_masking.py` checks this module against a pure-Python
reference and against the torch implementation on CPU tensors).

Why numpy on the CPU. At training batch sizes (4,096 tokens at B=32, L=128) masking is a
chain of some 40-70 array operations on small arrays, so what one call costs besides its
arithmetic decides the speed: a torch op costs about 3-5 us on this project's CPUs, a
numpy ufunc 1-3 us. numpy also has unsigned 64-bit shifts (torch's `>>` on int64 is
arithmetic and needs a mask after each shift), and on AVX2 CPUs a vectorized sort of
32-bit keys (x86-simd-sort, numpy >= 2.0). Three more rules, each measured
(`benchmarks/bench_masking.py`, the profile in `benchmarks/RESULTS.md`): the batch is
handled as one flat array (no strided 2-D slices); a choice between two values on an
unpredictable mask is arithmetic (`np.where` and masked copies branch per element and
cost 4-5x more at B=256); and the 80/10/10 replacement reads the draws of the selected
positions only (about `mlm_probability` of them), gathered into short arrays.

exact_k ranks a row's maskable positions by `(h, position)` (h = the signed high half of
the draw). Ranking by h alone, as 32-bit keys, gives the same k positions unless the
k-th and (k+1)-th smallest h are equal (probability about k / 2**32 per row, so about
once in 10**8 rows); such a batch is recomputed by the exact 64-bit path (`keyed`'s
torch implementation). Whole-word exact_k ranks the tokens by their word's h, again as
32-bit keys (`_selected_words_exact_k`); two words sharing the boundary's h (about 1e-6
of rows) are resolved by a partial sort of one 64-bit key per word packing `(h,
position, length)`, exact for rows up to `_MAX_PACKED_LEN` tokens (longer ones: the
torch implementation).
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

from mlm_pipeline.config import IGNORE_INDEX
from mlm_pipeline.masking.vocab import MaskingVocab

_M64 = (1 << 64) - 1
_U64 = np.uint64
_LOW32 = (1 << 32) - 1
_HIGH32 = -(1 << 32)  # int64 with the low 32 bits clear: keeps the high half of a draw
_UINT32_MAX = np.uint32(0xFFFFFFFF)
#: XOR with the sign bit maps signed order onto unsigned order (a sorted keys' sentinel,
#: all ones, then sorts after every real key, bar a tie that is recomputed exactly).
_SIGN32 = np.uint32(1 << 31)
_UINT64_MAX = _U64((1 << 64) - 1)
_SIGN64 = _U64(1 << 63)
#: The position field of a whole-word exact_k key (bits 16-31), and the longest row
#: whose positions and word lengths fit its 16-bit fields (longer rows: the torch
#: implementation).
_POSITION_MASK = 0xFFFF
_MAX_PACKED_LEN = 0xFFFE
#: The high half of each little-endian int64 is its second int32.
_HIGH_WORD = 1 if sys.byteorder == "little" else 0


@functools.lru_cache(maxsize=64)
def _position_term(seq_len: int, key: int, gamma: int) -> np.ndarray:
    """uint64 (1, L): `key + position * GAMMA` (mod 2**64), read-only, cached."""
    term = (np.arange(seq_len, dtype=_U64) * _U64(gamma) + _U64(key)).reshape(1, -1)
    term.setflags(write=False)
    return term


@functools.lru_cache(maxsize=32)
def _flat_positions(batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(flat, in_row, row_start)` for a (B, L) batch read as one flat array of B * L:
    int64 (B*L,) 0 .. B*L-1; uint64 (B*L,) each position's index in its row shifted left
    by 16 (the position field of a whole-word exact_k key); int64 (B,) each row's first
    flat index. Read-only, cached."""
    flat = np.arange(batch * seq_len, dtype=np.int64)
    in_row = np.tile(np.arange(seq_len, dtype=_U64) << _U64(16), batch)
    row_start = flat[::seq_len].copy()
    for a in (flat, in_row, row_start):
        a.setflags(write=False)
    return flat, in_row, row_start


@functools.lru_cache(maxsize=32)
def _exact_k_by_specials(seq_len: int, mlm_probability: float) -> np.ndarray:
    """int64 (L + 1,): at index s, `exact_k(L - s, p) = floor(p * (L - s) + 0.5)`, the k
    of a row with s special tokens; cached."""
    n = np.arange(seq_len, -1, -1, dtype=np.float64)
    table = np.floor(mlm_probability * n + 0.5).astype(np.int64)
    table.setflags(write=False)
    return table


def draws(row_index: np.ndarray, seq_len: int, key: int, gamma: int,
          multipliers: tuple[int, int]) -> np.ndarray:
    """`bits` of the `keyed` docstring: int64 (B, L) for rows `row_index` (int64 (B,))."""
    row_term = row_index.view(_U64) * _U64(((gamma << 20) & _M64))
    z = np.add(_position_term(seq_len, key, gamma), row_term.reshape(-1, 1))
    t = np.empty_like(z)
    for shift, mul in ((30, multipliers[0]), (27, multipliers[1]), (31, None)):
        np.right_shift(z, _U64(shift), out=t)  # uint64: logical shifts
        z ^= t
        if mul is not None:
            z *= _U64(mul)
    return z.view(np.int64)


def _row_k(special: np.ndarray, batch: int, seq_len: int, p: float) -> np.ndarray:
    """int64 (B,): `exact_k(n, p)` of each row, n its maskable tokens (`special` flat)."""
    specials = special.view(np.int8).reshape(batch, seq_len).sum(1, dtype=np.int32)
    return _exact_k_by_specials(seq_len, p).take(specials)


def _row_sorted(keys: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    """Flat (B*L,) `keys` sorted within each row of L, as a new flat array."""
    return np.sort(keys.reshape(batch, seq_len), axis=1).reshape(-1)


def _high_keys(bits: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """uint32 (B*L,): the high half h of each draw as an order-preserving unsigned key,
    0xFFFFFFFF where `excluded` (bool (B*L,)): arithmetic, not `np.where` (a branch per
    element on an unpredictable mask is several times slower)."""
    keys = np.bitwise_xor(bits.view(np.uint32)[_HIGH_WORD::2], _SIGN32)
    keys |= np.multiply(excluded, _UINT32_MAX, dtype=np.uint32)
    return keys


def _selected_tokens_exact_k(bits: np.ndarray, special: np.ndarray, batch: int,
                             seq_len: int, p: float) -> np.ndarray | None:
    """exact_k over tokens: bool (B*L,), True where selected; None on a boundary tie of h
    (the caller recomputes exactly). `bits` and `special` are flat (B*L,)."""
    keys = _high_keys(bits, special)
    k = _row_k(special, batch, seq_len, p)
    ranked = _row_sorted(keys, batch, seq_len)
    row_start = _flat_positions(batch, seq_len)[2]
    kth = ranked.take(row_start + k - 1, mode="clip")  # k = 0: any value, overridden below
    # The (k+1)-th smallest (the next row's first, or the last entry, where k = L: a
    # spurious tie, recomputed exactly like a real one).
    if (kth == ranked.take(row_start + k, mode="clip")).any():
        return None
    selected = keys.reshape(batch, seq_len) <= kth.reshape(-1, 1)
    if not k.all():
        selected[k == 0] = False
    return selected.reshape(-1)


def _word_starts_index(ids: np.ndarray, special: np.ndarray, batch: int, seq_len: int,
                       word_starts: np.ndarray, word_ends: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """`(first, start)` of flat (B*L,) `ids`: bool, True where a word (or a special
    token) begins; int64, the flat index where the word of each position begins
    (non-decreasing: on the flat batch the rows follow each other, and every row's first
    position begins a word, so a running maximum never reaches back into the row before).
    """
    first = word_starts.take(ids)
    first |= special  # a special token is a word of its own
    after = special if word_ends is None else special | word_ends.take(ids)
    first[1:] |= after[:-1]
    first[::seq_len] = True
    start = np.multiply(_flat_positions(batch, seq_len)[0], first)  # 0 where not first
    np.maximum.accumulate(start, out=start)
    return first, start


def _selected_words_exact_k(bits: np.ndarray, special: np.ndarray, first: np.ndarray,
                            start: np.ndarray, batch: int, seq_len: int,
                            p: float) -> np.ndarray | None:
    """exact_k over whole words: int64, the flat positions of the selected tokens (None:
    see `_selected_words_exact_k_packed`).

    Words are taken in the order of `(h of the first position, first position)` while the
    count of their tokens stays `<= k`. Give every token its word's h and rank the tokens
    by it (a vectorized 32-bit sort): a word's tokens are then consecutive, in word order,
    so a word is taken exactly when its last token's rank is below k: the words whose h
    is below `h_k`, the k-th smallest, and the word of `h_k` itself when the (k+1)-th is
    larger (it ends at rank k - 1). Two words sharing `h_k` (a tie the order by position
    would break; about 1e-6 of rows) are resolved by `_selected_words_exact_k_packed`.
    """
    k = _row_k(special, batch, seq_len, p)
    # h at maskable word starts (`first <= special`: not one), else all ones; then each
    # token's word's h (all ones: special).
    start_keys = _high_keys(bits, first <= special)
    word_keys = start_keys.take(start)
    ranked = _row_sorted(word_keys, batch, seq_len)
    row_start = _flat_positions(batch, seq_len)[2]
    # The k-th smallest (the row's smallest where k = 0) and the (k+1)-th (the next row's
    # first where k = L: a spurious tie, resolved exactly like a real one).
    kth = ranked.take(row_start + np.maximum(k - 1, 0))
    after = ranked.take(row_start + k, mode="clip")
    # Exactly one word start with h = kth in each row (>= 1 each, B in all): no tie, and
    # kth is no sentinel (which every position that does not start a word holds).
    if (np.count_nonzero(start_keys.reshape(batch, seq_len) == kth.reshape(-1, 1)) != batch
            or (math.floor(p * seq_len + 0.5) == seq_len and (k == seq_len).any())):
        return _selected_words_exact_k_packed(bits, special, first, start, batch, seq_len, p)
    # Taken: h below kth, and the word of kth if it ends at rank k - 1; rows with k = 0:
    # none (kth is no sentinel, so kth + 1 does not wrap).
    bound = kth + (after != kth)
    if not k.all():
        bound[k == 0] = 0
    return (word_keys.reshape(batch, seq_len) < bound.reshape(-1, 1)).reshape(-1).nonzero()[0]


def _selected_words_exact_k_packed(bits: np.ndarray, special: np.ndarray, first: np.ndarray,
                                   start: np.ndarray, batch: int, seq_len: int,
                                   p: float) -> np.ndarray | None:
    """`_selected_words_exact_k` ordering words by `(h, position)` exactly, ties of h
    included; None for rows longer than `_MAX_PACKED_LEN` (the torch implementation).

    At most `k <= k_cap = exact_k(L, p)` words are taken (each has >= 1 token), so the
    `k_cap` first words of each row in that order suffice. Each maskable word start gets
    the int64 key `(h << 32) | (position in the row << 16) | length` (unique within a row,
    so ordered as `(h, position)`; the length counts the positions whose word begins
    there, from the non-decreasing `start`); the `k_cap` smallest keys of a row are
    partially sorted out and sorted, their lengths summed in that order, and the taken
    words expanded into their positions.
    """
    k_cap = math.floor(p * seq_len + 0.5)
    if seq_len > _MAX_PACKED_LEN:
        return None
    if k_cap == 0:
        return np.empty(0, np.int64)
    k = _row_k(special, batch, seq_len, p)
    # As uint64 in the same order (sign bit flipped), with the sentinel 2**64 - 1 where
    # not a maskable word start (arithmetic: a select on an unpredictable mask costs
    # several times more). Flipped back, a sentinel is INT64_MAX: its length field
    # 0xFFFF exceeds every k, so it is never taken.
    keys = np.bitwise_xor(bits.view(_U64), _SIGN64)
    keys &= _U64(_HIGH32 & _M64)
    keys |= _flat_positions(batch, seq_len)[1]
    keys |= np.bincount(start, minlength=batch * seq_len).view(_U64)
    keys |= np.multiply(first <= special, _UINT64_MAX, dtype=_U64)
    keys = keys.reshape(batch, seq_len)
    if k_cap < seq_len:
        keys.partition(k_cap - 1, axis=1)
    top = keys[:, :k_cap] ^ _SIGN64
    top = top.view(np.int64)
    top.sort(axis=1)
    lengths = top & 0xFFFF
    taken = np.add.accumulate(lengths, axis=1) <= k.reshape(-1, 1)
    firsts = (top >> 16) & _POSITION_MASK
    firsts += _flat_positions(batch, seq_len)[2].reshape(-1, 1)
    firsts, lengths = firsts[taken], lengths[taken]
    # Each taken word's positions: firsts[i] + 0 .. lengths[i]-1, in one pass.
    ends = np.add.accumulate(lengths)
    return np.arange(ends[-1] if len(ends) else 0) + np.repeat(firsts - ends + lengths, lengths)


def mask_numpy(ids: np.ndarray, row_index: np.ndarray, *, key: int, gamma: int,
               multipliers: tuple[int, int], vocab: MaskingVocab, mlm_probability: float,
               mask_replace_prob: float, random_replace_prob: float, selection: str,
               random_scale: tuple[int, int] | None, word_starts: np.ndarray | None,
               word_ends: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """`keyed.mask_tokens` on numpy arrays (its arguments checked there).

    Args:
        ids: int64 (B, L) token ids, B * L > 0; `row_index`: int64 (B,) global row ids.
        key: `masking_key(seed, epoch)`; `gamma`, `multipliers`: SplitMix64's increment
            and finalizer multipliers (`keyed`).
        vocab: the special and ordinary ids; the probabilities and `selection`: as
            `mask_tokens`.
        random_scale: `(M, S)` of the random-id formula (`keyed._random_id_scale`);
            None when `random_replace_prob` is 0.
        word_starts, word_ends: bool (V,) tables (whole words), or None (tokens).

    Returns:
        `(corrupted, labels)`, int64 (B, L) each; None where this implementation defers
        to the exact 64-bit one (an exact_k tie of h at the k-th position).
    """
    p = mlm_probability
    batch, seq_len = ids.shape
    bits = draws(row_index, seq_len, key, gamma, multipliers).reshape(-1)
    ids = ids.reshape(-1)
    special = ids < vocab.prefix if vocab.prefix is not None else vocab.special.take(ids)
    threshold = (int(p * 2.0**32) - (1 << 31)) << 32  # h < -2**31 + t(p), in bits
    if word_starts is None and selection == "bernoulli":
        where = (~special if p >= 1.0 else np.greater(bits < threshold, special)).nonzero()[0]
    elif word_starts is None:
        selected = _selected_tokens_exact_k(bits, special, batch, seq_len, p)
        where = None if selected is None else selected.nonzero()[0]
    else:
        first, start = _word_starts_index(ids, special, batch, seq_len, word_starts,
                                          word_ends)
        if selection == "exact_k":
            where = _selected_words_exact_k(bits, special, first, start, batch, seq_len, p)
        else:
            chosen = np.ones_like(special) if p >= 1.0 else (bits < threshold)
            # `a > b` on bools: a & ~b
            where = np.greater(chosen.take(start), special).nonzero()[0]
    if where is None:
        return None
    return _replace(ids, bits, where, vocab, mask_replace_prob, random_replace_prob,
                    random_scale, batch, seq_len)


def _replace(ids: np.ndarray, bits: np.ndarray, where: np.ndarray, vocab: MaskingVocab,
             mask_replace_prob: float, random_replace_prob: float,
             random_scale: tuple[int, int] | None, batch: int,
             seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The 80/10/10 replacement at the selected flat positions `where` (int64), read from
    their draws alone: `(corrupted, labels)`, int64 (B, L) each."""
    original = ids.take(where)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels.put(where, original)
    corrupted = ids.copy()
    # c = bits mod 2**32: [0, t(pr)) -> random id, [t(pr), t(pr + pm)) -> [MASK], the rest
    # unchanged (every selected position is written, most with its new id).
    low = bits.take(where)
    low &= _LOW32
    kept = np.where(low < int((mask_replace_prob + random_replace_prob) * 2.0**32),
                    vocab.mask_id, original)
    if random_scale is None:
        corrupted.put(where, kept)
    else:
        multiplier, shift = random_scale
        drawn = low * multiplier
        drawn >>= shift
        if vocab.prefix is not None:
            drawn += vocab.prefix
        else:
            # Positions with c >= t(pr) hold values outside [0, m) (never used): clipped.
            drawn = vocab.normal.take(drawn, mode="clip")
        corrupted.put(where, np.where(low < int(random_replace_prob * 2.0**32), drawn, kept))
    return corrupted.reshape(batch, seq_len), labels.reshape(batch, seq_len)
