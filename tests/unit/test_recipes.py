"""The base recipes (`configs/bert-base.yaml`, `configs/modern-base.yaml`): built on the meta
device (no memory, no init), their parameter counts equal the Hugging Face models of the same
config, and `flops_per_token` equals the PaLM formula written out by hand."""

import math

import pytest
import torch

from mlm_pipeline.config_files import load_config
from mlm_pipeline.train import hf
from mlm_pipeline.train.model import VOCAB_PAD_MULTIPLE, BertMLM

transformers = pytest.importorskip("transformers")

RECIPES = ["bert-base", "modern-base"]
#: Parameter counts at the shipped vocabulary (32,768, no padding rows), pinned from the
#: meta-device build and equal to the HF counts below (BERT-base: HF's 110,946,560 minus
#: its 2 x 768 token-type embeddings; the published bert-base-uncased's 110M differs by its
#: 30,522-piece vocabulary; modern-base: 12 of ModernBERT-base's 22 layers).
EXPECTED_PARAMS = {"bert-base": 110_945_024, "modern-base": 85_970_432}


def _meta_models(name: str, vocab_size: int):
    """(ours, HF) for a recipe at `vocab_size`, both on the meta device."""
    cfg = load_config(name)
    with torch.device("meta"):
        ours = BertMLM(cfg.model, vocab_size, cfg.shards.seq_len)
        if cfg.model.preset == "bert":
            theirs = transformers.BertForMaskedLM(hf.hf_bert_config(ours))
        else:
            theirs = transformers.ModernBertForMaskedLM(hf.hf_modernbert_config(ours))
    return cfg, ours, theirs


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_shape(name):
    cfg = load_config(name)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads) == (12, 768, 12)
    assert m.intermediate_size == (3072 if m.preset == "bert" else 1152)
    assert cfg.tokenizer.vocab_size == 32768 and cfg.shards.seq_len == 128
    assert cfg.masking.selection == "exact_k" and cfg.masking.mlm_probability == 0.3
    assert (cfg.train.precision, cfg.train.compile, cfg.train.device) == ("bf16", "on", "cuda")
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps == 4096  # MosaicBERT
    # the token budget the comments state: 70,000 x 4096 x 128 = 36.7 B
    assert cfg.train.max_steps * 4096 * 128 == 36_700_160_000
    # general-domain French by default (the guide's probes are in the vocabulary)
    assert cfg.ingest.sources == ["debian:fr-general"]
    assert cfg.eval.every_steps == 2000  # a validation curve (MosaicBERT eval_interval)


@pytest.mark.parametrize("vocab_size", [32768, 30522])  # ours; BERT's (padded to 30,528)
@pytest.mark.parametrize("name", RECIPES)
def test_parameter_count_matches_hugging_face(name, vocab_size):
    cfg, ours, theirs = _meta_models(name, vocab_size)
    assert all(p.device.type == "meta" for p in ours.parameters())
    h = cfg.model.hidden_size
    padded = math.ceil(vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    # Tied weights, counted once on both sides: the decoder weight is the word-embedding
    # table (ours: `head.decoder.weight is embeddings.word_embeddings.weight`).
    assert ours.head.decoder.weight is ours.embeddings.word_embeddings.weight
    hf_count = sum(p.numel() for p in theirs.parameters())  # deduplicated by nn.Module
    # Ours: padding rows in the word table (H each) and in the decoder bias (1 each).
    expected = hf_count + (padded - vocab_size) * (h + 1)
    if cfg.model.preset == "bert":  # HF BERT has token-type embeddings, ours none
        expected -= hf.TYPE_VOCAB_SIZE * h
    assert ours.num_parameters() == expected
    if vocab_size == 32768:
        assert ours.num_parameters() == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", RECIPES)
def test_flops_per_token_hand_formula(name):
    # PaLM (Chowdhery et al. 2022) appendix B: training FLOPs per token = 6 N + 12 L H Q T
    # (N: matmul weights, L layers, H heads of width Q, T = seq_len; 3 x forward, 2 FLOPs a
    # multiply-add; Kaplan et al. 2020 Table 1 for the 6 N part). The MLM head runs at the
    # masked fraction f of tokens only, over the real (unpadded) vocabulary V.
    cfg = load_config(name)
    m, v, t, f = cfg.model, cfg.tokenizer.vocab_size, 128, 0.3
    d, i = m.hidden_size, m.intermediate_size
    ffn_in = 2 * i if m.activation == "geglu" else i  # GeGLU: W1 and V fused (768 x 2304)
    n_layer = 4 * d * d + d * ffn_in + i * d          # q, k, v, o; W1 (+V); W2
    n_head = d * d + d * v                            # transform; tied decoder
    q = d // m.num_heads
    hand = 6 * (m.num_layers * n_layer + f * n_head) + 12 * m.num_layers * m.num_heads * q * t
    _, ours, _ = _meta_models(name, v)
    assert ours.flops_per_token(t, f) == pytest.approx(hand, rel=1e-12)
    # and the matmul weights of the layers are what the model holds
    linear = sum(mod.weight.numel() for layer in ours.layers for mod in layer.modules()
                 if isinstance(mod, torch.nn.Linear))
    assert linear == m.num_layers * n_layer
    expected_gflop = {"bert-base": 0.5701, "modern-base": 0.4215}[name]  # stated in the YAMLs
    assert hand / 1e9 == pytest.approx(expected_gflop, abs=1e-4)
