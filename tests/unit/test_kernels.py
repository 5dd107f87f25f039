"""The attention kernels of `mlm_pipeline.train.kernels` against the rule they implement,
written out here as a softmax over an explicitly built mask: a query sees the real keys of
its own document within its window. Every kernel (dense mask, documents batched by length,
sliding chunks, FlexAttention) must give those outputs and gradients at real tokens, and a
token must get nothing from a key outside its document or window."""

from __future__ import annotations

import warnings

import pytest
import torch

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.attention import SelfAttention, positions_in_documents
from mlm_pipeline.train.kernels import AttentionLayout, bucket_length, segments

CPU = torch.device("cpu")


def reference(q, k, v, keys_valid, documents, window):
    """softmax over the allowed keys, by loops over the rule (no kernel code)."""
    batch, _, seq_len, dim = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        for i in range(seq_len):
            allowed = torch.tensor([
                (keys_valid is None or bool(keys_valid[b, j]))
                and (documents is None or bool(documents[b, i] == documents[b, j]))
                and (window is None or abs(i - j) <= window)
                for j in range(seq_len)])
            if not allowed.any():
                continue
            scores = torch.einsum("hd,hnd->hn", q[b, :, i], k[b, :, allowed]) / dim**0.5
            out[b, :, i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v[b, :, allowed])
    return out


def _inputs(batch, seq_len, doc_rate, seed, padded):
    g = torch.Generator().manual_seed(seed)
    documents = torch.cumsum((torch.rand(batch, seq_len, generator=g) < doc_rate).int(), 1)
    keys_valid = None
    if padded:
        keys_valid = torch.ones(batch, seq_len, dtype=torch.bool)
        keys_valid[0, seq_len - 7:] = False
    q, k, v = (torch.randn(batch, 2, seq_len, 8, generator=g, dtype=torch.float64)
               for _ in range(3))
    return q, k, v, keys_valid, documents


# (seq_len, window, document rate, the plan `blocks` must choose)
CASES = [
    (96, None, 1 / 8, "buckets"),   # many short documents: batched by length
    (96, 20, 1 / 8, "band"),        # L > 3W: sliding chunks, documents inside the band
    (48, 20, 1 / 8, "buckets"),       # L <= 3W: buckets with the band inside
    (40, None, 1 / 100, "dense"),   # long documents: buckets would not pay
]


@pytest.mark.parametrize(("seq_len", "window", "rate", "plan"), CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_blocks_and_dense_match_the_rule_with_gradients(seq_len, window, rate, plan, padded):
    q, k, v, keys_valid, documents = _inputs(3, seq_len, rate, seq_len, padded)
    want = reference(q, k, v, keys_valid, documents, window)
    real = (keys_valid if keys_valid is not None
            else torch.ones(q.shape[0], seq_len, dtype=torch.bool))
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64) * real[:, None, :, None]
    grads = {}
    for kernel in ("dense", "blocks"):
        layout = AttentionLayout(q.shape[0], seq_len, CPU, keys_valid, documents, kernel)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = layout.attend(*leaves, window)
        torch.testing.assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real])
        grads[kernel] = torch.autograd.grad((got * upstream).sum(), leaves)
        if kernel == "blocks":
            assert layout.plan_name(window) == (plan if not padded or plan != "dense"
                                                else "dense")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference(*leaves, keys_valid, documents, window) * upstream).sum().backward()
    for kernel, got in grads.items():
        for g, leaf in zip(got, leaves):
            torch.testing.assert_close(g, leaf.grad, msg=kernel)


@pytest.mark.parametrize(("seq_len", "window"), [(96, None), (96, 20), (130, 16)])
def test_flex_block_mask_matches_the_rule(seq_len, window):
    # FlexAttention's block mask on the CPU (its unfused reference: forward only there);
    # the fused CUDA kernel is compared with the CPU in the gpu tests.
    q, k, v, keys_valid, documents = _inputs(2, seq_len, 1 / 10, 3, padded=True)
    layout = AttentionLayout(2, seq_len, CPU, keys_valid, documents, "flex")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: flex attention without torch.compile
        got = layout.attend(q, k, v, window)
    want = reference(q, k, v, keys_valid, documents, window)
    torch.testing.assert_close(got.transpose(1, 2)[keys_valid], want.transpose(1, 2)[keys_valid])


def test_no_padding_no_documents_global_is_plain_sdpa():
    layout = AttentionLayout(2, 32, CPU, None, None, "auto")
    assert layout.plan_name(None) == "unmasked"
    assert layout.plan_name(31) == "unmasked"  # a window spanning the row is global
    assert layout.plan_name(12) == "dense"     # L <= 3W: one banded mask
    assert layout.plan_name(8) == "band"       # L > 3W: sliding chunks
    assert AttentionLayout(2, 64, CPU, None, None, "auto").plan_name(8) == "band"


def test_auto_kernel_per_device_and_dropout():
    from mlm_pipeline.train.kernels import resolve_kernel

    assert resolve_kernel("auto", CPU) == "blocks"
    assert resolve_kernel("auto", torch.device("cuda")) == "flex"
    assert resolve_kernel("auto", torch.device("cuda"), dropout_p=0.1) == "dense"
    assert resolve_kernel("flex", CPU, dropout_p=0.1) == "dense"  # flex has no dropout
    with pytest.raises(ValueError, match="attention kernel 'fast'"):
        AttentionLayout(1, 8, CPU, None, None, "fast")


@pytest.mark.parametrize("kernel", ["dense", "blocks"])
def test_a_local_layer_sees_nothing_past_its_window(kernel):
    # One local layer (layer 1 of a global-every-2 model), window 16 = 8 each side: the
    # output at i has a zero gradient with respect to every input farther than 8 away,
    # and a non-zero one inside the window (documents off: the window alone decides).
    cfg = ModelConfig(preset="modern", hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, global_every=2, local_attention_window=16)
    torch.manual_seed(0)
    attn = SelfAttention(cfg, layer=1).double()
    assert not attn.is_global and attn.window == 8
    seq_len = 40  # > 3 windows: sliding chunks for `blocks`
    x = torch.randn(1, seq_len, 16, dtype=torch.float64, requires_grad=True)
    layout = AttentionLayout(1, seq_len, CPU, None, None, kernel)
    out = attn(x, layout)
    for i in (0, 13, 39):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        reach = grad[0].abs().sum(-1) > 0
        distance = (torch.arange(seq_len) - i).abs()
        assert bool(reach[distance <= 8].all()) and not bool(reach[distance > 8].any()), i


def test_positions_restart_in_each_document_by_hand():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 0]])
    assert torch.equal(positions_in_documents(documents), want)


def test_segments_and_buckets_by_hand():
    documents = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    keys_valid = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    starts, lengths = segments(keys_valid, documents, 6)
    # row 0: doc 0 (3), doc 1 (2), padding (1); row 1: doc 0 (4), padding (2)
    assert starts.tolist() == [0, 3, 5, 6, 10] and lengths.tolist() == [3, 2, 1, 4, 2]
    assert bucket_length(lengths, 6).tolist() == [6, 6, 6, 6, 6]  # capped at L
    assert bucket_length(torch.tensor([1, 16, 17, 25, 100]).numpy(), 512).tolist() == [
        16, 16, 24, 32, 128]
