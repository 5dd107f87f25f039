"""Unit tests of `mlm_pipeline.train.hf` for the `modern` preset: it is HF
`ModernBertForMaskedLM` (global attention in every layer), tensor for tensor."""

from __future__ import annotations

import pytest
import torch

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.attention import rope_tables
from mlm_pipeline.train.hf import (
    hf_class_name,
    hf_modernbert_config,
    hf_modernbert_state_dict,
    to_hf,
    to_hf_modernbert,
)
from mlm_pipeline.train.model import BertMLM
from tests.hf_parity import (
    VOCAB,
    assert_logits_and_loss_match,
    assert_logits_match_with_padding,
    with_nontrivial_vectors,
)

transformers = pytest.importorskip("transformers")

SEQ_LEN = 32


def modern(bias: bool = False, layers: int = 3) -> BertMLM:
    torch.manual_seed(0)
    cfg = ModelConfig(preset="modern", hidden_size=32, num_layers=layers, num_heads=4,
                      intermediate_size=48, bias=bias)
    return with_nontrivial_vectors(BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN))


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def pair(request):
    ours = modern(bias=request.param)
    return ours, to_hf_modernbert(ours)


def test_logits_and_loss_match(pair):
    ours, hf = pair
    assert type(hf).__name__ == "ModernBertForMaskedLM" and not hf.training
    assert_logits_and_loss_match(ours, hf, SEQ_LEN)


def test_logits_match_with_padding(pair):
    assert_logits_match_with_padding(*pair, SEQ_LEN, cut=20)


def test_every_tensor_maps_to_one_hf_tensor(pair):
    """One to one: nothing split, added or left over; layer 0 has no attention norm on
    either side; the decoder is tied to the token embeddings on both."""
    ours, hf = pair
    state = hf_modernbert_state_dict(ours)
    hf_state = hf.state_dict()
    assert set(state) == set(hf_state)
    assert all(state[k].shape == hf_state[k].shape for k in state)
    our_tensors = {k for k in ours.state_dict() if k != "head.decoder.weight"}  # tied
    assert len(our_tensors) == len(state) - 1  # decoder.weight is the tied copy
    assert not any(k.startswith("model.layers.0.attn_norm") for k in hf_state)
    assert isinstance(hf.model.layers[0].attn_norm, torch.nn.Identity)
    assert "layers.0.attention_norm.weight" not in ours.state_dict()
    assert hf.decoder.weight.data_ptr() == hf.model.embeddings.tok_embeddings.weight.data_ptr()
    assert state["decoder.bias"].shape == (VOCAB,)
    # the fused projections keep their row layouts: [q | k | v] and [gelu input | gate]
    torch.testing.assert_close(hf.model.layers[1].attn.Wqkv.weight,
                               ours.layers[1].attention.qkv.weight)
    torch.testing.assert_close(hf.model.layers[2].mlp.Wi.weight, ours.layers[2].ffn[0].weight)


def test_rope_tables_are_hf_tables_bit_for_bit():
    from transformers.models.modernbert import modeling_modernbert

    ours = modern()
    for length, theta in [(SEQ_LEN, 10000.0), (512, 160_000.0)]:  # ModernBERT-base global
        cfg = hf_modernbert_config(ours)
        cfg.rope_parameters["full_attention"]["rope_theta"] = theta
        rotary = modeling_modernbert.ModernBertRotaryEmbedding(cfg)
        x = torch.zeros(1, length, 32)
        cos, sin = rotary(x, torch.arange(length)[None], "full_attention")
        want_cos, want_sin = rope_tables(length, 8, theta)
        assert torch.equal(cos[0], want_cos) and torch.equal(sin[0], want_sin)
    assert torch.equal(ours.rope_cos, rope_tables(SEQ_LEN, 8, 10000.0)[0])


def test_config_has_a_global_layer_every_third():
    cfg = hf_modernbert_config(modern(layers=4))  # the preset: ModernBERT's 1 global in 3
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention",
                               "full_attention"]
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 10000.0
    assert (cfg.norm_eps, cfg.norm_bias, cfg.attention_bias, cfg.mlp_bias,
            cfg.classifier_bias, cfg.decoder_bias) == (1e-5, False, False, False, False, True)
    assert cfg.hidden_activation == cfg.classifier_activation == "gelu"
    assert not cfg.sparse_prediction and cfg.vocab_size == VOCAB


def test_class_names_of_presets_and_fields():
    assert hf_class_name(ModelConfig(preset="modern")) == "ModernBertForMaskedLM"
    assert hf_class_name(ModelConfig(preset="bert")) == "BertForMaskedLM"
    assert hf_class_name(ModelConfig()) == "BertForMaskedLM"
    assert hf_class_name(ModelConfig(preset="modern", bias=True)) == "ModernBertForMaskedLM"
    assert hf_class_name(ModelConfig(preset="modern", position="learned")) is None
    assert type(to_hf(modern())).__name__ == "ModernBertForMaskedLM"


@pytest.mark.parametrize("field, value", [("norm", "post"), ("position", "learned"),
                                          ("activation", "gelu")])
def test_incompatible_model_names_the_field(field, value):
    cfg = ModelConfig(preset="modern", hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, **{field: value})
    model = BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN)
    with pytest.raises(ValueError, match=f"model.{field}="):
        to_hf(model)
