"""Unit tests of `mlm_pipeline.train.hf`: our `bert` preset equals HF `BertForMaskedLM`."""

from __future__ import annotations

import pytest
import torch

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.hf import hf_bert_state_dict, to_hf_bert
from mlm_pipeline.train.model import BertMLM
from tests.hf_parity import (
    VOCAB,
    assert_logits_and_loss_match,
    assert_logits_match_with_padding,
    with_nontrivial_vectors,
)

pytest.importorskip("transformers")

SEQ_LEN = 16


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=64)
    ours = with_nontrivial_vectors(BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN))
    return ours, to_hf_bert(ours)


def test_logits_and_loss_match(pair):
    ours, hf = pair
    assert_logits_and_loss_match(ours, hf, SEQ_LEN)


def test_logits_match_with_padding(pair):
    assert_logits_match_with_padding(*pair, SEQ_LEN, cut=10)


def test_export_cuts_vocab_padding_and_zeroes_token_types(pair):
    ours, _ = pair
    state = hf_bert_state_dict(ours)
    assert state["bert.embeddings.word_embeddings.weight"].shape == (VOCAB, 32)
    assert state["cls.predictions.bias"].shape == (VOCAB,)
    assert bool((state["bert.embeddings.token_type_embeddings.weight"] == 0).all())
    # query rows are the first H rows of our fused projection
    torch.testing.assert_close(state["bert.encoder.layer.1.attention.self.value.weight"],
                               ours.layers[1].attention.qkv.weight[64:])


@pytest.mark.parametrize("field, value", [("norm", "pre"), ("position", "rope"),
                                          ("activation", "geglu"), ("bias", False)])
def test_incompatible_model_names_the_field(field, value):
    cfg = ModelConfig(preset="bert", hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, **{field: value})
    with pytest.raises(ValueError, match=f"model.{field}="):
        to_hf_bert(BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN))
