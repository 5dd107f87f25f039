"""Bidirectional self-attention, the document layout of packed rows (document ids from
[SEP], positions within documents) and rotary position embeddings for `BertMLM`; which
keys a query sees, and the kernels that compute it, are in `kernels`.

Shapes: B = batch size, L = tokens per row, H = hidden size, h = heads, d = H / h.
The attention mask convention is SDPA's boolean one: True = may attend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlm_pipeline.config import SEP_ID, ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    from mlm_pipeline.train.kernels import AttentionLayout


class SelfAttention(nn.Module):
    """Multi-head bidirectional self-attention; the kernel is the batch's
    `kernels.AttentionLayout`'s.

    Args:
        cfg: model shape; `num_heads` divides `hidden_size`.
        layer: index of the layer (0-based): a local layer (`cfg.is_global(layer)` False)
            attends within `cfg.local_half_window` positions and is rotated with the local
            RoPE tables.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.is_global = cfg.is_global(layer)
        self.window = None if self.is_global else cfg.local_half_window
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.bias)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: Tensor, layout: AttentionLayout | None = None,
                rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Attend (B, L, H) -> (B, L, H) over the keys `layout` lets each query see (None:
        no padding, one document per row); `rope` = (cos, sin), fp32 tables shaped to
        broadcast against (B, L, 2, heads, H / heads) (`rope_at`), rotates queries and
        keys."""
        batch, seq_len, hidden = x.shape
        if layout is None:
            from mlm_pipeline.train.kernels import AttentionLayout

            layout = AttentionLayout(batch, seq_len, x.device, None, None)
        qkv = self.qkv(x).view(batch, seq_len, 3, self.num_heads, hidden // self.num_heads)
        if rope is None:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x (B, heads, L, H / heads) views
        else:
            # Queries and keys rotated in one pass over the (B, L, 2, heads, D) slice.
            q, k = apply_rope(qkv[:, :, :2], *rope).permute(2, 0, 3, 1, 4)
            v = qkv[:, :, 2].transpose(1, 2)
        y = layout.attend(q, k, v, self.window, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, seq_len, hidden))


def document_ids_from_sep(input_ids: Tensor, sep_id: int = SEP_ID) -> Tensor:
    """Document index of every position of packed rows, from the in-band [SEP] tokens.

    Rows are packed as `[CLS] doc1 [SEP] doc2 [SEP] ...`: a [SEP] ends the document it
    follows, so the id of a position is the number of [SEP] strictly before it in its row
    (an exclusive prefix count). Trailing [PAD] after the last [SEP] form one more
    "document", which the attention mask hides anyway.

    Args:
        input_ids: integer (B, L) token ids.
        sep_id: the id of [SEP] in the run's tokenizer (the caller reads it there; the
            default is the id this project's tokenizers give it).

    Returns:
        int32 (B, L) document ids, 0 for the first document of each row.
    """
    is_sep = (input_ids == sep_id).to(torch.int32)
    return (torch.cumsum(is_sep, dim=1, dtype=torch.int32) - is_sep)


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """Position of every token within its document: 0 at each document's first token.

    Args:
        document_ids: integer (B, L), constant over each document's tokens (as
            `document_ids_from_sep` gives them).

    Returns:
        int64 (B, L) positions, each below L.
    """
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(first, index, 0).cummax(dim=1).values
    return index - start


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


class Dropout(nn.Module):
    """`nn.Dropout` with the faster CPU path of `dropout`; no parameters, so checkpoints
    are unchanged.

    Args:
        p: drop probability in [0, 1).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        """Apply `dropout(x, p)` in training mode; identity in eval mode."""
        return dropout(x, self.p, self.training)


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


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """Rotary-embedding tables (Su et al. 2021, RoFormer, eq. 34), fp32 (seq_len, head_dim):
    angle(p, i) = p * base^(-2i / head_dim) for the pair i, repeated over both halves (the
    half-split pairing of GPT-NeoX, Hugging Face Llama and ModernBERT).

    Computed in fp32 with the operations of transformers' `ModernBertRotaryEmbedding`
    (default RoPE), so an exported `modern` model uses the tables it was trained with:
    float64 angles differ from these by up to 2e-5 at position 512 (fp32 rounding of p *
    inv_freq), 4e-4 at 8192."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys by position: x*cos + rotate_half(x)*sin, where
    rotate_half([a, b]) = [-b, a] on the two halves of the last dimension D.

    Args:
        x: (..., D) queries and/or keys, any layout.
        cos, sin: fp32 tables from `rope_tables`, already sliced and shaped to broadcast
            against `x` (e.g. (L, D) for (B, heads, L, D)); cast to the dtype of `x`.

    Returns:
        Rotated tensor shaped like `x`, contiguous.
    """
    half = x.shape[-1] // 2
    # rotate_half(x) * sin == roll(x, D/2) * [-sin_a, sin_b]: one copy instead of the
    # chunk, negation and concatenation (3x faster forward + backward in bf16 on CPU).
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(x.dtype)
    return torch.addcmul(x * cos.to(x.dtype), x.roll(half, dims=-1), signed_sin)


def rope_at(cos: Tensor, sin: Tensor, positions: Tensor | None,
            seq_len: int) -> tuple[Tensor, Tensor]:
    """The rows of the RoPE tables of each token, shaped for `SelfAttention.forward`.

    Args:
        cos, sin: fp32 (max positions, D) tables from `rope_tables`.
        positions: int64 (B, L) position of each token (`positions_in_documents`); None =
            0 .. L - 1 in every row.
        seq_len: L.

    Returns:
        (cos, sin), each (L, 1, 1, D) without `positions`, else (B, L, 1, 1, D).
    """
    if positions is None:
        return cos[:seq_len, None, None, :], sin[:seq_len, None, None, :]
    return cos[positions][:, :, None, None, :], sin[positions][:, :, None, None, :]
