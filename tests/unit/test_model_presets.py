"""Unit tests of the `modern` preset pieces (GeGLU, no biases), document attention and the
explicit attention path of `mlm_pipeline.train.model`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mlm_pipeline.config import CLS_ID, PAD_ID, SEP_ID, ModelConfig
from mlm_pipeline.train.kernels import attention
from mlm_pipeline.train.model import BertMLM, document_ids_from_sep

VOCAB, SEQ_LEN = 100, 16


def tiny(preset: str, **kw) -> BertMLM:
    torch.manual_seed(0)
    cfg = ModelConfig(preset=preset, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64, dropout=0.0, **kw)
    return BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN).eval()


def test_geglu_ffn_matches_shazeer_formula():
    """FFN(x) = W2 (gelu(W1 x) * (V x)) (Shazeer 2020, eq. 5), W1/V = halves of ffn.0."""
    ffn = tiny("modern").layers[0].ffn
    w1, v = ffn[0].weight[:64], ffn[0].weight[64:]
    w2 = ffn[2].weight
    x = torch.randn(5, 32)
    gate = 0.5 * (x @ w1.T) * (1 + torch.erf((x @ w1.T) / math.sqrt(2)))  # exact GELU
    want = (gate * (x @ v.T)) @ w2.T
    torch.testing.assert_close(ffn(x), want, atol=1e-6, rtol=1e-5)
    assert ffn[0].weight.shape == (128, 32) and w2.shape == (32, 64)


def test_modern_has_no_biases_except_the_decoder():
    model = tiny("modern")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert [m for m in linears if m.bias is not None] == [model.head.decoder]
    assert norms and all(m.bias is None for m in norms)
    assert {n for n, _ in model.named_parameters() if n.endswith("bias")} == {
        "head.decoder.bias"}


def test_bert_preset_keeps_default_checkpoint_keys():
    default = BertMLM(ModelConfig(), vocab_size=VOCAB, seq_len=SEQ_LEN)
    bert = BertMLM(ModelConfig(preset="bert"), vocab_size=VOCAB, seq_len=SEQ_LEN)
    assert bert.state_dict().keys() == default.state_dict().keys()
    assert "layers.0.ffn.0.bias" in default.state_dict()


def test_document_ids_from_sep_by_hand():
    c, s, p = CLS_ID, SEP_ID, PAD_ID
    input_ids = torch.tensor([[c, 7, 8, s, 9, s, 10, 11],
                              [c, 7, s, s, 9, s, p, p]])
    want = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2],
                         [0, 0, 0, 1, 2, 2, 3, 3]], dtype=torch.int32)
    got = document_ids_from_sep(input_ids)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)


def packed_row():
    """[CLS] 4 ids [SEP] | 5 ids [SEP] | 3 ids [SEP] -> 16 tokens, three documents."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (16,), generator=g)
    ids[0], ids[5], ids[11], ids[15] = CLS_ID, SEP_ID, SEP_ID, SEP_ID
    return ids[None]


def test_document_attention_equals_each_document_alone():
    # Rotary positions are relative, so a document alone in its own row must give the
    # same hidden states as inside the packed row (learned absolute positions would not).
    model = tiny("modern")
    row = packed_row()
    with torch.no_grad():
        packed = model.encode(row, document_ids=document_ids_from_sep(row))
        plain = model.encode(row)
        for start, end in [(0, 6), (6, 12), (12, 16)]:
            alone = model.encode(row[:, start:end])
            torch.testing.assert_close(packed[:, start:end], alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(packed[:, 6:12], plain[:, 6:12], atol=1e-3)  # mask matters


@pytest.mark.parametrize("preset", ["bert", "modern"])
def test_other_documents_have_no_influence(preset):
    model = tiny(preset)
    row = packed_row()
    captured = {}
    hook = model.embeddings.register_forward_hook(
        lambda m, i, out: captured.setdefault("x", out.retain_grad() or out))
    hidden = model.encode(row, document_ids=document_ids_from_sep(row))
    hook.remove()
    # A random projection of the second document's outputs (a plain sum of LayerNorm
    # outputs is constant, hence gradient-free).
    upstream = torch.randn(hidden[0, 6:12].shape, generator=torch.Generator().manual_seed(1))
    (hidden[0, 6:12] * upstream).sum().backward()
    grad = captured["x"].grad[0].abs().sum(dim=-1)  # (L,)
    assert bool((grad[:6] == 0).all()) and bool((grad[12:] == 0).all())
    assert bool((grad[6:12] > 0).all())


def test_document_attention_with_padding():
    model = tiny("modern")
    row = packed_row()[:, :12]  # two documents
    padded = torch.cat([row, torch.full((1, 4), 7)], dim=1)  # garbage, masked out
    attention_mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], dim=1).long()
    with torch.no_grad():
        want = model.encode(row, document_ids=document_ids_from_sep(row))
        got = model.encode(padded, attention_mask,
                           document_ids=document_ids_from_sep(padded))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, :12], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="document_ids"):
        model.encode(row, document_ids=document_ids_from_sep(row)[:, :5])


def test_explicit_attention_path_matches_reference_in_bf16():
    """The CPU bf16 training path (written-out matmuls) against fp64 softmax attention,
    with a document mask, forward and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    doc = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    mask = (doc[:, :, None] == doc[:, None, :])[:, None]  # (B, 1, L, L)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    got = attention(qb, kb, vb, mask, 0.0)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2)) / 4.0 + torch.where(mask, 0.0, -math.inf)
    want = scores.softmax(-1) @ v64
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (got.double() * upstream).sum().backward()
    (want * upstream).sum().backward()
    for ours, ref in [(qb, q64), (kb, k64), (vb, v64)]:
        torch.testing.assert_close(ours.grad.double(), ref.grad, atol=5e-2, rtol=5e-2)
    # SDPA agrees in fp32 (the path used elsewhere).
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               want.float(), atol=1e-5, rtol=1e-5)
