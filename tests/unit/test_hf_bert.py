"""Unit tests of `mlm_pipeline.train.hf`: our `bert` preset equals HF `BertForMaskedLM`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.train.hf import hf_bert_state_dict, to_hf_bert
from mlm_pipeline.train.model import BertMLM

pytest.importorskip("transformers")

VOCAB = 100  # padded to 128 rows in ours, 100 in the export
SEQ_LEN = 16


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=64)
    ours = BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN)
    with torch.no_grad():  # init leaves biases and LayerNorms trivial: make them matter
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return ours.eval(), to_hf_bert(ours)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (3, SEQ_LEN), generator=g)
    labels = torch.full_like(input_ids, -100)
    chosen = torch.rand(3, SEQ_LEN, generator=g) < 0.3
    labels[chosen] = torch.randint(5, VOCAB, (int(chosen.sum()),), generator=g)
    return input_ids, labels


def test_logits_and_loss_match(pair):
    ours, hf = pair
    input_ids, labels = batch(0)
    with torch.no_grad():
        mine = ours(input_ids, labels=labels)
        theirs = hf(input_ids=input_ids, labels=labels)
    assert theirs.logits.shape == (3, SEQ_LEN, VOCAB)
    torch.testing.assert_close(mine.logits, theirs.logits[labels != -100],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    # Independent loss: cross-entropy of HF's full logits over the labelled positions.
    ref = F.cross_entropy(theirs.logits.reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(mine.loss, ref, atol=1e-5, rtol=1e-5)


def test_logits_match_with_padding(pair):
    ours, hf = pair
    input_ids, _ = batch(1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 10:] = 0
    attention_mask[2, 5:] = 0
    with torch.no_grad():
        mine = ours(input_ids, attention_mask=attention_mask).logits
        theirs = hf(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=1e-5, rtol=1e-5)


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
