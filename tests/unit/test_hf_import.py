"""`train.hf_import` and `config.hf_parent`: a Hugging Face masked LM (`save_pretrained`
directory) loaded as ours, and as a run's parent (`train.init_from`).

Slow: small random `BertForMaskedLM` (a nonzero token-type row 0) and
`ModernBertForMaskedLM` (sliding and full layers, a 8-token window shorter than the 40
tokens fed), built and saved by `transformers`: our logits equal transformers' own on the
same inputs (fp32, 1e-5), and our export gives the original state dict back.

Fast: the config mapping on hand-written `config.json` files (both RoPE forms, the layer
patterns), refusals naming the file and field (an unrepresentable field, a damaged
safetensors header, a truncated file, a tensor of the wrong shape, a missing or an
unexpected tensor), the digests recorded (sha256 computed here), and what `load_config`
makes of such a parent. Weight files for the fast tests are written with `safetensors`
from tensors laid out by hand in HF's names.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.config.hf_parent import hf_model_fields, hf_parent_class
from mlm_pipeline.config_files import load_config
from mlm_pipeline.errors import ConfigError
from mlm_pipeline.train.hf_import import directory_digest, fit_vocab, load_hf_model
from mlm_pipeline.train.warm_start import init_weights, resolve_init

H, LAYERS, HEADS, FFN, VOCAB, MAX_POS = 16, 2, 2, 32, 100, 64

BERT_CONFIG = {"architectures": ["BertForMaskedLM"], "model_type": "bert",
               "hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
               "intermediate_size": FFN, "vocab_size": VOCAB,
               "max_position_embeddings": MAX_POS, "hidden_act": "gelu",
               "layer_norm_eps": 1e-12, "hidden_dropout_prob": 0.1, "type_vocab_size": 2,
               "initializer_range": 0.02}
MODERN_CONFIG = {"architectures": ["ModernBertForMaskedLM"], "model_type": "modernbert",
                 "hidden_size": H, "num_hidden_layers": 3, "num_attention_heads": HEADS,
                 "intermediate_size": FFN, "vocab_size": VOCAB,
                 "max_position_embeddings": MAX_POS, "norm_eps": 1e-5,
                 "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                 "local_attention": 8,
                 "rope_parameters": {
                     "full_attention": {"rope_type": "default", "rope_theta": 80000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}}


def bert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under `BertForMaskedLM`'s names and shapes for `BERT_CONFIG` (as
    `save_pretrained` writes them: the tied decoder weight left out)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g)

    out = {"bert.embeddings.word_embeddings.weight": t(VOCAB, H),
           "bert.embeddings.position_embeddings.weight": t(MAX_POS, H),
           "bert.embeddings.token_type_embeddings.weight": t(2, H),
           "bert.embeddings.LayerNorm.weight": t(H), "bert.embeddings.LayerNorm.bias": t(H),
           "cls.predictions.transform.dense.weight": t(H, H),
           "cls.predictions.transform.dense.bias": t(H),
           "cls.predictions.transform.LayerNorm.weight": t(H),
           "cls.predictions.transform.LayerNorm.bias": t(H),
           "cls.predictions.bias": t(VOCAB)}
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for name, shape in (("attention.self.query", (H, H)), ("attention.self.key", (H, H)),
                            ("attention.self.value", (H, H)), ("attention.output.dense", (H, H)),
                            ("attention.output.LayerNorm", (H,)),
                            ("intermediate.dense", (FFN, H)), ("output.dense", (H, FFN)),
                            ("output.LayerNorm", (H,))):
            out[f"{p}{name}.weight"] = t(*shape)
            out[f"{p}{name}.bias"] = t(shape[0])
    return out


def write_dir(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def bert_dir(tmp_path) -> Path:
    return write_dir(tmp_path / "bert", BERT_CONFIG, bert_tensors())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- config mapping ---------------------------------------------------------------


def test_bert_config_maps_onto_the_bert_preset(bert_dir):
    hf_class, fields, sizes = hf_model_fields(bert_dir)
    assert hf_class == "BertForMaskedLM" == hf_parent_class(bert_dir)
    cfg = ModelConfig.model_validate(fields)
    assert (cfg.preset, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
            cfg.intermediate_size) == ("bert", H, LAYERS, HEADS, FFN)
    assert (cfg.norm, cfg.position, cfg.activation, cfg.bias, cfg.global_every) == (
        "post", "learned", "gelu", True, 1)
    assert cfg.layer_norm_eps == 1e-12 and cfg.dropout == 0.1
    assert sizes == {"vocab_size": VOCAB, "max_position_embeddings": MAX_POS}


def test_modern_config_both_rope_forms_give_one_model(tmp_path):
    new = write_dir(tmp_path / "new", MODERN_CONFIG, {})
    old_config = {k: v for k, v in MODERN_CONFIG.items()
                  if k not in ("rope_parameters", "layer_types")}
    old_config |= {"global_rope_theta": 80000.0, "local_rope_theta": 5000.0,
                   "global_attn_every_n_layers": 2}
    old = write_dir(tmp_path / "old", old_config, {})
    a = ModelConfig.model_validate(hf_model_fields(new)[1])
    b = ModelConfig.model_validate(hf_model_fields(old)[1])
    assert a == b
    assert (a.preset, a.norm, a.position, a.activation, a.bias) == (
        "modern", "pre", "rope", "geglu", False)
    assert (a.global_every, a.local_attention_window, a.rope_base, a.local_rope_base) == (
        2, 8, 80000.0, 5000.0)
    # No key at all: transformers' defaults (global every 3rd, 128 window, 160k / 10k).
    bare = write_dir(tmp_path / "bare", {k: v for k, v in old_config.items() if k not in (
        "global_rope_theta", "local_rope_theta", "global_attn_every_n_layers",
        "local_attention")}, {})
    c = ModelConfig.model_validate(hf_model_fields(bare)[1])
    assert (c.global_every, c.local_attention_window, c.rope_base, c.local_rope_base) == (
        3, 128, 160000.0, 10000.0)


@pytest.mark.parametrize(("types", "every"), [
    (["full_attention"] * 4, 1),
    (["full_attention", "sliding_attention", "sliding_attention", "full_attention"], 3),
    (["full_attention", "sliding_attention", "full_attention", "sliding_attention"], 2),
    (["full_attention"] + ["sliding_attention"] * 3, 4),
])
def test_layer_types_become_global_every(tmp_path, types, every):
    d = write_dir(tmp_path / "m", {**MODERN_CONFIG, "num_hidden_layers": 4,
                                   "layer_types": types}, {})
    assert hf_model_fields(d)[1]["global_every"] == every


@pytest.mark.parametrize(("base", "change", "field"), [
    ("bert", {"architectures": ["RobertaForMaskedLM"]}, "architectures"),
    ("bert", {"hidden_act": "relu"}, "hidden_act"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ("bert", {"tie_word_embeddings": False}, "tie_word_embeddings"),
    ("bert", {"hidden_size": None}, "hidden_size"),
    ("modern", {"layer_types": ["full_attention", "full_attention", "sliding_attention"]},
     "layer_types"),
    ("modern", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     "layer_types"),
    ("modern", {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}},
     "rope_parameters.full_attention.rope_type"),
    ("modern", {"norm_bias": True}, "norm_bias/attention_bias/mlp_bias/classifier_bias"),
    ("modern", {"local_attention": 7}, "local_attention"),
])
def test_unrepresentable_config_fields_are_refused_by_name(tmp_path, base, change, field):
    config = {**(BERT_CONFIG if base == "bert" else MODERN_CONFIG), **change}
    d = write_dir(tmp_path / "m", config, {})
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'}: field {field!r}")):
        hf_model_fields(d)


# --- weights: refusals and digests --------------------------------------------------


def test_load_maps_and_records_every_file(bert_dir):
    tensors = bert_tensors()
    model, cfg, record = load_hf_model(bert_dir)
    state = model.state_dict()
    assert model.padded_vocab_size == 128 and state["embeddings.word_embeddings.weight"].shape \
        == (128, H)
    torch.testing.assert_close(state["embeddings.word_embeddings.weight"][:VOCAB],
                               tensors["bert.embeddings.word_embeddings.weight"], rtol=0, atol=0)
    assert state["embeddings.word_embeddings.weight"][VOCAB:].abs().sum() == 0
    # Token-type row 0 is folded into the positions.
    torch.testing.assert_close(
        state["embeddings.position_embeddings.weight"],
        tensors["bert.embeddings.position_embeddings.weight"]
        + tensors["bert.embeddings.token_type_embeddings.weight"][0], rtol=0, atol=0)
    qkv = state["layers.1.attention.qkv.weight"]
    for j, name in enumerate(("query", "key", "value")):
        assert torch.equal(qkv[j * H:(j + 1) * H],
                           tensors[f"bert.encoder.layer.1.attention.self.{name}.weight"])
    files = {"config.json": sha256(bert_dir / "config.json"),
             "model.safetensors": sha256(bert_dir / "model.safetensors")}
    assert record["files"] == files and record["hf_class"] == "BertForMaskedLM"
    lines = "".join(f"{k} {v}\n" for k, v in sorted(files.items()))
    assert record["digest"] == hashlib.sha256(lines.encode()).hexdigest()
    assert "row 0 added to the position embeddings" in record["token_type"]


def test_damaged_header_is_refused_naming_the_file(bert_dir):
    weights = bert_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{weights}: damaged safetensors header")):
        load_hf_model(bert_dir)
    data[:8] = (20).to_bytes(8, "little")  # a header length that cuts the JSON
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{weights}: damaged safetensors header "
                                                   "(not JSON")):
        load_hf_model(bert_dir)


def test_truncated_weights_are_refused_naming_the_tensor(bert_dir):
    weights = bert_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-40])
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(ValueError, match=re.escape(f"{weights}: truncated: tensor {last!r}")):
        load_hf_model(bert_dir)


def test_wrong_shape_missing_and_unexpected_tensors_are_refused(tmp_path):
    tensors = bert_tensors()
    wrong = {**tensors, "bert.encoder.layer.0.intermediate.dense.weight": torch.zeros(FFN + 1, H)}
    d = write_dir(tmp_path / "wrong", BERT_CONFIG, wrong)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensors of the wrong shape: "
                       r"bert\.encoder\.layer\.0\.intermediate\.dense\.weight: \(33, 16\), "
                       r"config\.json implies \(32, 16\)"):
        load_hf_model(d)
    missing = {k: v for k, v in tensors.items() if k != "cls.predictions.bias"}
    extra = {**tensors, "bert.encoder.layer.9.output.dense.weight": torch.zeros(H, FFN)}
    for name, state, said in (("missing", missing, "missing ['cls.predictions.bias']"),
                              ("extra", extra,
                               "unexpected ['bert.encoder.layer.9.output.dense.weight']")):
        d = write_dir(tmp_path / name, BERT_CONFIG, state)
        with pytest.raises(ValueError, match=re.escape(said)):
            load_hf_model(d)
    # A pre-training checkpoint's pooler and NSP head are ignored, as transformers does.
    pretraining = {**tensors, "bert.pooler.dense.weight": torch.zeros(H, H),
                   "cls.seq_relationship.weight": torch.zeros(2, H)}
    _, _, record = load_hf_model(write_dir(tmp_path / "pre", BERT_CONFIG, pretraining))
    assert record["ignored"] == ["bert.pooler.dense.weight", "cls.seq_relationship.weight"]


def test_missing_files_are_named(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'}: missing")):
        load_hf_model(d)
    (d / "config.json").write_text(json.dumps(BERT_CONFIG))
    with pytest.raises(ValueError, match=re.escape(f"{d.resolve()}: no weights (model."
                                                   "safetensors")):
        load_hf_model(d)
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(ValueError, match=re.escape(f"{d.resolve() / 'pytorch_model.bin'}: "
                                                   "unreadable weights")):
        load_hf_model(d)


def test_pytorch_bin_with_old_layernorm_names_loads_the_same(tmp_path, bert_dir):
    tensors = bert_tensors()
    old = {re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma",
                  re.sub(r"LayerNorm\.bias$", "LayerNorm.beta", k)): v
           for k, v in tensors.items()}
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BERT_CONFIG))
    torch.save(old, d / "pytorch_model.bin")
    a, _, _ = load_hf_model(d)
    b, _, _ = load_hf_model(bert_dir)
    for key, value in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key


# --- as a warm-start parent ------------------------------------------------------------


def test_resolve_init_and_weights_of_a_hf_parent(bert_dir):
    init = resolve_init(str(bert_dir))
    assert init.hf_class == "BertForMaskedLM" and init.step == 0
    assert init.digest == directory_digest({"config.json": sha256(bert_dir / "config.json"),
                                            "model.safetensors":
                                                sha256(bert_dir / "model.safetensors")})
    assert init.record()["hf_class"] == "BertForMaskedLM"
    assert init.record()["checkpoint"] == str(bert_dir.resolve())
    model, _, _ = load_hf_model(bert_dir)
    weights = init_weights(init)
    for key, value in model.state_dict().items():
        assert torch.equal(weights[key], value), key
    # A smaller tokenizer (V = 60): the rows are cut to ceil(60 / 64) * 64.
    cut = fit_vocab(weights, 60)
    assert cut["embeddings.word_embeddings.weight"].shape == (64, H)
    assert cut["head.decoder.bias"].shape == (64,)
    # The files changed since the parent was resolved: refused, the file named.
    (bert_dir / "config.json").write_text(json.dumps({**BERT_CONFIG, "initializer_range": 0.03}))
    with pytest.raises(ValueError, match=r"\['config.json'\] in .* changed since"):
        init_weights(init)


def test_load_config_takes_the_model_and_tokenizer_from_the_parent(bert_dir):
    cfg = load_config("tiny", [f"train.init_from={bert_dir}"])
    want = ModelConfig.model_validate(hf_model_fields(bert_dir)[1])
    assert cfg.model == want and cfg.model.preset == "bert"
    assert cfg.tokenizer.adopt_from == str(bert_dir) and not cfg.tokenizer.from_init
    # An override that agrees, and the training choices, are accepted.
    cfg = load_config("tiny", [f"train.init_from={bert_dir}", f"model.hidden_size={H}",
                               "model.dropout=0.0", "tokenizer.from_init=true"])
    assert cfg.model.dropout == 0.0 and cfg.tokenizer.adopt_from == str(bert_dir)


def test_conflicting_model_overrides_are_one_error_naming_each(bert_dir):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"train.init_from={bert_dir}", "model.hidden_size=64",
                             "model.num_heads=4", "model.preset=modern"])
    text = str(err.value)
    assert text.count("\n") == 0
    for said in ("--set model.hidden_size=64 (config.json: 16)",
                 "--set model.num_heads=4 (config.json: 2)",
                 "--set model.preset=modern (config.json: 'bert')", "BertForMaskedLM"):
        assert said in text


def test_a_whole_model_section_override_is_refused(bert_dir):
    with pytest.raises(ConfigError, match=re.escape("--set model={} (config.json gives the "
                                                    "whole section)")):
        load_config("tiny", [f"train.init_from={bert_dir}", "model={}"])


def test_a_sentencepiece_request_with_a_hf_parent_is_refused(bert_dir):
    with pytest.raises(ConfigError, match=r"--set tokenizer.vocab_size=500 asks for a "
                       "SentencePiece tokenizer"):
        load_config("tiny", [f"train.init_from={bert_dir}", "tokenizer.vocab_size=500"])


# --- parity with transformers (slow) ------------------------------------------------------

SEQ = 40  # beyond the ModernBERT window of 8


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{"bert": (BertForMaskedLM, dir), "modern": (ModernBertForMaskedLM, dir)}: random,
    saved by `save_pretrained`."""
    import transformers

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf-import")
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=MAX_POS, attn_implementation="sdpa"))
    with torch.no_grad():  # a published BERT's row 0 is far from zero
        bert.bert.embeddings.token_type_embeddings.weight.normal_()
    modern = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=MAX_POS, local_attention=8,
        layer_types=["full_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        attn_implementation="sdpa"))
    out = {}
    for name, model in (("bert", bert), ("modern", modern)):
        model.save_pretrained(root / name)
        out[name] = model.eval(), root / name
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "modern"])
def test_logits_equal_transformers_beyond_the_window(hf_models, kind):
    hf, path = hf_models[kind]
    ours, _, _ = load_hf_model(path)
    assert torch.count_nonzero(
        hf_models["bert"][0].bert.embeddings.token_type_embeddings.weight[0]) > 0
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, VOCAB, (3, SEQ), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 30:] = 0
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, attention_mask=attention_mask).logits
        mine = ours(input_ids, attention_mask).logits
    real = attention_mask.bool()
    assert mine.shape == theirs.shape == (3, SEQ, VOCAB)
    assert (mine[real] - theirs[real]).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "modern"])
def test_export_gives_the_original_state_dict_back(hf_models, kind):
    from mlm_pipeline.train.hf import to_hf

    hf, path = hf_models[kind]
    ours, _, _ = load_hf_model(path)
    back = to_hf(ours).state_dict()
    original = copy.deepcopy(hf.state_dict())
    assert type(to_hf(ours)).__name__ == type(hf).__name__
    if kind == "bert":  # row 0 now lives in the positions; the export writes zero types
        types = original.pop("bert.embeddings.token_type_embeddings.weight")
        original["bert.embeddings.position_embeddings.weight"] += types[0]
        assert back.pop("bert.embeddings.token_type_embeddings.weight").abs().sum() == 0
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0 if kind == "modern"
                                   or "position" not in key else 1e-6, msg=key)


#: bf16's unit roundoff: an 8-bit significand (7 stored bits and the implicit one) rounds
#: to within 2^-8 of a value's magnitude (IEEE 754-2008 binary16 aside, the bfloat16
#: format of Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training").
BF16_UNIT_ROUNDOFF = 2.0 ** -8
#: Roundings a logit's bf16 error may accumulate, in units of the roundoff times the
#: largest fp32 logit: under autocast the inputs of every matmul (attention, feed-forward,
#: head; accumulation stays fp32, norms and softmax run in fp32) are cast to bf16, each
#: cast an error of at most u of its input, and the 2 to 4 layers here compound a few of
#: them. Measured: 1.4 to 1.7 units from fp32, 0 to 0.7 apart (the docstring's figures);
#: 4 units leaves room for another CPU's kernels and is still far below what a mapping
#: error does (a wrong or missing tensor moves logits by their whole scale, 256 units).
BF16_ROUNDINGS = 4


def bf16_logits(model, input_ids, attention_mask):
    """Logits (rows, L, V) float32 of `model` under CPU bf16 autocast."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return out.float()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "modern"])
def test_bf16_logits_agree_with_transformers_within_bf16_rounding(hf_models, kind):
    """Ours and transformers, both in bf16 autocast on the same inputs (ModernBERT's 40
    tokens beyond its 8-token window), differ by no more than bf16 rounding of the logits'
    scale allows, and each stays that close to transformers' fp32 logits. Max abs logit
    differences measured (torch 2.13 CPU, AVX-512 BF16): BERT 0 apart in bf16 (the same
    roundings), 2.2e-3 from fp32 for both (max |logit| 0.33; fp32 parity 8.9e-8);
    ModernBERT 9.8e-4 apart in bf16, 1.9e-3 from fp32 for both (max |logit| 0.36; fp32
    parity 6.0e-8)."""
    hf, path = hf_models[kind]
    ours, _, _ = load_hf_model(path)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, VOCAB, (3, SEQ), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 30:] = 0
    real = attention_mask.bool()
    with torch.no_grad():
        reference = hf(input_ids=input_ids, attention_mask=attention_mask).logits[real]
    mine = bf16_logits(ours, input_ids, attention_mask)[real]
    theirs = bf16_logits(hf, input_ids, attention_mask)[real]
    bound = BF16_ROUNDINGS * BF16_UNIT_ROUNDOFF * reference.abs().max().item()
    apart = (mine - theirs).abs().max().item()
    assert not torch.equal(mine, reference)  # bf16 really ran: the logits moved
    assert apart <= bound, (apart, bound)
    assert (mine - reference).abs().max().item() <= bound
    assert (theirs - reference).abs().max().item() <= bound
