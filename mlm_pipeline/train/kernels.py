"""Attention over packed rows: which keys each query may see, and the kernel that computes
it without paying for the keys it may not.

Shapes: B = batch size, L = tokens per row, h = heads, D = head dimension, W = a local
layer's half window (`ModelConfig.local_half_window`). A query at position i of a row may
see the key at position j when all of these hold:

- j is a real token (`attention_mask[j] == 1`);
- i and j are in the same document (`document_ids[i] == document_ids[j]`), with document
  attention;
- |i - j| <= W, in a local (sliding-window) layer (ModernBERT's window:
  transformers `sliding_window_bidirectional_overlay`, `local_attention // 2`).

`AttentionLayout` is built once per forward pass (`BertMLM.encode`) from the batch's
padding and document ids, and every layer calls `attend(q, k, v, window)`; what it
precomputes for a window (a mask, gather indices, a FlexAttention block mask) is shared by
the layers of that window. The kernels (`kernel`):

- `dense`: one boolean (B, 1, L, L) mask for `F.scaled_dot_product_attention` (or the
  explicit CPU path of `attention.attention`): every score is computed, then masked. The
  reference, and the layout before document attention was the default.
- `blocks` (CPU, eager): block-diagonal batching. The documents of the batch are cut out
  of their rows and batched by length into a few buckets (16, 24, 32, 48, 64, ... tokens),
  each attended without a mask when all its documents fill it, else with a key-padding
  mask; the outputs are gathered back into the rows. Work falls from B * L^2 scores to
  the sum of the buckets' squares (MosaicBERT and ModernBERT unpad for the same reason).
  A local layer with L > 3W attends in chunks of W queries against the 3W keys around
  them (Longformer's sliding chunks, Beltagy et al. 2020), the document mask applied
  inside the band: W-proportional work whatever L. The layout falls back to `dense` when
  the buckets would not save a quarter of the scores (long documents).
- `flex` (CUDA): `torch.nn.attention.flex_attention` with a block mask built from the same
  rule: blocks wholly outside a document or window are skipped, partial ones masked in
  the fused kernel (torchtitan's document masking). Called through `torch.compile` (an
  eager FlexAttention materializes the scores); no dropout, so a training step with
  attention dropout on CUDA uses `dense`.
- `auto` (the default): `flex` on CUDA (`dense` with attention dropout), `blocks` on an
  eager CPU, `dense` inside a compiled CPU model (static shapes: `blocks` reads the
  document lengths on the host).

Without padding, documents or a window narrower than the row, every kernel is plain SDPA
without a mask (its fastest kernels). All kernels give the same outputs at real tokens up
to float rounding; the outputs at padding positions are unspecified (never predicted).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

Kernel = Literal["auto", "dense", "blocks", "flex"]
KERNELS: tuple[str, ...] = ("auto", "dense", "blocks", "flex")

#: Bucket lengths of the `blocks` kernel: 16 x 1.5^k rounded to multiples of 8, so a
#: document pads by at most half its length (at most 2.25x its scores).
_BUCKET_STEPS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                 3072, 4096, 6144, 8192)
#: `blocks` is used only when its buckets hold at most this share of the dense scores
#: (B * L^2): the gathers and extra calls cost about what the saving would below that.
BLOCKS_MAX_SHARE = 0.75
#: A local layer attends in sliding chunks (`blocks`) when L exceeds this many half
#: windows: below it the 3W keys of a chunk are most of the row anyway.
BAND_MIN_HALF_WINDOWS = 3

#: (q, k, v, dropout_p) -> output, each (B, h, L, D).
Attend = Callable[[Tensor, Tensor, Tensor, float], Tensor]


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout (Srivastava et al. 2014): zero each element with probability `p`,
    scale the rest by 1 / (1 - p); identity when not training or `p == 0`.

    On CPU the keep-mask is drawn as fp32 uniforms compared in place (`rand >= p`, exact to
    2**-24) and applied with one multiply, whose autograd saves that mask: forward +
    backward about 1.7x faster than `F.dropout`, whose CPU `bernoulli_` dominated a BERT
    training step's dropout cost (torch 2.13; B 32, 4 heads, L 128: 8 ms vs 14 ms). CUDA
    keeps `F.dropout`'s fused kernel. Draws come from torch's global generator, like
    `F.dropout`, so checkpointed RNG state reproduces them.

    Args:
        x: any floating tensor.
        p: drop probability in [0, 1).
        training: apply dropout only when True.

    Returns:
        A tensor shaped and typed like `x`.
    """
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p=p)
    scale = torch.rand(x.shape, dtype=torch.float32).ge_(p).mul_(1.0 / (1.0 - p))
    return x * scale.to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
              dropout_p: float) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v (Vaswani et al. 2017, eq. 1) on (B, heads, L, D).

    `F.scaled_dot_product_attention` everywhere except when training on CPU in bf16/fp16
    or with dropout: there the two matmuls, softmax and their autograd written out beat
    torch 2.13's kernels (B 32, 4 heads, L 128, D 64, forward + backward: bf16 24 ms vs
    70 ms for the flash kernel's slow backward; fp32 with dropout 46 ms vs 51 ms for SDPA's
    math fallback), the (B, heads, L, L) scores being small at BERT lengths.
    Reduced-precision softmax on CPU accumulates in fp32.

    Args:
        q, k, v: (B, heads, L, D), any strides.
        attn_mask: bool, broadcastable to (B, heads, L, L), True = may attend; every
            query row must allow at least one key.
        dropout_p: dropout on the attention probabilities.

    Returns:
        (B, heads, L, D), dtype of `q`.
    """
    explicit = (q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad
                and (dropout_p > 0.0 or q.dtype in (torch.bfloat16, torch.float16)))
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=dropout_p)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = dropout(scores.softmax(dim=-1), dropout_p)
    return probs @ v


class AttentionLayout:
    """Which keys each query of a batch sees, and how each layer's attention is computed
    (module docstring). Built by `build`; `attend` is what `SelfAttention` calls.

    Args:
        batch, seq_len: B and L.
        device: where the batch lives.
        keys_valid: bool (B, L), True = real token; None = no padding.
        documents: integer (B, L) document ids; None = one document per row.
        kernel: `auto`, `dense`, `blocks` or `flex` (module docstring).
        dropout_p: attention-probability dropout of this pass (0 when not training).

    Raises:
        ValueError: an unknown `kernel`.
    """

    def __init__(self, batch: int, seq_len: int, device: torch.device,
                 keys_valid: Tensor | None, documents: Tensor | None, kernel: str = "auto",
                 dropout_p: float = 0.0) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel {kernel!r}: expected one of {KERNELS}")
        self.batch, self.seq_len, self.device = batch, seq_len, device
        self.keys_valid, self.documents = keys_valid, documents
        self.kernel = resolve_kernel(kernel, device, dropout_p)
        self._plans: dict[int | None, tuple[str, Attend]] = {}

    @classmethod
    def build(cls, input_ids: Tensor, attention_mask: Tensor | None,
              document_ids: Tensor | None, kernel: str = "auto",
              dropout_p: float = 0.0) -> AttentionLayout:
        """The layout of a batch of `input_ids` (B, L).

        An all-ones `attention_mask` counts as none (one host-device sync, which callers
        avoid by passing None for unpadded batches), so SDPA keeps its fastest kernels.
        """
        keys_valid = None
        if attention_mask is not None and not bool(attention_mask.all()):
            keys_valid = attention_mask.bool()
        batch, seq_len = input_ids.shape
        return cls(batch, seq_len, input_ids.device, keys_valid, document_ids, kernel,
                   dropout_p)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None,
               dropout_p: float = 0.0) -> Tensor:
        """softmax(q k^T / sqrt(D) + mask) v over the keys each query may see.

        Args:
            q, k, v: (B, h, L, D), any strides.
            window: W of a local layer, None for a global one.
            dropout_p: dropout on the attention probabilities.

        Returns:
            (B, h, L, D), dtype of `q`.
        """
        return self._plan(window)[1](q, k, v, dropout_p)

    def plan_name(self, window: int | None) -> str:
        """How a layer of `window` attends in this batch: `unmasked` (plain SDPA), `dense`
        (the boolean mask), `buckets` (documents batched by length), `band` (sliding
        chunks) or `flex`."""
        return self._plan(window)[0]

    def _plan(self, window: int | None) -> tuple[str, Attend]:
        if window is not None and window >= self.seq_len - 1:
            window = None  # the window spans the row: a global layer
        if window not in self._plans:
            self._plans[window] = self._new_plan(window)
        return self._plans[window]

    def _new_plan(self, window: int | None) -> tuple[str, Attend]:
        if self.keys_valid is None and self.documents is None and window is None:
            return "unmasked", _unmasked
        if self.kernel == "flex":
            return "flex", _flex_plan(self, window)
        if self.kernel == "blocks":
            if window is not None and self.seq_len > BAND_MIN_HALF_WINDOWS * window:
                return "band", _band_plan(self, window)
            if self.documents is not None or self.keys_valid is not None:
                plan = _bucket_plan(self, window)
                if plan is not None:
                    return "buckets", plan
        return "dense", _dense_plan(self, window)


def resolve_kernel(kernel: str, device: torch.device, dropout_p: float = 0.0) -> str:
    """The kernel `auto` stands for on `device` (module docstring); others are kept, except
    `flex` with attention dropout, which FlexAttention lacks (`dense` then)."""
    if kernel == "flex" and dropout_p > 0.0:
        return "dense"
    if kernel != "auto":
        return kernel
    if device.type == "cuda":
        return "flex" if dropout_p == 0.0 else "dense"
    return "dense" if torch.compiler.is_compiling() else "blocks"


def _unmasked(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    return attention(q, k, v, None, dropout_p)


def dense_mask(keys_valid: Tensor | None, documents: Tensor | None, seq_len: int,
               window: int | None, device: torch.device) -> Tensor | None:
    """The boolean SDPA mask (True = may attend) of the rule in the module docstring.

    Args:
        keys_valid: bool (B, L), True = real token; None = no padding.
        documents: integer (B, L) document ids; None = one document per row.
        seq_len: L.
        window: W of a local layer, None for a global one.
        device: where to build it.

    Returns:
        None when nothing is masked; bool (B, 1, 1, L) for padding alone (a row without a
        real token attends everywhere: it softmaxes over nothing otherwise); else bool
        (B or 1, 1, L, L), where a padding query keeps its own key.
    """
    if documents is None and window is None:
        if keys_valid is None:
            return None
        return (keys_valid | ~keys_valid.any(dim=1, keepdim=True))[:, None, None, :]
    allowed = None
    if documents is not None:
        allowed = documents[:, :, None] == documents[:, None, :]  # (B, L, L)
    if window is not None:
        pos = torch.arange(seq_len, device=device)
        band = ((pos[:, None] - pos[None, :]).abs() <= window)[None]  # (1, L, L)
        allowed = band if allowed is None else allowed & band
    if keys_valid is not None:
        # Every query keeps its own key, so a padding query (whose document is all
        # padding) never softmaxes over nothing.
        eye = torch.eye(seq_len, dtype=torch.bool, device=device)
        allowed = (allowed & keys_valid[:, None, :]) | eye
    return allowed[:, None]


def _dense_plan(layout: AttentionLayout, window: int | None) -> Attend:
    mask = dense_mask(layout.keys_valid, layout.documents, layout.seq_len, window,
                      layout.device)

    def run(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        return attention(q, k, v, mask, dropout_p)

    return run


# --- blocks: documents batched by length -------------------------------------------------


def segments(keys_valid: Tensor | None, documents: Tensor | None,
             seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of one document (padding: its own runs) in the flattened (B * L) rows.

    Returns:
        (starts, lengths): int64 arrays, flat start position and length of every run, in
        order; no run crosses a row boundary.
    """
    key = (documents if documents is not None
           else torch.zeros(keys_valid.shape, dtype=torch.int32, device=keys_valid.device))
    key = key.to(torch.int64)
    if keys_valid is not None:
        key = torch.where(keys_valid, key, -1)  # padding tokens: a run of their own
    flat = key.reshape(-1).cpu().numpy()
    change = np.ones(flat.shape, dtype=bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::seq_len] = True
    starts = np.flatnonzero(change)
    lengths = np.diff(np.append(starts, flat.size))
    return starts, lengths


def bucket_length(length: np.ndarray, seq_len: int) -> np.ndarray:
    """The bucket (`_BUCKET_STEPS`, at most `seq_len`) each run length pads up to."""
    steps = np.asarray(_BUCKET_STEPS)
    at = np.searchsorted(steps, length, side="left")
    padded = np.where(at < len(steps), steps[np.minimum(at, len(steps) - 1)], length)
    return np.minimum(padded, seq_len)


def _bucket_plan(layout: AttentionLayout, window: int | None) -> Attend | None:
    """Block-diagonal batching (module docstring), or None when it would not pay."""
    batch, seq_len = layout.batch, layout.seq_len
    starts, lengths = segments(layout.keys_valid, layout.documents, seq_len)
    padded = bucket_length(lengths, seq_len)
    if float((padded.astype(np.float64) ** 2).sum()) > BLOCKS_MAX_SHARE * batch * seq_len**2:
        return None
    device = layout.device
    buckets = []  # (rows, cols, mask) per bucket, index tensors (n, P)
    inverse = np.empty(batch * seq_len, dtype=np.int64)  # flat token -> row of the cat
    offset = 0
    for size in np.unique(padded):
        chosen = np.flatnonzero(padded == size)
        s, n = starts[chosen], lengths[chosen]
        slot = np.arange(size)
        flat = s[:, None] + np.minimum(slot[None, :], n[:, None] - 1)  # (n, P), pads repeat
        real = slot[None, :] < n[:, None]
        inverse[flat[real]] = offset + np.flatnonzero(real.reshape(-1))
        offset += flat.size
        mask = None
        if not real.all():
            mask = torch.from_numpy(real).to(device)[:, None, None, :]  # (n, 1, 1, P)
        if window is not None and size > window + 1:
            band = torch.from_numpy(np.abs(slot[:, None] - slot[None, :]) <= window).to(device)
            mask = band[None, None] if mask is None else mask & band
            mask = mask | torch.eye(int(size), dtype=torch.bool, device=device)
        flat_t = torch.from_numpy(flat).to(device)
        buckets.append((flat_t // seq_len, flat_t % seq_len, mask))
    inverse_t = torch.from_numpy(inverse).to(device)

    def run(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        heads, dim = q.shape[1], q.shape[3]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, h, D) views
        outs = []
        for rows, cols, mask in buckets:
            # (n, P, h, D) gathered, viewed as (n, h, P, D)
            qb, kb, vb = (t[rows, cols].transpose(1, 2) for t in (q, k, v))
            out = attention(qb, kb, vb, mask, dropout_p)  # (n, h, P, D)
            outs.append(out.transpose(1, 2).reshape(-1, heads, dim))
        flat_out = torch.cat(outs).index_select(0, inverse_t)  # (B * L, h, D)
        return flat_out.view(batch, seq_len, heads, dim).transpose(1, 2)

    return run


# --- blocks: sliding chunks of a local layer ---------------------------------------------


def _band_plan(layout: AttentionLayout, window: int) -> Attend:
    """Sliding chunks: queries in chunks of W, each against the 3W keys from W before its
    first query to W after its last (module docstring)."""
    batch, seq_len, device = layout.batch, layout.seq_len, layout.device
    chunk = window
    chunks = -(-seq_len // chunk)
    span = chunk + 2 * window
    padded = chunks * chunk
    # Key position of slot b of chunk c: c * chunk - window + b.
    qpos = torch.arange(padded, device=device).view(chunks, chunk)  # (c, C)
    kpos = (torch.arange(chunks, device=device)[:, None] * chunk - window
            + torch.arange(span, device=device)[None, :])  # (c, S)
    in_row = (kpos >= 0) & (kpos < seq_len)
    allowed = ((qpos[:, :, None] - kpos[:, None, :]).abs() <= window) & in_row[:, None, :]
    allowed = allowed[None]  # (1, c, C, S)
    kclamp = kpos.clamp(0, seq_len - 1)
    if layout.documents is not None or layout.keys_valid is not None:
        qclamp = qpos.clamp(max=seq_len - 1)
        if layout.documents is not None:
            docs = layout.documents
            allowed = allowed & (docs[:, qclamp][:, :, :, None] == docs[:, kclamp][:, :, None, :])
        if layout.keys_valid is not None:
            allowed = allowed & layout.keys_valid[:, kclamp][:, :, None, :]
        # a query keeps its own key (slot position + window): never an empty softmax
        own = torch.arange(chunk, device=device)[:, None] + window == torch.arange(
            span, device=device)[None, :]
        allowed = allowed | own
    mask = allowed[:, None]  # (B or 1, 1, c, C, S)

    def run(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        heads, dim = q.shape[1], q.shape[3]
        pad_q = padded - seq_len
        qc = torch.nn.functional.pad(q, (0, 0, 0, pad_q)).view(batch, heads, chunks, chunk, dim)
        # keys padded by W before and W + pad_q after, then one (S)-wide window per chunk
        kc, vc = (torch.nn.functional.pad(t, (0, 0, window, window + pad_q))
                  .unfold(2, span, chunk).transpose(-1, -2) for t in (k, v))
        out = attention(qc, kc, vc, mask, dropout_p)  # (B, h, c, C, D)
        return out.reshape(batch, heads, padded, dim)[:, :, :seq_len]

    return run


# --- flex: FlexAttention block masks (CUDA) ------------------------------------------------


@functools.cache
def _compiled_flex() -> Callable:
    """`flex_attention` through `torch.compile` (fused kernel; eager FlexAttention
    materializes the scores). Inside an already compiled model dynamo traces through it."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(keys_valid: Tensor | None, documents: Tensor | None, batch: int,
                    seq_len: int, window: int | None, device: torch.device):
    """The FlexAttention `BlockMask` of the rule in the module docstring (no own-key rule:
    FlexAttention gives a query with no key zeros, not NaN)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx >= 0  # all True, shaped like the indices
        if documents is not None:
            allowed = allowed & (documents[b, q_idx] == documents[b, kv_idx])
        if keys_valid is not None:
            allowed = allowed & keys_valid[b, kv_idx]
        if window is not None:
            allowed = allowed & ((q_idx - kv_idx).abs() <= window)
        return allowed

    per_row = documents is not None or keys_valid is not None
    return create_block_mask(mask_mod, batch if per_row else None, None, seq_len, seq_len,
                             device=device)


def _flex_plan(layout: AttentionLayout, window: int | None) -> Attend:
    block_mask = flex_block_mask(layout.keys_valid, layout.documents, layout.batch,
                                 layout.seq_len, window, layout.device)
    if layout.device.type == "cuda":
        flex = _compiled_flex()
    else:  # tests: the reference (unfused) implementation on CPU
        from torch.nn.attention.flex_attention import flex_attention as flex

    def run(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        return flex(q, k, v, block_mask=block_mask)

    return run
