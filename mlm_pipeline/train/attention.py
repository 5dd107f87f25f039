"""Bidirectional self-attention, the document layout of packed rows (document ids from
[SEP], positions within documents) and rotary position embeddings for `BertMLM`; which
keys a query sees, and the kernels that compute it, are in `kernels`.

Shapes: B = batch size, L = tokens per row, H = hidden size, h = heads, d = H / h.
The attention mask convention is SDPA's boolean one: True = may attend.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mlm_pipeline.config import SEP_ID, ModelConfig
from mlm_pipeline.train.kernels import AttentionLayout, dropout


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
