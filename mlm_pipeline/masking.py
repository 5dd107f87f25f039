"""Masked-language-model corruption as pure, vectorized tensor ops with keyed randomness.

The corruption follows Devlin et al. 2019 (BERT), §3.1: each maskable token is selected
for prediction with probability `mlm_probability`; a selected token is replaced by [MASK]
with probability `mask_replace_prob`, by a random ordinary token with probability
`random_replace_prob`, and otherwise left unchanged (80/10/10 by default). Selection is an
independent Bernoulli draw per token (as in Hugging Face `DataCollatorForLanguageModeling`),
so the number of selected tokens per row varies.

Keyed randomness
----------------
No random generator state is used. Every random number is a counter-based hash
(Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", the idea behind
Philox) of `(seed, epoch, row index, position, stream)`:

    key     = mix64(mix64(seed) + (epoch + 1) * GAMMA)          (Python ints, mod 2**64)
    counter = (row << 22) | (position << 2) | stream             (stream 0, 1, 2)
    bits    = mix64(key + counter * GAMMA)                       (int64 tensor ops)

`mix64` is the SplitMix64 output finalizer and `GAMMA = 0x9E3779B97F4A7C15` its
increment (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators";
constants from Vigna's reference `splitmix64.c`, https://prng.di.unimi.it/splitmix64.c,
which is Stafford's "Mix13" variant of the MurmurHash3 finalizer):

    z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >>> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >>> 31)

`bits` is therefore exactly the `counter`-th output of a SplitMix64 generator seeded with
`key`. The counter is injective for `0 <= row < 2**42` and `position < 2**20`, and `mix64`
is a bijection, so distinct (row, position, stream) never share a draw within a key.

Torch has no unsigned 64-bit arithmetic on every device, so the hash runs on int64 with
two precautions: `>>` on int64 is an *arithmetic* shift, so every shift is followed by a
mask of the low `64 - s` bits to make it logical; and int64 multiplication wraps modulo
2**64 in practice on CPU and CUDA (two's complement; `tests/unit/test_masking.py` checks
CPU against a pure-Python reference and, marked `gpu`, CUDA against CPU). Thresholds are
compared on the signed value, which is uniform on [-2**63, 2**63).

With `s(x)` the signed reading of 64 bits and `T(q) = -2**63 + floor(q * 2**64)`, token
(row, position) with a maskable id is selected iff `s(bits_0) < T(mlm_probability)`; a
selected token becomes [MASK] iff `s(bits_1) < T(mask_replace_prob)`, else a random id iff
`s(bits_1) < T(mask_replace_prob + random_replace_prob)` (a probability of 1 is always
true); the random id is `NUM_SPECIAL + s(bits_2) mod (vocab_size - NUM_SPECIAL)` (floored
modulo, uniform up to a bias of vocab_size / 2**64).

Consequences: a row receives the same mask after a resume, in any batch composition and
on any device; a new epoch gives a new mask; evaluation masks with a fixed
`(seed, epoch=0)` so its positions never move. The three streams are independent draws:
stream 0 selects, stream 1 picks [MASK] / random / unchanged, stream 2 is the random id.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from mlm_pipeline.config import MASK_ID, NUM_SPECIAL, MaskingConfig
from mlm_pipeline.manifest import ShardManifest

if TYPE_CHECKING:
    from mlm_pipeline.train.data import PrecomputedShardDataset

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1
#: SplitMix64 increment, 2**64 / golden ratio (odd), from Vigna's `splitmix64.c`.
GAMMA = 0x9E3779B97F4A7C15
#: SplitMix64 finalizer multipliers (Stafford's Mix13), from Vigna's `splitmix64.c`.
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB
_POSITION_BITS = 20
_STREAM_BITS = 2
_NUM_STREAMS = 3
#: Longest supported row: positions must fit in the counter's position field.
MAX_SEQ_LEN = 1 << _POSITION_BITS
IGNORE_INDEX = -100


def _signed(x: int) -> int:
    """Reinterpret the low 64 bits of a Python int as a signed int64 value."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def mix64_int(z: int) -> int:
    """SplitMix64 finalizer on a Python int (reference semantics, unsigned 64-bit).

    Args:
        z: any int; only its low 64 bits are used.

    Returns:
        The mixed value in [0, 2**64).
    """
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX_MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MIX_MUL2) & _M64
    return z ^ (z >> 31)


def mix64_(z: Tensor) -> Tensor:
    """SplitMix64 finalizer applied in place to an int64 tensor (bits read as uint64).

    Logical right shifts are emulated by masking after torch's arithmetic shift; the
    multiplications rely on int64 wrapping modulo 2**64 (see module docstring).

    Args:
        z: int64 tensor of any shape; overwritten.

    Returns:
        `z`, now holding the mixed bits (int64, same shape).
    """
    tmp = None
    for shift, mul in ((30, _signed(_MIX_MUL1)), (27, _signed(_MIX_MUL2)), (31, None)):
        # One scratch buffer, allocated by the first shift (saves a dispatch).
        tmp = z >> shift if tmp is None else torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)  # arithmetic -> logical shift
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)
    return z


def masking_key(seed: int, epoch: int) -> int:
    """The 64-bit key of a (seed, epoch) pair: `mix64(mix64(seed) + (epoch + 1) * GAMMA)`.

    Args:
        seed: masking seed; taken modulo 2**64.
        epoch: epoch number; taken modulo 2**64.

    Returns:
        The key in [0, 2**64).
    """
    return mix64_int(mix64_int(seed) + (epoch + 1) * GAMMA)


def _threshold(prob: float) -> int:
    """Signed threshold T with P(u < T) = floor(prob * 2**64) / 2**64 for u uniform on int64.

    `prob * 2.0**64` is exact in float64 (a power-of-two scaling), so for prob in [0, 1)
    the probability is `prob` to within 2**-64.
    """
    return -(1 << 63) + int(prob * 2.0**64)


def _below(u: Tensor, prob: float, complement: bool = False) -> Tensor:
    """Bool tensor, True with probability `prob` per element of the uniform int64 `u`.

    With `complement`, the exact negation (probability `1 - prob`) in one pass.
    """
    if prob >= 1.0:
        return torch.full_like(u, not complement, dtype=torch.bool)
    threshold = _threshold(prob)
    return u >= threshold if complement else u < threshold


@functools.lru_cache(maxsize=32)
def _position_stream_term(seq_len: int, device: torch.device) -> Tensor:
    """The (3, 1, L) int64 term `((l << 2) | s) * GAMMA`, cached per (L, device)."""
    # Built outside inference mode so the cached tensor is usable in every mode.
    with torch.inference_mode(False):
        stream = torch.arange(_NUM_STREAMS, device=device, dtype=torch.int64).view(-1, 1, 1)
        pos = torch.arange(seq_len, device=device, dtype=torch.int64).view(1, 1, -1)
        return stream * _signed(GAMMA) + pos * _signed(GAMMA << _STREAM_BITS)


def special_tokens_mask(input_ids: Tensor) -> Tensor:
    """Where the special tokens ([PAD], [UNK], [CLS], [SEP], [MASK]) and padding are.

    Args:
        input_ids: integer ids, shape (B, L).

    Returns:
        Bool tensor (B, L), True at ids below `NUM_SPECIAL`.
    """
    return input_ids < NUM_SPECIAL


def _check_prob(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"masking: {name} = {value!r} must be in [0, 1]")


def mask_tokens(
    input_ids: Tensor,
    *,
    vocab_size: int,
    row_index: Tensor | None = None,
    seed: int = 0,
    epoch: int = 0,
    mlm_probability: float = 0.15,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[Tensor, Tensor]:
    """Corrupt a batch for masked-language modelling (Devlin et al. 2019, §3.1: 80/10/10).

    Ids `>= NUM_SPECIAL` are maskable; special tokens and [PAD] are never selected. Each
    maskable token is selected independently with probability `mlm_probability`. Of the
    selected, a share `mask_replace_prob` becomes [MASK], a share `random_replace_prob` a
    random ordinary id uniform on [NUM_SPECIAL, vocab_size) (which may equal the original
    id, probability 1 / (vocab_size - NUM_SPECIAL)), the rest stay unchanged. The random
    choices depend only on (seed, epoch, row_index[b], position); see the module docstring.

    Args:
        input_ids: token ids (B, L), int64, int32 or uint16, on any device; not modified.
        vocab_size: number of ids in the vocabulary, the special tokens included.
        row_index: int64 (B,) global row ids in [0, 2**42), on any device; defaults to
            `arange(B)`. The same row id gets the same mask wherever it sits in a batch.
        seed: masking seed (taken modulo 2**64).
        epoch: epoch number; a new epoch gives an independent mask.
        mlm_probability: share of maskable tokens selected for prediction.
        mask_replace_prob: share of selected tokens replaced by [MASK].
        random_replace_prob: share of selected tokens replaced by a random ordinary id.

    Returns:
        `(input_ids, labels)`, both int64 (B, L) on the device of `input_ids`: the corrupted
        ids, and the original ids at selected positions with -100 elsewhere.

    Raises:
        TypeError: `input_ids` is not an integer tensor.
        ValueError: `input_ids` is not 2-D, L exceeds `MAX_SEQ_LEN`, `row_index` is not
            shaped (B,), `vocab_size <= NUM_SPECIAL`, a probability lies outside [0, 1], or
            `mask_replace_prob + random_replace_prob > 1`.
    """
    dtype = input_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"masking: input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(
            f"masking: input_ids must be 2-D (B, L), got shape {tuple(input_ids.shape)}"
        )
    batch, seq_len = input_ids.shape
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"masking: seq_len {seq_len} exceeds the supported {MAX_SEQ_LEN}")
    if vocab_size <= NUM_SPECIAL:
        raise ValueError(f"masking: vocab_size {vocab_size} must exceed NUM_SPECIAL={NUM_SPECIAL}")
    _check_prob("mlm_probability", mlm_probability)
    _check_prob("mask_replace_prob", mask_replace_prob)
    _check_prob("random_replace_prob", random_replace_prob)
    if mask_replace_prob + random_replace_prob > 1.0 + 1e-9:
        raise ValueError(
            f"masking: mask_replace_prob + random_replace_prob = "
            f"{mask_replace_prob + random_replace_prob:g} must be <= 1"
        )
    device = input_ids.device
    if row_index is None:
        row_index = torch.arange(batch, device=device)
    elif row_index.shape != (batch,):
        raise ValueError(
            f"masking: row_index must have shape ({batch},), got {tuple(row_index.shape)}"
        )
    # Python-side dtype checks skip a dispatch each (this function is dispatch-bound at
    # training batch sizes); outputs below are always new tensors.
    ids = input_ids if input_ids.dtype == torch.int64 else input_ids.to(torch.int64)
    if row_index.device != device or row_index.dtype != torch.int64:
        row_index = row_index.to(device=device, dtype=torch.int64)

    # bits[s, b, l] = key + ((row << 22) | (l << 2) | s) * GAMMA (mod 2**64): the cached
    # (3, 1, L) position/stream term plus the key, plus row * (GAMMA << 22) broadcast over
    # (3, B, L) in one `add` (its integer `alpha` product wraps like `mul`), mixed in place.
    base = _position_stream_term(seq_len, device) + _signed(masking_key(seed, epoch))
    row_gamma = _signed(GAMMA << (_POSITION_BITS + _STREAM_BITS))
    bits = mix64_(torch.add(base, row_index.view(1, batch, 1), alpha=row_gamma))
    select_bits, choice_bits, random_bits = bits.unbind(0)

    # Each line is one or two (B, L) passes; `a > b` on bools is `a & ~b` in one op.
    unselected = _below(select_bits, mlm_probability, complement=True).logical_or_(
        ids < NUM_SPECIAL
    )
    labels = ids.masked_fill(unselected, IGNORE_INDEX)
    # Stream 1 in [0, pm) -> [MASK]; [pm, pm + pr) -> random id; the rest unchanged.
    # `remainder` of a uniform 64-bit value is uniform up to a bias of vocab_size / 2**64.
    changed = torch.gt(_below(choice_bits, mask_replace_prob + random_replace_prob), unselected)
    replacement = torch.remainder(random_bits, vocab_size - NUM_SPECIAL).add_(NUM_SPECIAL)
    replacement.masked_fill_(_below(choice_bits, mask_replace_prob), MASK_ID)
    corrupted = torch.where(changed, replacement, ids)
    return corrupted, labels


@runtime_checkable
class Masker(Protocol):
    """Turns a batch of token ids into (input_ids, labels); stateful for checkpoints."""

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """Corrupt `input_ids` (B, L) for rows `row_index` (B,) in `epoch`; see `mask_tokens`."""
        ...

    def state_dict(self) -> dict:
        """Everything needed to reproduce the masks after a resume."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        ...


class DynamicMasker:
    """Dynamic masking (RoBERTa, Liu et al. 2019, §4.1): a fresh mask per epoch, keyed.

    Stateless apart from the seed: the mask of a row is a pure function of
    (seed, epoch, row index), so a resume reproduces it without any RNG state.

    Args:
        cfg: masking probabilities.
        vocab_size: number of ids, the special tokens included.
        seed: masking seed.

    Raises:
        ValueError: `vocab_size <= NUM_SPECIAL`.
    """

    mode = "dynamic"

    def __init__(self, cfg: MaskingConfig, vocab_size: int, seed: int) -> None:
        if vocab_size <= NUM_SPECIAL:
            raise ValueError(
                f"masking: vocab_size {vocab_size} must exceed NUM_SPECIAL={NUM_SPECIAL}"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.seed = seed

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """Corrupt a batch; see `mask_tokens` for shapes, dtypes and errors.

        Args:
            input_ids: token ids (B, L), integer dtype; not modified.
            row_index: int64 (B,) global row ids.
            epoch: epoch number.

        Returns:
            `(input_ids, labels)`, int64 (B, L).
        """
        return mask_tokens(
            input_ids,
            vocab_size=self.vocab_size,
            row_index=row_index,
            seed=self.seed,
            epoch=epoch,
            mlm_probability=self.cfg.mlm_probability,
            mask_replace_prob=self.cfg.mask_replace_prob,
            random_replace_prob=self.cfg.random_replace_prob,
        )

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size"}` (plain Python values)."""
        return {"mode": self.mode, "seed": self.seed, "vocab_size": self.vocab_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the seed.

        Raises:
            ValueError: the state comes from another masking mode or vocabulary size.
        """
        if state.get("mode") != self.mode or state.get("vocab_size") != self.vocab_size:
            raise ValueError(
                f"masking: checkpoint state mode={state.get('mode')!r} "
                f"vocab_size={state.get('vocab_size')!r} does not match "
                f"mode={self.mode!r} vocab_size={self.vocab_size}"
            )
        self.seed = int(state["seed"])


class PrecomputedMasker:
    """Precomputed (static) masking (BERT, Devlin et al. 2019): reads the masked copies the
    shards stage wrote with `mask_tokens` keyed by (seed, copy, row); epoch `e` gets copy
    `e % dupe_factor`. With `dupe_factor` > the epochs trained, the masks equal dynamic
    masking's; the position is the data cursor's epoch, so there is no state to restore.

    Args:
        cfg: masking config (must be the one the copies were written with).
        vocab_size: number of ids, the special tokens included.
        seed: masking seed (must be the one the copies were written with).
        source: the masked copies of the training split.
    """

    mode = "precomputed"

    def __init__(
        self, cfg: MaskingConfig, vocab_size: int, seed: int, source: PrecomputedShardDataset
    ) -> None:
        self.cfg, self.vocab_size, self.seed, self.source = cfg, vocab_size, seed, source

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """The precomputed corruption of rows `row_index` in `epoch`.

        Args:
            input_ids: the unmasked rows (B, L); only their shape and device are used (the
                copies were made from the same rows by the shards stage).
            row_index: int64 (B,) global training row ids.
            epoch: epoch number; copy `epoch % dupe_factor` is read.

        Returns:
            `(input_ids, labels)`, int64 (B, L) on the device of `input_ids`.

        Raises:
            ValueError: the copies' rows are not shaped like `input_ids`.
        """
        ids, labels = self.source.get(row_index.cpu().numpy(), epoch)
        if ids.shape != input_ids.shape:
            raise ValueError(
                f"masking: precomputed rows {tuple(ids.shape)} differ from the batch "
                f"{tuple(input_ids.shape)}"
            )
        device = input_ids.device
        return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size", "dupe_factor"}` (plain Python values)."""
        return {"mode": self.mode, "seed": self.seed, "vocab_size": self.vocab_size,
                "dupe_factor": self.source.dupe_factor}

    def load_state_dict(self, state: dict) -> None:
        """Check that a checkpoint's masking matches these copies (nothing else to restore).

        Raises:
            ValueError: the state comes from another mode, vocabulary, seed or dupe_factor.
        """
        if state != self.state_dict():
            raise ValueError(
                f"masking: checkpoint state {state} does not match {self.state_dict()}"
            )


def build_masker(
    cfg: MaskingConfig, vocab_size: int, seed: int, shards: ShardManifest | None = None
) -> Masker:
    """Build the masker selected by `cfg.mode` (the single dispatch point, STYLE rule 6).

    Args:
        cfg: masking config.
        vocab_size: number of ids, the special tokens included.
        seed: masking seed (usually `TrainConfig.seed`).
        shards: the training shards; required by `precomputed` mode, whose copies they hold.

    Returns:
        A `Masker`.

    Raises:
        ValueError: unknown `cfg.mode`, `vocab_size <= NUM_SPECIAL`, or in `precomputed`
            mode: no `shards`, shards without masked copies, or copies written with another
            masking config or seed than `cfg` and `seed`.
    """
    if cfg.mode == "dynamic":
        return DynamicMasker(cfg, vocab_size, seed)
    if cfg.mode == "precomputed":
        if shards is None:
            raise ValueError("masking: precomputed mode needs the shard manifest")
        want = {"masking": cfg.model_dump(mode="json"), "masking_seed": seed}
        have = {k: shards.config.get(k) for k in want}
        if have != want:
            raise ValueError(
                f"masking: the shards in {shards.output_dir} were written with {have}, but "
                f"training asks for {want}; rewrite them with this masking config and "
                "train.seed"
            )
        from mlm_pipeline.train.data import PrecomputedShardDataset  # avoids an import cycle

        return PrecomputedMasker(cfg, vocab_size, seed, PrecomputedShardDataset(shards))
    raise ValueError(f"masking: unknown mode {cfg.mode!r}")
