"""Masked-language-model corruption as pure, vectorized tensor ops with keyed randomness.

The corruption follows Devlin et al. 2019 (BERT), §3.1: maskable tokens (every id that is
not one of the tokenizer's special ids, `SpecialIds.all_special_ids`) are selected for
prediction at a rate `mlm_probability`; a selected token is replaced by a random ordinary
token with probability `random_replace_prob`, by [MASK] with probability
`mask_replace_prob`, and otherwise left unchanged (80/10/10 by default). The special ids
and the [MASK] id are the tokenizer's (`special_ids`): 0-4 for the SentencePiece
tokenizers this pipeline trains, [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 for a
BERT vocabulary (`masking.vocab`).

Selection (`selection`, and whole words when `word_starts` is given)
--------------------------------------------------------------------
- `bernoulli`: each maskable token independently (as Hugging Face
  `DataCollatorForLanguageModeling`); the count per row varies.
- `exact_k`: exactly `k = floor(mlm_probability * n + 0.5)` distinct maskable positions of
  a row with `n` maskable tokens (round half up; Python's `round` would round half to
  even), uniform among the `n choose k` subsets. Rows with equal `n` (e.g. full packed
  rows with the same number of [SEP]) predict equally many tokens: static shapes
  (not so with whole words, below).
- whole words (Devlin et al. 2019, google-research/bert `create_pretraining_data.py`,
  "Whole Word Masking"): a word is a maskable position that begins one (its id has
  `word_starts[id]`, or it is position 0, or the previous position is not maskable or
  holds an id with `word_ends[id]`) plus the maskable positions after it that do not.
  The tokenizer says where words begin and end (`Tokenizer.word_starts`,
  `Tokenizer.word_ends`: SentencePiece's "▁" prefix, WordPiece's "##" continuation,
  byte-level BPE's encoded space). Whole words are selected and every
  token of a selected word is predicted. With `bernoulli` each word is selected with
  probability `mlm_probability` (so the expected share of selected *tokens* is
  `mlm_probability`); with `exact_k` words are taken in keyed random order while their
  cumulative token count stays `<= k` (the first word that would exceed `k` stops the
  selection; google-research skips it and tries the next, which is sequential), so at
  most `k` tokens are selected. The 80/10/10 decision stays per token, as in
  google-research (its loop decides per index of the selected word).

Keyed randomness
----------------
No random generator state is used. Every random number is a counter-based hash
(Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", the idea behind
Philox) of `(seed, epoch, row index, position)`, one 64-bit draw per token:

    key     = mix64(mix64(seed) + (epoch + 1) * GAMMA)          (Python ints, mod 2**64)
    counter = (row << 20) | position
    bits    = mix64(key + counter * GAMMA)                       (int64 tensor ops)

`mix64` is the SplitMix64 output finalizer and `GAMMA = 0x9E3779B97F4A7C15` its
increment (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators";
constants from Vigna's reference `splitmix64.c`, https://prng.di.unimi.it/splitmix64.c,
which is Stafford's "Mix13" variant of the MurmurHash3 finalizer):

    z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >>> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >>> 31)

`bits` is therefore exactly the `counter`-th output of a SplitMix64 generator seeded with
`key`. The counter is injective for `0 <= row < 2**44` and `position < 2**20`, and `mix64`
is a bijection, so distinct (row, position) never share a draw within a key.

Torch has no unsigned 64-bit shifts on every device, so the hash runs on int64: `>>` on
int64 is an *arithmetic* shift, so every shift is followed by a mask of the low `64 - s`
bits to make it logical; int64 multiplication wraps modulo 2**64 on CPU and CUDA (two's
complement; `tests/unit/test_masking.py` checks CPU against a pure-Python reference and,
marked `gpu`, CUDA against CPU).

The draw is split in two halves used for independent decisions. With `s(x)` the signed
reading of 64 bits, `h = floor(s(bits) / 2**32)` (the signed high half, uniform on
[-2**31, 2**31)) drives selection and `c = bits mod 2**32` (the low half, uniform on
[0, 2**32) and independent of `h`) drives replacement; `t(q) = floor(q * 2**32)`:

- `bernoulli` selects a token iff `h < -2**31 + t(mlm_probability)`; `exact_k` selects the
  `k` maskable positions with the smallest `(h, position)`; whole words use `h` of the
  word's first position, compared the same way (`bernoulli`) or ordered by
  `(h, first position)` (`exact_k`).
- a selected token becomes a random ordinary id iff `c < t(random_replace_prob)`, else
  [MASK] iff `c < t(random_replace_prob + mask_replace_prob)` (a sum of 1 is always
  true), else stays. The random id is `normal[(c * M) >> S]`, the `((c * M) >> S)`-th
  ordinary id in ascending order (`NUM_SPECIAL + ((c * M) >> S)` when the special ids
  are 0 .. NUM_SPECIAL-1), with `m` = the number of ordinary ids, `t = t(random_replace_prob)`,
  `S = 63 - bit_length(m)` and `M = floor(m * 2**S / t)`: a fixed-point
  `floor(c * m / t)` (no int64 overflow, always below m) of `c`, which is uniform on the
  `t` values of its bucket. Each id then has probability within a relative
  `m / t + 2**(32 - S)` of `1 / m` (below 1e-4 for m = 32000, random_replace_prob = 0.1),
  provided `t >= m`.

Probabilities are thus resolved to 2**-32 (selection needs about 24 bits); one hash per
token instead of one per decision is what makes the function fast (`benchmarks/
bench_masking.py`). On CPU tensors the function runs in numpy (`keyed_numpy`, about half
the per-op cost of torch at training batch sizes), elsewhere as the torch ops of this
module; both give the same bits. Consequences: a row receives the same mask after a resume, in any
batch composition and on any device; a new epoch gives a new mask; evaluation masks with
a fixed `(seed, epoch=0)` so its positions never move.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import torch
from torch import Tensor

from mlm_pipeline.config import IGNORE_INDEX, MaskingConfig, SpecialIds
from mlm_pipeline.masking import keyed_numpy
from mlm_pipeline.masking.vocab import MaskingVocab, masking_vocab

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1
#: SplitMix64 increment, 2**64 / golden ratio (odd), from Vigna's `splitmix64.c`.
GAMMA = 0x9E3779B97F4A7C15
#: SplitMix64 finalizer multipliers (Stafford's Mix13), from Vigna's `splitmix64.c`.
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB
_POSITION_BITS = 20
#: Longest supported row: positions must fit in the counter's position field.
MAX_SEQ_LEN = 1 << _POSITION_BITS
#: Row ids must lie in [0, MAX_ROWS): the counter's row field.
MAX_ROWS = 1 << (64 - _POSITION_BITS)
#: Version of the algorithm in the module docstring; a checkpoint whose masker state
#: carries another version is refused (its masks would not be reproduced).
MASKING_ALGORITHM = 2
SELECTIONS = ("bernoulli", "exact_k")
#: The defaults of `mask_tokens`' keyword arguments: the config's, defined once there.
_DEFAULTS = MaskingConfig()
_LOW32 = (1 << 32) - 1
_INT64_MAX = (1 << 63) - 1


def _signed(x: int) -> int:
    """Reinterpret the low 64 bits of a Python int as a signed int64 value."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_HIGH32 = _signed(_M64 ^ _LOW32)  # as int64: keeps the high half of a draw


def mix64_int(z: int) -> int:
    """SplitMix64 finalizer of the low 64 bits of a Python int (reference semantics,
    unsigned 64-bit): the mixed value in [0, 2**64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX_MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MIX_MUL2) & _M64
    return z ^ (z >> 31)


def mix64_(z: Tensor) -> Tensor:
    """SplitMix64 finalizer applied in place to `z`, an int64 tensor of any shape (bits
    read as uint64); returns `z`. Logical right shifts are arithmetic shifts then a mask;
    the multiplications rely on int64 wrapping modulo 2**64 (module docstring)."""
    tmp = None
    for shift, mul in ((30, _signed(_MIX_MUL1)), (27, _signed(_MIX_MUL2)), (31, None)):
        # One scratch buffer, allocated by the first shift (saves a dispatch).
        tmp = z >> shift if tmp is None else torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)  # arithmetic -> logical shift
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)
    return z


@functools.lru_cache(maxsize=256)
def masking_key(seed: int, epoch: int) -> int:
    """The 64-bit key in [0, 2**64) of a (seed, epoch) pair, both taken modulo 2**64:
    `mix64(mix64(seed) + (epoch + 1) * GAMMA)`."""
    return mix64_int(mix64_int(seed) + (epoch + 1) * GAMMA)


def _t32(prob: float) -> int:
    """`t(q) = floor(q * 2**32)` (exact: a power-of-two scaling of a float64)."""
    return int(prob * 2.0**32)


def exact_k(n: int, mlm_probability: float) -> int:
    """Tokens `exact_k` selects in a row of `n` maskable tokens at rate p =
    `mlm_probability`: `k = floor(p * n + 0.5)`, in [0, n] for p in [0, 1] (round half up
    in float64; Python's `round` rounds half to even)."""
    return math.floor(mlm_probability * n + 0.5)


@functools.lru_cache(maxsize=64)
def _random_id_scale(m: int, t: int) -> tuple[int, int]:
    """`(M, S)` with `(c * M) >> S` = floor(c * m / t) in fixed point, for c in [0, t)
    (module docstring: no int64 overflow, every result below m)."""
    shift = 63 - m.bit_length()
    return (m << shift) // t, shift


@functools.lru_cache(maxsize=64)
def _position_term(seq_len: int, key: int, device: torch.device) -> Tensor:
    """The (1, L) int64 term `key + position * GAMMA`, cached per (L, key, device)."""
    # Built outside inference mode so the cached tensor is usable in every mode.
    with torch.inference_mode(False):
        pos = torch.arange(seq_len, device=device, dtype=torch.int64)
        return pos.mul_(_signed(GAMMA)).add_(_signed(key)).view(1, -1)


@functools.lru_cache(maxsize=32)
def _positions(seq_len: int, device: torch.device) -> Tensor:
    """The (1, L) int64 positions 0..L-1, cached per (L, device)."""
    with torch.inference_mode(False):
        return torch.arange(seq_len, device=device, dtype=torch.int64).view(1, -1)


def _draws(seq_len: int, row_index: Tensor, key: int) -> Tensor:
    """`bits` of the module docstring: int64 (B, L) for rows `row_index` (int64 (B,))."""
    # key + ((row << 20) | l) * GAMMA = (key + l * GAMMA) + row * (GAMMA << 20) (mod 2**64):
    # the cached position term plus the row term in one `add` (its integer `alpha`
    # product wraps like `mul`), then mixed in place.
    term = _position_term(seq_len, key, row_index.device)
    return mix64_(torch.add(term, row_index.view(-1, 1),
                            alpha=_signed(GAMMA << _POSITION_BITS)))


@functools.lru_cache(maxsize=32)
def _exact_k_table(seq_len: int, mlm_probability: float, device: torch.device) -> Tensor:
    """int64 (L + 1,): `exact_k(n, p)` for n = 0..L, cached per (L, p, device)."""
    with torch.inference_mode(False):
        k = [exact_k(n, mlm_probability) for n in range(seq_len + 1)]
        return torch.tensor(k, dtype=torch.int64, device=device)


def _exact_k_tensor(special: Tensor, mlm_probability: float) -> Tensor:
    """`exact_k` per row: int64 (B, 1) from the (B, L) bool special-position mask."""
    table = _exact_k_table(special.size(1), mlm_probability, special.device)
    return table[special.size(1) - special.sum(1, keepdim=True)]


def _unselected_tokens(bits: Tensor, special: Tensor, p: float, selection: str) -> Tensor:
    """Bool (B, L), True where a token is *not* selected (specials included)."""
    if selection == "bernoulli":
        if p >= 1.0:
            return special.clone()
        # s(bits) < (-2**31 + t(p)) * 2**32  <=>  h < -2**31 + t(p)
        return torch.ge(bits, (_t32(p) - (1 << 31)) << 32).logical_or_(special)
    seq_len = bits.size(1)
    k_cap = exact_k(seq_len, p)  # k <= k_cap for every row: a static topk size
    if k_cap == 0:
        return torch.ones_like(special)
    # Score (h, position) as one int64: the high half of `bits`, the position in the low
    # half; unique within a row, so "score <= k-th smallest" selects exactly k positions.
    score = (bits & _HIGH32).bitwise_or_(_positions(seq_len, bits.device))
    score.masked_fill_(special, _INT64_MAX)
    k = _exact_k_tensor(special, p)
    kth = score.topk(k_cap, dim=1, largest=False).values.gather(1, (k - 1).clamp_(min=0))
    return torch.gt(score, kth).logical_or_(k == 0)


def _unselected_words(
    bits: Tensor, ids: Tensor, special: Tensor, word_starts: Tensor,
    word_ends: Tensor | None, p: float, selection: str,
) -> Tensor:
    """Like `_unselected_tokens`, selecting whole words (see the module docstring)."""
    seq_len = bits.size(1)
    positions = _positions(seq_len, bits.device)
    first = torch.take(word_starts, ids)
    after = special[:, :-1]
    if word_ends is not None:
        after = after | torch.take(word_ends, ids[:, :-1])
    first[:, 1:].logical_or_(after)
    first[:, 0] = True
    # The first position of the word at each position (for maskable positions).
    word_start = first.to(torch.int64).mul_(positions).cummax(1).values
    if selection == "bernoulli":
        if p >= 1.0:
            return special.clone()
        threshold = (_t32(p) - (1 << 31)) << 32
        return torch.ge(bits.gather(1, word_start), threshold).logical_or_(special)
    k_cap = exact_k(seq_len, p)
    if k_cap == 0:
        return torch.ones_like(special)
    maskable = ~special
    score = (bits & _HIGH32).bitwise_or_(positions)
    score = torch.where(first.logical_and_(maskable), score, _INT64_MAX)  # words' first tokens
    lengths = torch.zeros_like(bits).scatter_add_(1, word_start, maskable.to(torch.int64))
    # At most k <= k_cap words are taken (each has >= 1 token): the k_cap first words in
    # keyed order suffice; `cum` is the token count of each prefix of that order.
    first_scores, order = score.topk(k_cap, dim=1, largest=False)
    cum = lengths.gather(1, order).cumsum_(1)
    taken = (cum <= _exact_k_tensor(special, p)).sum(1, keepdim=True)
    last = first_scores.gather(1, (taken - 1).clamp_(min=0))
    unselected_first = torch.gt(score, last).logical_or_(taken == 0)
    return unselected_first.gather(1, word_start).logical_or_(special)


@functools.lru_cache(maxsize=64)
def _settings(vocab_size: int, special_ids: SpecialIds | None, p: float, pm: float,
              pr: float, selection: str) -> tuple[MaskingVocab, float, tuple[int, int] | None]:
    """`(vocab, pm + pr, (M, S) of the random-id formula or None when pr = 0)` of checked
    settings (`mask_tokens`' ValueErrors about them), cached: the same at every call."""
    vocab = masking_vocab(vocab_size, special_ids)
    for name, value in (("mlm_probability", p), ("mask_replace_prob", pm),
                        ("random_replace_prob", pr)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"masking: {name} = {value!r} must be in [0, 1]")
    change_prob = pm + pr
    if change_prob > 1.0 + 1e-9:
        raise ValueError(
            f"masking: mask_replace_prob + random_replace_prob = {change_prob:g} must be <= 1"
        )
    if selection not in SELECTIONS:
        raise ValueError(f"masking: selection {selection!r} must be one of {SELECTIONS}")
    scale = _random_id_scale(vocab.num_normal, _t32(pr)) if pr > 0.0 else None
    return vocab, change_prob, scale


def mask_tokens(
    input_ids: Tensor,
    *,
    vocab_size: int,
    row_index: Tensor | None = None,
    seed: int = _DEFAULTS.seed,
    epoch: int = 0,
    mlm_probability: float = _DEFAULTS.mlm_probability,
    mask_replace_prob: float = _DEFAULTS.mask_replace_prob,
    random_replace_prob: float = _DEFAULTS.random_replace_prob,
    selection: str = _DEFAULTS.selection,
    word_starts: Tensor | None = None,
    word_ends: Tensor | None = None,
    special_ids: SpecialIds | None = None,
) -> tuple[Tensor, Tensor]:
    """Corrupt a batch for masked-language modelling (Devlin et al. 2019, §3.1: 80/10/10).

    Ids outside `special_ids.all_special_ids` are maskable (special tokens and [PAD] never
    are); tokens (or whole words, with `word_starts`) are selected at `mlm_probability` as
    `selection` says; a random replacement is uniform on the `m` ordinary ids of
    `[0, vocab_size)` (it may equal the original, probability 1 / m). Every choice depends
    only on (seed, epoch, row_index[b], position) and, for `exact_k` and whole words, the
    row's ids (module docstring). CPU tensors are masked in numpy (`keyed_numpy`), others
    with torch ops: the same result.

    Args:
        input_ids: token ids (B, L), int64, int32 or uint16, on any device; not modified.
        vocab_size: number of ids in the vocabulary, the special tokens included.
        row_index: int64 (B,) global row ids in [0, MAX_ROWS = 2**44), on any device;
            defaults to `arange(B)`. The same row id gets the same mask wherever it sits
            in a batch.
        seed: masking seed (taken modulo 2**64).
        epoch: epoch number; a new epoch gives an independent mask.
        mlm_probability: share of maskable tokens selected for prediction.
        mask_replace_prob: share of selected tokens replaced by [MASK].
        random_replace_prob: share of selected tokens replaced by a random ordinary id.
        selection: `bernoulli` (independent per token or word) or `exact_k`
            (`floor(mlm_probability * n + 0.5)` tokens of a row with n maskable tokens;
            at most that many with whole words).
        word_starts: bool (vocab_size,), True where an id begins a word (e.g.
            `Tokenizer.word_starts()`, as a tensor), on any device; given, whole words
            are selected. None selects tokens.
        word_ends: bool (vocab_size,), True where a word ends with an id, so that the
            next position begins one (`Tokenizer.word_ends()`: byte-level BPE pieces
            ending in whitespace); None: only special tokens end words. Used with
            `word_starts` only.
        special_ids: the tokenizer's special ids ([MASK] and the never-selected ids);
            None: `SENTENCEPIECE_SPECIAL_IDS` (0-4, the SentencePiece tokenizers this
            pipeline trains).

    Returns:
        `(input_ids, labels)`, both int64 (B, L) on the device of `input_ids`: the corrupted
        ids, and the original ids at selected positions with `IGNORE_INDEX` (-100) elsewhere.

    Raises:
        TypeError: `input_ids` is not an integer tensor.
        ValueError: `input_ids` is not 2-D, L exceeds `MAX_SEQ_LEN`, `row_index` is not
            shaped (B,), a special id is not below `vocab_size` or no ordinary id is left,
            a probability lies outside [0, 1], `mask_replace_prob + random_replace_prob >
            1`, `selection` is unknown, or `word_starts` / `word_ends` is not a bool
            tensor of shape (vocab_size,).
    """
    dtype = input_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"masking: input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"masking: input_ids must be 2-D (B, L), got shape "
                         f"{tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"masking: seq_len {seq_len} exceeds the supported {MAX_SEQ_LEN}")
    vocab, change_prob, scale = _settings(vocab_size, special_ids, mlm_probability,
                                          mask_replace_prob, random_replace_prob, selection)
    for name, table in (("word_starts", word_starts), ("word_ends", word_ends)):
        if table is not None and (table.dtype != torch.bool or table.shape != (vocab_size,)):
            raise ValueError(
                f"masking: {name} must be a bool tensor of shape ({vocab_size},), got "
                f"{table.dtype} {tuple(table.shape)}"
            )
    if word_starts is None:
        word_ends = None
    if row_index is not None and row_index.shape != (batch,):
        raise ValueError(f"masking: row_index must have shape ({batch},), got "
                         f"{tuple(row_index.shape)}")
    if batch * seq_len == 0:
        ids = input_ids.to(torch.int64)
        return ids.clone(), torch.full_like(ids, IGNORE_INDEX)
    key = masking_key(seed, epoch)
    if input_ids.is_cpu:
        # Python-side checks skip a conversion each (this function is dispatch-bound at
        # training batch sizes); the outputs are always new arrays.
        ids_np = input_ids.numpy()
        if dtype != torch.int64:
            ids_np = ids_np.astype(np.int64)
        rows_np = (np.arange(batch, dtype=np.int64) if row_index is None
                   else row_index.cpu().numpy().astype(np.int64, copy=False))
        done = keyed_numpy.mask_numpy(
            ids_np, rows_np, key=key, gamma=GAMMA, multipliers=(_MIX_MUL1, _MIX_MUL2),
            vocab=vocab, mlm_probability=mlm_probability,
            mask_replace_prob=mask_replace_prob, random_replace_prob=random_replace_prob,
            selection=selection, random_scale=scale,
            word_starts=None if word_starts is None else word_starts.cpu().numpy(),
            word_ends=None if word_ends is None else word_ends.cpu().numpy())
        if done is not None:
            return torch.from_numpy(done[0]), torch.from_numpy(done[1])
    device = input_ids.device
    ids = input_ids if dtype == torch.int64 else input_ids.to(torch.int64)
    if row_index is None:
        row_index = torch.arange(batch, device=device)
    elif row_index.device != device or row_index.dtype != torch.int64:
        row_index = row_index.to(device=device, dtype=torch.int64)
    return _mask_torch(ids, row_index, key, vocab, mlm_probability, change_prob,
                       random_replace_prob, selection, scale, word_starts, word_ends)


def _mask_torch(ids: Tensor, row_index: Tensor, key: int, vocab: MaskingVocab,
                p: float, change_prob: float, random_replace_prob: float, selection: str,
                scale: tuple[int, int] | None, word_starts: Tensor | None,
                word_ends: Tensor | None) -> tuple[Tensor, Tensor]:
    """`mask_tokens` as torch ops on `ids`' device (arguments checked there): int64 (B, L)
    ids, (B,) row ids; `scale`: `_random_id_scale`'s `(M, S)`, None when pr = 0."""
    device = ids.device
    bits = _draws(ids.size(1), row_index, key)
    if vocab.prefix is not None:
        special = ids < vocab.prefix
    else:
        special = torch.take(vocab.tables_on(device)[0], ids)
    if word_starts is None:
        unselected = _unselected_tokens(bits, special, p, selection)
    else:
        unselected = _unselected_words(
            bits, ids, special, word_starts.to(device),
            None if word_ends is None else word_ends.to(device), p, selection,
        )
    labels = torch.where(unselected, IGNORE_INDEX, ids)

    # c = bits mod 2**32: [0, t(pr)) -> random id, [t(pr), t(pr + pm)) -> [MASK], the rest
    # unchanged. `a > b` on bools is `a & ~b` in one op.
    low = bits & _LOW32
    changed = torch.gt(low < _t32(change_prob), unselected)
    if scale is None:
        return ids.masked_fill(changed, vocab.mask_id), labels
    multiplier, shift = scale
    drawn = torch.mul(low, multiplier).bitwise_right_shift_(shift)
    if vocab.prefix is not None:
        drawn.add_(vocab.prefix)
    else:
        # Positions with c >= t(pr) hold values outside [0, m) (never used): clamped.
        drawn = torch.take(vocab.tables_on(device)[1], drawn.clamp_(0, vocab.num_normal - 1))
    # `where` rather than `masked_fill`: the faster of the two on CPU (both branch).
    replacement = torch.where(low < _t32(random_replace_prob), drawn, vocab.mask_id)
    return torch.where(changed, replacement, ids), labels
