"""Unit tests of `mlm_pipeline.train.model.BertMLM`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.model import BertMLM

VOCAB = 100  # padded to 128 rows
SEQ_LEN = 16


@pytest.fixture(params=[("post", "learned", None), ("pre", "learned", None),
                        ("pre", "rope", None), (None, None, "modern")],
                ids=["post-learned", "pre-learned", "pre-rope", "modern"])
def tiny_cfg(request) -> ModelConfig:
    norm, position, preset = request.param
    shape = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
             "dropout": 0.0}
    if preset is not None:  # pre-LN, rope, GeGLU, no biases
        return ModelConfig(preset=preset, **shape)
    return ModelConfig(norm=norm, position=position, **shape)


@pytest.fixture
def model(tiny_cfg) -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(tiny_cfg, vocab_size=VOCAB, seq_len=SEQ_LEN)


def batch(b: int = 4, seq_len: int = SEQ_LEN, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (b, seq_len), generator=g)
    labels = torch.full((b, seq_len), -100)
    chosen = torch.rand(b, seq_len, generator=g) < 0.3
    labels[chosen] = torch.randint(5, VOCAB, (int(chosen.sum()),), generator=g)
    return input_ids, labels


def test_output_shapes(model):
    input_ids, labels = batch()
    n = int((labels != -100).sum())
    out = model(input_ids, labels=labels)
    assert out.logits.shape == (n, VOCAB)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert int(out.num_masked) == n
    full = model(input_ids)
    assert full.loss is None and full.logits.shape == (4, SEQ_LEN, VOCAB)
    assert model.embeddings.word_embeddings.weight.shape == (128, 32)


def test_masked_head_matches_full_head_loss_and_gradients(model):
    input_ids, labels = batch(seed=1)

    out = model(input_ids, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    # Reference: head over every position (B, L, V), mean cross-entropy over labels != -100.
    hidden = model.encode(input_ids)
    transformed = model.head.transform(hidden)
    emb = model.embeddings.word_embeddings.weight
    logits = transformed @ emb.T + model.head.decoder.bias
    logits = logits[..., :VOCAB]
    ref_loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    ref_loss.backward()

    assert abs(out.loss.item() - ref_loss.item()) < 1e-5
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("rows", [4, 8])  # N below 64 (padded) and exactly 64 (not padded)
def test_head_rows_are_padded_to_a_multiple_of_64(model, rows):
    input_ids, labels = batch(b=rows, seed=2)
    if rows == 8:  # exactly 64 predicted positions: 8 per row
        labels = torch.full_like(input_ids, -100)
        labels[:, :8] = input_ids[:, :8]
    n = int((labels != -100).sum())
    seen = []
    hook = model.head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    out = model(input_ids, labels=labels)
    hook.remove()
    assert seen == [-(-n // 64) * 64] and (rows == 4) == (seen[0] > n)
    # The returned logits are the N real rows, in row-major order of the positions.
    with torch.no_grad():
        ref = model.head(model.encode(input_ids)[labels != -100])[:, :VOCAB]
    torch.testing.assert_close(out.logits.detach(), ref, atol=1e-5, rtol=0)
    assert int(out.num_masked) == n


def test_nothing_maskable_gives_zero_loss_that_backpropagates(model):
    input_ids, _ = batch()
    labels = torch.full_like(input_ids, -100)
    out = model(input_ids, labels=labels)
    assert out.loss.item() == 0.0 and torch.isfinite(out.loss)
    assert out.loss.requires_grad and int(out.num_masked) == 0
    assert out.logits.shape == (0, VOCAB)
    out.loss.backward()
    grad = model.embeddings.word_embeddings.weight.grad
    assert grad is not None and bool((grad == 0).all())


def test_decoder_is_tied_to_word_embeddings(model):
    emb = model.embeddings.word_embeddings.weight
    assert model.head.decoder.weight is emb
    assert model.head.decoder.bias.shape == (128,)
    assert model.num_parameters() == sum(p.numel() for p in set(model.parameters()))


def test_padding_does_not_change_real_tokens(model):
    model.eval()
    g = torch.Generator().manual_seed(2)
    real = torch.randint(5, VOCAB, (1, 10), generator=g)
    garbage = torch.randint(5, VOCAB, (1, 6), generator=g)  # not [PAD]: proves masking
    padded = torch.cat([real, garbage], dim=1)
    attention_mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 6)], dim=1).long()
    with torch.no_grad():
        alone = model.encode(real)
        with_pad = model.encode(padded, attention_mask)
        without_mask = model.encode(padded)
    assert torch.allclose(with_pad[:, :10], alone, atol=1e-5)
    assert not torch.allclose(without_mask[:, :10], alone, atol=1e-3)  # the mask matters
    # An all-ones mask is the same as no mask.
    with torch.no_grad():
        ones = model.encode(padded, torch.ones(1, 16, dtype=torch.long))
    assert torch.allclose(ones, without_mask, atol=1e-6)


def test_fully_padded_row_stays_finite(model):
    input_ids, labels = batch(b=2)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1] = 0
    labels[1] = -100
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    out.loss.backward()
    # Documented choice: a row without real tokens attends everywhere (as if unmasked).
    with torch.no_grad():
        assert torch.allclose(
            model.encode(input_ids, attention_mask)[1], model.encode(input_ids)[1], atol=1e-6
        )
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_too_long_input_raises(model):
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.full((1, SEQ_LEN + 1), 7))


def test_flops_per_token_hand_count(model, tiny_cfg):
    if tiny_cfg.activation == "geglu":
        # FFN forward per layer: W1 and V 2*32*(2*64) = 8192, W2 2*64*32 = 4096 -> 12288,
        # 4096 more than GELU's 8192: per layer 22528, two layers 45056.
        assert model.flops_per_token(16) == pytest.approx(3 * (45056 + 1267.2))
        return
    # H=32, I=64, layers=2, V=100, L=16, masked fraction 0.15.
    # Per layer forward: QKV 2*3*32*32 = 6144, out 2*32*32 = 2048, FFN 2*2*32*64 = 8192,
    #   scores 2*16*32 = 1024, values 2*16*32 = 1024  -> 18432; two layers -> 36864.
    # Head forward: transform 2*32*32 = 2048, decoder 2*32*100 = 6400 -> 8448 * 0.15 = 1267.2.
    # Training = 3 x forward = 3 * (36864 + 1267.2) = 114393.6.
    assert model.flops_per_token(16) == pytest.approx(114393.6)
    assert model.flops_per_token(16, masked_fraction=1.0) == pytest.approx(3 * (36864 + 8448))


def test_num_parameters_hand_count(model, tiny_cfg):
    h, i, vp, l = 32, 64, 128, 16
    b = 1 if tiny_cfg.bias else 0  # biases of Linears and LayerNorms
    g = 2 if tiny_cfg.activation == "geglu" else 1  # GeGLU: W1 and V
    norm = h + b * h
    embeddings = vp * h + (l * h if tiny_cfg.position == "learned" else 0) + norm
    layer = ((h * 3 * h + b * 3 * h) + (h * h + b * h) + norm
             + (h * g * i + b * g * i) + (i * h + b * h) + norm)
    head = (h * h + b * h) + norm + vp  # transform + LayerNorm + decoder bias (weight tied)
    # Pre-LN (ModernBERT): a final LayerNorm, and none before layer 0's attention.
    final_norm = norm if tiny_cfg.norm == "pre" else 0
    layers = 2 * layer - (norm if tiny_cfg.norm == "pre" else 0)
    assert model.num_parameters() == embeddings + layers + final_norm + head
    assert model.num_parameters(exclude_embeddings=True) == (
        norm + layers + final_norm + head
    )


def test_param_groups(model):
    decay, no_decay = model.param_groups(0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    named = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {named[id(p)] for p in no_decay["params"]}
    assert "embeddings.layer_norm.weight" in no_decay_names
    assert all(n.endswith("bias") or "norm" in n or n.startswith("head.transform.2")
               for n in no_decay_names)
    assert id(model.embeddings.word_embeddings.weight) in {id(p) for p in decay["params"]}


def test_init_follows_bert(model, tiny_cfg):
    w = model.layers[0].ffn[0].weight
    assert w.abs().max() <= 2 * tiny_cfg.initializer_range
    assert abs(w.std().item() - 0.88 * tiny_cfg.initializer_range) < 0.004  # 2-sigma truncation
    if tiny_cfg.bias:
        assert bool((model.layers[0].attention.qkv.bias == 0).all())
    assert bool((model.layers[1].ffn_norm.weight == 1).all())


def test_pre_norm_block_matches_its_formula():
    """x + attn(LN1(x)), then + ffn(LN2(.)), written out with the block's own sublayers;
    layer 0 has no LN1 (ModernBERT), its input being the embeddings' LayerNorm output."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      dropout=0.0, norm="pre")
    first, block = BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN).layers
    assert isinstance(first.attention_norm, torch.nn.Identity)
    assert isinstance(block.attention_norm, torch.nn.LayerNorm)
    x = torch.randn(2, SEQ_LEN, 32)
    h = x + block.attention(block.attention_norm(x), None)
    want = h + block.ffn(block.ffn_norm(h))
    torch.testing.assert_close(block(x, None), want)
    h = x + first.attention(x, None)
    torch.testing.assert_close(first(x, None), h + first.ffn(first.ffn_norm(h)))


def test_pre_norm_refuses_a_layer0_attention_norm_by_name():
    """A pre-LN state from before the ModernBERT alignment computes another function."""
    cfg = ModelConfig(preset="modern", hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64)
    model = BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN)
    state = model.state_dict()
    state["layers.0.attention_norm.weight"] = torch.ones(32)
    with pytest.raises(RuntimeError, match="ModernBERT alignment"):
        model.load_state_dict(state)
    model.load_state_dict(model.state_dict())  # the current layout loads


def test_rope_scores_depend_only_on_relative_position():
    """RoPE's defining property (Su et al. 2021, eq. 16): <R_m q, R_n k> = g(q, k, n - m)."""
    from mlm_pipeline.train.attention import apply_rope, rope_tables

    torch.manual_seed(0)
    cos, sin = rope_tables(64, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    def score(m, n):
        qs = torch.zeros(1, 1, 64, 8); ks = torch.zeros(1, 1, 64, 8)
        qs[0, 0, m] = q; ks[0, 0, n] = k
        return (apply_rope(qs, cos, sin)[0, 0, m] @ apply_rope(ks, cos, sin)[0, 0, n]).item()
    assert score(3, 10) == pytest.approx(score(40, 47), rel=1e-5)
    assert score(0, 0) == pytest.approx(float(q @ k), rel=1e-5)  # position 0: no rotation
    assert score(3, 10) != pytest.approx(score(3, 11), rel=1e-3)


def test_cpu_dropout_is_inverted_dropout():
    from mlm_pipeline.train.attention import Dropout
    from mlm_pipeline.train.kernels import dropout

    torch.manual_seed(0)
    x = torch.full((1000, 1000), 3.0, requires_grad=True)
    y = dropout(x, 0.25)
    kept = y != 0
    n = kept.numel()
    # share dropped within 6 sigma of p, kept values scaled by 1 / (1 - p)
    assert abs((~kept).sum().item() / n - 0.25) < 6 * (0.25 * 0.75 / n) ** 0.5
    assert torch.allclose(y[kept], torch.tensor(4.0))
    y.sum().backward()
    assert torch.equal(x.grad, kept.float() * (1 / 0.75))
    # identity in eval mode and at p = 0; the module has no state
    assert dropout(x, 0.25, training=False) is x and dropout(x, 0.0) is x
    module = Dropout(0.5).eval()
    assert module(x) is x and module.state_dict() == {}
    # the same generator state gives the same mask (resume reproduces it)
    torch.manual_seed(7)
    a = dropout(x.detach(), 0.1)
    torch.manual_seed(7)
    assert torch.equal(a, dropout(x.detach(), 0.1))
