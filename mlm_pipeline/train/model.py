"""A BERT-style encoder for masked-language modelling, single-device and plain.

Shapes used throughout: B = batch size (rows), L = sequence length (tokens per row, at most
`seq_len`), H = hidden size (`ModelConfig.hidden_size`), V = vocabulary size (`vocab_size`,
the special tokens included). N is the number of predicted (masked) positions in a batch.

The default architecture is BERT's (Devlin et al. 2019, §3; Vaswani et al. 2017): learned
absolute position embeddings, post-LayerNorm residual blocks (`x = LN(x + f(x))`), GELU (exact
erf form, as in BERT), biases everywhere, no token-type embeddings (one segment only). The
config switches each of these to its ModernBERT counterpart (Warner et al. 2024): pre-LN,
rotary positions, GeGLU feed-forward (Shazeer 2020), no biases in linear layers and
LayerNorms. The `modern` preset is Hugging Face `ModernBertForMaskedLM` (transformers
`models/modernbert/modeling_modernbert.py`), its local/global attention layout included
(`global_every`, `local_attention_window`, `local_rope_base`), tensor for tensor
(`train.hf`): embeddings LayerNorm, no attention LayerNorm in layer 0 (its input is
the embeddings' LayerNorm output), fused `qkv` rows [q | k | v] with heads contiguous,
half-split RoPE, GeGLU `[gelu half | gate half]`, final LayerNorm, head. The MLM head (dense
+ GELU + LayerNorm, then a decoder tied to the word embeddings plus its own bias, which
ModernBERT keeps too: `decoder_bias=True`) runs only at masked positions when labels are
given, which saves the (B, L, V) logits.

Packed rows hold several documents (`[CLS] doc1 [SEP] doc2 [SEP] ...`); with
`document_ids` (see `document_ids_from_sep`) a token attends only within its own document
and its position restarts there, so a document is encoded as it would be alone in a row;
`kernels` computes that without the cost of the masked scores.

The layers (embeddings, blocks, GeGLU, head) are in `layers`, attention in `attention`.
Distributed training, `torch.compile`, autocast and logging belong to the training loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlm_pipeline.config import IGNORE_INDEX, ModelConfig
from mlm_pipeline.train.attention import (
    document_ids_from_sep,  # noqa: F401 (loop and evaluate import it from here)
    positions_in_documents,
    rope_at,
    rope_tables,
)
from mlm_pipeline.train.kernels import KERNELS, AttentionLayout
from mlm_pipeline.train.layers import Block, Embeddings, MLMHead, layer_norm

#: Rows of the embedding table are padded to a multiple of this: matmuls whose dimensions
#: are multiples of 64 map onto full tensor-core tiles (NVIDIA "Matrix multiplication
#: background" guide; nanoGPT pads GPT-2's 50257 to 50304 for a ~25% speed-up).
VOCAB_PAD_MULTIPLE = 64
#: The head's rows (predicted positions) are padded up to a multiple of this (see
#: `BertMLM.forward`), so its tensors take few distinct sizes from step to step.
HEAD_ROW_MULTIPLE = 64


class MLMOutput(NamedTuple):
    """What `BertMLM.forward` returns.

    Attributes:
        loss: mean cross-entropy over predicted positions, fp32 scalar (nats/token);
            None without labels.
        logits: (N, V) at predicted positions with labels, else (B, L, V); dtype of the
            computation (fp32, or bf16 under autocast).
        num_masked: int64 scalar tensor, N (0 without labels).
    """

    loss: Tensor | None
    logits: Tensor
    num_masked: Tensor


class BertMLM(nn.Module):
    """BERT-style encoder with a masked-language-model head.

    Args:
        cfg: model shape.
        vocab_size: V, ids in the vocabulary, the special tokens included.
        seq_len: longest row the position table supports, tokens.
        attention_kernel: how attention skips the keys a query may not see
            (`kernels.KERNELS`; `auto` picks per device, `dense` is the masked-SDPA
            reference). Every kernel computes the same function: not part of the weights
            or the config.

    Raises:
        ValueError: `vocab_size` or `seq_len` is not positive, or an unknown kernel.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, seq_len: int,
                 attention_kernel: str = "auto") -> None:
        super().__init__()
        if vocab_size < 1 or seq_len < 1:
            raise ValueError(f"model: vocab_size {vocab_size} and seq_len {seq_len} must be >= 1")
        if attention_kernel not in KERNELS:
            raise ValueError(f"model: attention_kernel {attention_kernel!r} is not one of "
                             f"{KERNELS}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.attention_kernel = attention_kernel
        # Padding rows are never looked up (ids < V) and their logits are sliced off.
        self.padded_vocab_size = math.ceil(vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
        self.embeddings = Embeddings(cfg, self.padded_vocab_size, seq_len)
        self.layers = nn.ModuleList(Block(cfg, layer=i) for i in range(cfg.num_layers))
        if cfg.position == "rope":
            head_dim = cfg.hidden_size // cfg.num_heads
            cos, sin = rope_tables(seq_len, head_dim, cfg.rope_base)
            # Derived from the config: not saved in checkpoints (persistent=False).
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            if cfg.has_local_layers:  # the local layers' own base (ModernBERT)
                cos, sin = rope_tables(seq_len, head_dim, cfg.local_rope_base)
                self.register_buffer("local_rope_cos", cos, persistent=False)
                self.register_buffer("local_rope_sin", sin, persistent=False)
        # Pre-LN leaves the residual stream unnormalized: normalize it once at the end.
        self.final_norm = layer_norm(cfg) if cfg.norm == "pre" else None
        self.head = MLMHead(cfg, self.embeddings.word_embeddings)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # BERT init: truncated normal (cut at 2 std, as TF's truncated_normal), zero biases,
        # LayerNorm weight 1 / bias 0 (google-research/bert modeling.py).
        std = self.cfg.initializer_range
        # The tied decoder weight is drawn twice (as embedding, then as decoder): harmless.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`, refusing by name a pre-LN state with a layer-0
        attention LayerNorm (our layout before the ModernBERT alignment): a different
        function, which this model cannot compute.

        Raises:
            RuntimeError: that layout, or (with `strict`) missing or unexpected keys.
        """
        if self.cfg.norm == "pre" and "layers.0.attention_norm.weight" in state_dict:
            raise RuntimeError(
                "model: this pre-LN (modern) state has a LayerNorm before layer 0's attention, "
                "the layout before the ModernBERT alignment, where layer 0 has none; retrain, "
                "or load it with the mlm-pipeline version that trained it")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
               document_ids: Tensor | None = None) -> Tensor:
        """Run the encoder.

        Args:
            input_ids: int64 (B, L), ids in [0, V), L <= `seq_len`.
            attention_mask: (B, L), 1 = real token, 0 = padding (keys ignored); None = all real.
            document_ids: integer (B, L) document index per position (`document_ids_from_sep`);
                when given, a token attends only to tokens of its own document and, with
                `document_positions: restart`, its position counts from its document's
                first token. None = the whole row is one sequence.

        Returns:
            Final hidden states (B, L, H).

        Raises:
            ValueError: L exceeds `seq_len`, or `document_ids` is not shaped like
                `input_ids`.
        """
        if input_ids.shape[1] > self.seq_len:
            raise ValueError(f"model: input length {input_ids.shape[1]} > seq_len {self.seq_len}")
        if document_ids is not None and document_ids.shape != input_ids.shape:
            raise ValueError(
                f"model: document_ids shape {tuple(document_ids.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        layout = AttentionLayout.build(input_ids, attention_mask, document_ids,
                                       self.attention_kernel,
                                       self.cfg.dropout if self.training else 0.0)
        positions = None
        if document_ids is not None and self.cfg.document_positions == "restart":
            positions = positions_in_documents(document_ids)
        x = self.embeddings(input_ids, positions)
        ropes = {True: None, False: None}
        if self.cfg.position == "rope":
            seq_len = input_ids.shape[1]
            ropes[True] = rope_at(self.rope_cos, self.rope_sin, positions, seq_len)
            if self.cfg.has_local_layers:
                ropes[False] = rope_at(self.local_rope_cos, self.local_rope_sin, positions,
                                       seq_len)
        for layer in self.layers:
            x = layer(x, layout, ropes[layer.attention.is_global])
        return x if self.final_norm is None else self.final_norm(x)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        masked_per_row: int | None = None,
    ) -> MLMOutput:
        """Encode and predict.

        With labels, the head runs only at the N positions where `labels != -100`
        (`nonzero`, one host-device sync), and the loss is the fp32 cross-entropy sum
        divided by max(N, 1): a batch with nothing to predict gives loss 0.0 that still
        backpropagates (zero gradients). The head's rows are padded up to a multiple of
        `HEAD_ROW_MULTIPLE` with copies of the first position whose targets are ignored
        (no loss, zero gradient; at most 63 extra rows): with bernoulli masking N differs
        every step, and tensors of ever-new sizes (the (N, V) logits, their fp32 copy and
        gradients, tens of MB each) fragmented the CPU heap: the tiny config's peak RSS
        grew from 1.0 to 1.8 GB over 175 steps with glibc malloc, and stays at 0.7 GB
        padded, at the same speed.

        Args:
            input_ids: int64 (B, L), ids in [0, V).
            attention_mask: (B, L), 1 = real token; None = all real.
            labels: int64 (B, L), target ids, -100 where not predicted.
            document_ids: integer (B, L), attention within documents only; see `encode`.
            masked_per_row: k, a bound on the labels of every row (`exact_k` masking:
                `masking.keyed.exact_k(L, p)`). The head then runs at k positions of each
                row, the labelled ones first (a stable sort of the label mask), the others
                ignored: static shapes, no `nonzero` and no host sync, so a compiled model
                neither breaks its graph nor recompiles as N changes. Labels past the k-th
                in a row would be dropped: the bound is checked with `_assert_async`.

        Returns:
            `MLMOutput`: with labels, loss (fp32 scalar), logits (N, V) (with
            `masked_per_row`: (B * k, V), ignored rows included), num_masked = N;
            without, loss None, logits (B, L, V), num_masked = 0.

        Raises:
            ValueError: L exceeds `seq_len`, or `labels` or `document_ids` is not shaped
                like `input_ids`.
            RuntimeError: with `masked_per_row`, a row holds more labels than k (on
                CUDA a device-side assert).
        """
        hidden = self.encode(input_ids, attention_mask, document_ids=document_ids)
        if labels is None:
            logits = self._real_vocab(self.head(hidden))
            return MLMOutput(None, logits, input_ids.new_zeros((), dtype=torch.int64))
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"model: labels shape {tuple(labels.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if masked_per_row is not None:
            return self._static_head(hidden, labels, masked_per_row)
        flat_labels = labels.reshape(-1)
        positions = torch.nonzero(flat_labels != IGNORE_INDEX).squeeze(1)  # (N,), row-major
        n = positions.numel()
        pad = -n % HEAD_ROW_MULTIPLE
        if pad:
            positions = torch.cat([positions, positions.new_zeros(pad)])
        targets = flat_labels[positions]  # (N + pad,): a copy
        targets[n:] = IGNORE_INDEX
        logits = self._real_vocab(self.head(hidden.reshape(-1, hidden.shape[-1])[positions]))
        # Upcast bf16/fp16 logits (autocast) to fp32; keep fp64 when the model runs in fp64.
        logits_fp32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss_sum = F.cross_entropy(logits_fp32, targets, reduction="sum",
                                   ignore_index=IGNORE_INDEX)
        num_masked = torch.tensor(n, dtype=torch.int64, device=input_ids.device)
        loss = loss_sum / max(n, 1)
        return MLMOutput(loss, logits[:n], num_masked)

    def _static_head(self, hidden: Tensor, labels: Tensor, k: int) -> MLMOutput:
        """The head at k positions per row (`forward`'s `masked_per_row`)."""
        labelled = labels != IGNORE_INDEX
        counts = labelled.sum(1)
        torch._assert_async(counts.max() <= k, "model: a row has more labels than masked_per_row")
        # A stable descending sort puts each row's labelled positions first, in order.
        positions = torch.sort(labelled.to(torch.uint8), dim=1, descending=True,
                               stable=True).indices[:, :k]                      # (B, k)
        targets = labels.gather(1, positions).reshape(-1)                        # (B * k,)
        rows = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        logits = self._real_vocab(self.head(rows.reshape(-1, hidden.shape[-1])))
        logits_fp32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss_sum = F.cross_entropy(logits_fp32, targets, reduction="sum",
                                   ignore_index=IGNORE_INDEX)
        num_masked = counts.sum()
        return MLMOutput(loss_sum / num_masked.clamp(min=1), logits, num_masked)

    def _real_vocab(self, logits: Tensor) -> Tensor:
        """(..., V rounded up to 64) -> (..., V). Without padding rows, no slice: even a
        full slice costs a copy and a zero-filled gradient of the (N, V) logits."""
        if self.padded_vocab_size == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size]

    def flops_per_token(self, seq_len: int, masked_fraction: float = 0.15) -> float:
        """Training FLOPs per token (forward + backward) for rows of `seq_len` tokens.

        Convention of Kaplan et al. 2020, §2.1 (Table 1) and Hoffmann et al. 2022
        (Chinchilla), Appendix F: count only matrix multiplications, 2 FLOPs per
        multiply-add; backward = 2 x forward, so training = 3 x forward (the "6N" rule plus
        attention). Embedding lookups, LayerNorm, softmax, GELU, biases and dropout are
        left out. Per token, forward:

            per layer   2 * (3*H*H + H*H)          Q, K, V and output projections
                      + 2 * (g*H*I + I*H)          feed-forward, I = intermediate_size;
                                                   g = 1 (GELU), 2 (GeGLU: W1 and V)
                      + 2 * K*H + 2 * K*H          scores Q K^T and weighted sum A V over
                                                   the K keys a query sees: K = L in a
                                                   global layer, min(L, window + 1) in a
                                                   local one
                      = 8*H^2 + 2*(g+1)*H*I + 4*K*H   (no causal halving: bidirectional)
            head        f * (2*H*H + 2*H*V)        transform + tied decoder, only at the
                                                   masked fraction f of tokens, real V

            total = 3 * (sum over layers (8*H^2 + 2*(g+1)*H*I + 4*K*H) + f * (2*H^2 + 2*H*V))

        The GeGLU gate's elementwise product is left out like the activation itself;
        document attention is counted as full attention (the work of a mask-free step; the
        variable-length kernel does less, so MFU compares with the unmasked model).

        Padding rows of the vocabulary are not counted (model FLOPs, not hardware FLOPs).

        Args:
            seq_len: L, tokens per row (attention cost grows with it).
            masked_fraction: f, share of tokens where the head runs (the expected
                `mlm_probability` times the maskable share).

        Returns:
            FLOPs per token (float).
        """
        h, i, v = self.cfg.hidden_size, self.cfg.intermediate_size, self.vocab_size
        gates = 2 if self.cfg.activation == "geglu" else 1
        local_keys = min(seq_len, 2 * self.cfg.local_half_window + 1)
        keys = sum(seq_len if self.cfg.is_global(n) else local_keys
                   for n in range(self.cfg.num_layers))
        layers = self.cfg.num_layers * (8 * h * h + 2 * (gates + 1) * h * i) + 4 * keys * h
        head = masked_fraction * (2 * h * h + 2 * h * v)
        return 3.0 * (layers + head)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Count parameters, each shared tensor once (the tied decoder weight is the
        word-embedding table, padding rows included).

        Args:
            exclude_embeddings: leave out the word and position tables (Kaplan et al.
                2020 count non-embedding parameters).

        Returns:
            Number of scalar parameters.
        """
        excluded = set()
        if exclude_embeddings:
            tables = [self.embeddings.word_embeddings, self.embeddings.position_embeddings]
            excluded = {id(t.weight) for t in tables if t is not None}
        return sum(p.numel() for p in self.parameters() if id(p) not in excluded)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: decay matrices, not biases or LayerNorm parameters.

        Follows BERT's `exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]`
        (google-research/bert optimization.py): every 1-D parameter (biases, LayerNorm
        weights and biases, the embeddings' LayerNorm included) gets no decay; weight
        matrices and embedding tables do. Each parameter appears exactly once.

        Args:
            weight_decay: decoupled weight decay of the decayed group.

        Returns:
            `[{"params": [...], "weight_decay": weight_decay},
              {"params": [...], "weight_decay": 0.0}]`.
        """
        decay, no_decay = [], []
        for param in self.parameters():  # deduplicates the tied weight
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
