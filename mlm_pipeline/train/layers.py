"""The layers of `BertMLM` (`model`): embeddings, a residual encoder block, the GeGLU
gate and the MLM head, each switching between BERT's and ModernBERT's form by
`ModelConfig` (see `model`'s module docstring). Attention is in `attention`.

Shapes: B = batch size, L = tokens per row, H = hidden size, V = vocabulary size,
N = predicted (masked) positions in a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.attention import Dropout, SelfAttention
from mlm_pipeline.train.kernels import AttentionLayout


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    """LayerNorm over H, with a bias unless `cfg.bias` is False (ModernBERT `norm_bias`)."""
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.bias)


class GeGLU(nn.Module):
    """The gate of GeGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5):
    (..., 2I) -> (..., I) as dropout(gelu(a) * b), where [a, b] are the two halves of the
    fused W1/V projection (Hugging Face ModernBERT's `Wi`: `input, gate = Wi(x).chunk(2)`;
    its `mlp_dropout` acts here, before `Wo`).

    Args:
        p: dropout probability on the gated product.
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.dropout = Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        """(..., 2I) -> (..., I)."""
        a, b = x.chunk(2, dim=-1)
        return self.dropout(F.gelu(a) * b)


class Embeddings(nn.Module):
    """Word + learned absolute position embeddings, LayerNorm, dropout (BERT).

    Args:
        cfg: model shape.
        padded_vocab_size: rows of the word-embedding table (V rounded up to 64).
        seq_len: longest supported row, tokens.
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, cfg.hidden_size)
        # With rotary positions, attention carries the positions: no absolute table.
        self.position_embeddings = (
            nn.Embedding(seq_len, cfg.hidden_size) if cfg.position == "learned" else None
        )
        self.layer_norm = layer_norm(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """Embed int64 ids (B, L) into (B, L, H); `positions`: int64 (B, L) position of
        each token (positions restarting per document), None = 0 .. L - 1."""
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(positions)
        return self.dropout(self.layer_norm(x))


class Block(nn.Module):
    """Transformer block, post-LN (BERT): `x = LN(x + attn(x)); x = LN(x + ffn(x))`, or
    pre-LN (Xiong et al. 2020): `x = x + attn(LN(x)); x = x + ffn(LN(x))`, where layer 0
    has no attention LayerNorm (ModernBERT: `attn_norm = nn.Identity()` in layer 0), its
    input being the embeddings' LayerNorm output already.

    Args:
        cfg: model shape.
        layer: index of the block (0-based; layer 0 is the first, `cfg.is_global` says
            whether its attention is global or local).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attention = SelfAttention(cfg, layer)
        self.attention_norm = nn.Identity() if self.pre_norm and layer == 0 else layer_norm(cfg)
        h, i = cfg.hidden_size, cfg.intermediate_size
        geglu = cfg.activation == "geglu"
        # GeGLU: W1 and V fused into one (H, 2I) matmul, split by the gate, which also
        # drops out (ModernBERT); GELU's branch drops out after W2 (BERT's hidden dropout).
        self.ffn = nn.Sequential(
            nn.Linear(h, 2 * i if geglu else i, bias=cfg.bias),
            GeGLU(cfg.dropout) if geglu else nn.GELU(),
            nn.Linear(i, h, bias=cfg.bias),
        )
        self.ffn_norm = layer_norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.ffn_dropout = Dropout(0.0 if geglu else cfg.dropout)

    def forward(self, x: Tensor, layout: AttentionLayout | None = None,
                rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """(B, L, H) -> (B, L, H); `layout` and `rope` as in `SelfAttention.forward`."""
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.attention_norm(x), layout, rope))
            return x + self.ffn_dropout(self.ffn(self.ffn_norm(x)))
        x = self.attention_norm(x + self.dropout(self.attention(x, layout, rope)))
        return self.ffn_norm(x + self.ffn_dropout(self.ffn(x)))


class MLMHead(nn.Module):
    """BERT's prediction head: transform (dense + GELU + LayerNorm), tied decoder + bias.

    Args:
        cfg: model shape.
        word_embeddings: the input embedding table, whose weight the decoder shares.
    """

    def __init__(self, cfg: ModelConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        # Without biases (ModernBERT: classifier_bias=False, norm_bias=False) the decoder
        # keeps its bias all the same (ModernBERT: decoder_bias=True): it carries the
        # unigram log-frequencies and costs V parameters.
        self.transform = nn.Sequential(
            nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias),
            nn.GELU(),
            layer_norm(cfg),
        )
        padded_vocab_size, hidden = word_embeddings.weight.shape
        self.decoder = nn.Linear(hidden, padded_vocab_size)
        self.decoder.weight = word_embeddings.weight  # tied (Press & Wolf 2017; BERT)

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., H) -> (..., V rounded up to 64) logits."""
        return self.decoder(self.transform(hidden))
