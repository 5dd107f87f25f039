"""Map `BertMLM` onto Hugging Face masked-LM classes: `bert` -> `BertForMaskedLM`,
`modern` -> `ModernBertForMaskedLM`, weight for weight.

The `bert` preset (post-LN, learned positions, GELU, biases) is BERT itself (Devlin et al.
2019), so its weights map one to one onto `transformers`' BERT, except that our fused `qkv`
(rows: all query heads, then keys, then values) is split into `query`, `key`, `value`, and
HF BERT's token-type embeddings are exported as zeros, so they add nothing.

The `modern` preset (pre-LN, RoPE, GeGLU, no biases) is ModernBERT (Warner et al. 2024) as
transformers implements it (`models/modernbert/modeling_modernbert.py`), its attention
layout included: `layer_types` says which layers are global (`model.global_every`; every
layer global for a checkpoint trained before the layout existed), `local_attention` the
window and `rope_parameters` the two RoPE bases. Every tensor maps to one HF tensor under
another name (`modern_name`), nothing split or added: fused `Wqkv` rows [q | k | v] with
heads contiguous, `Wi` rows [gelu input | gate], no attention LayerNorm in layer 0 (HF
`attn_norm` is Identity there), `final_norm`, head `dense` + GELU + `norm`, tied `decoder`
with its bias. RoPE is the half-split `rotate_half` convention in both, with bit-identical
fp32 tables (`attention.rope_tables`); under bf16 autocast we rotate in bf16 where HF
rotates in fp32 (rounding only, for speed).

For both, the export keeps only the V real rows of our padded word-embedding table
(`vocab_size` = V), so logits and softmax (hence loss) equal ours at every real id.
`transformers` is imported inside the functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from mlm_pipeline.config import CLS_ID, PAD_ID, SEP_ID, ModelConfig
from mlm_pipeline.train.model import BertMLM

if TYPE_CHECKING:  # pragma: no cover
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        ModernBertConfig,
        ModernBertForMaskedLM,
        PreTrainedModel,
    )

#: Segment ids HF BERT accepts (its default); their embeddings are exported as zeros.
TYPE_VOCAB_SIZE = 2

#: The `transformers` masked-LM class of each architecture, and the `ModelConfig` field
#: values it requires (ModernBERT's biases are options: `bias` maps onto all of them).
HF_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "BertForMaskedLM": {"norm": "post", "position": "learned", "activation": "gelu",
                        "bias": True, "global_every": 1},
    "ModernBertForMaskedLM": {"norm": "pre", "position": "rope", "activation": "geglu"},
}
#: The class each `model.preset` maps to.
HF_CLASSES: dict[str, str] = {"bert": "BertForMaskedLM", "modern": "ModernBertForMaskedLM"}


def hf_class_name(cfg: ModelConfig) -> str | None:
    """The `transformers` class whose architecture `cfg` has (`HF_ARCHITECTURES`), decided
    by the fields (a preset with overridden fields may have none); None when no class has
    it."""
    for name, want in HF_ARCHITECTURES.items():
        if all(getattr(cfg, field) == value for field, value in want.items()):
            return name
    return None


def check_compatible(cfg: ModelConfig, hf_class: str) -> None:
    """Check that `cfg` has the architecture of `hf_class` (a key of `HF_ARCHITECTURES`).

    Raises:
        ValueError: naming every `ModelConfig` field whose value the class cannot express.
    """
    wrong = [f"model.{field}={getattr(cfg, field)!r} ({hf_class} needs {want!r})"
             for field, want in HF_ARCHITECTURES[hf_class].items()
             if getattr(cfg, field) != want]
    if wrong:
        raise ValueError(f"model is not Hugging Face {hf_class} compatible: "
                         + ", ".join(wrong))


def check_bert_compatible(model: BertMLM) -> None:
    """Check that `model` has BERT's architecture.

    Raises:
        ValueError: naming every `ModelConfig` field whose value HF BERT cannot express.
    """
    check_compatible(model.cfg, "BertForMaskedLM")


def hf_bert_config(model: BertMLM) -> BertConfig:
    """The `transformers.BertConfig` of `model`'s shape (SDPA attention, exact GELU).

    Raises:
        ValueError: the model is not BERT-compatible (see `check_bert_compatible`).
    """
    from transformers import BertConfig

    check_bert_compatible(model)
    cfg = model.cfg
    return BertConfig(
        vocab_size=model.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_act="gelu",  # exact erf form, as ours (nn.GELU())
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=model.seq_len, type_vocab_size=TYPE_VOCAB_SIZE,
        initializer_range=cfg.initializer_range, layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=PAD_ID, tie_word_embeddings=True, attn_implementation="sdpa",
    )


#: The names of HF BERT's three attention projections, in our fused `qkv`'s row order.
BERT_QKV = ("query", "key", "value")


def bert_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(HF BERT name, our name) of every layer and head tensor that maps one to one (the
    embeddings, `qkv` and the tied decoder are mapped by hand)."""
    blocks = {"attention.output.dense": "attention.out",
              "attention.output.LayerNorm": "attention_norm", "intermediate.dense": "ffn.0",
              "output.dense": "ffn.2", "output.LayerNorm": "ffn_norm"}
    pairs = [(f"bert.encoder.layer.{i}.{hf_name}.{kind}", f"layers.{i}.{our_name}.{kind}")
             for i in range(num_layers) for hf_name, our_name in blocks.items()
             for kind in ("weight", "bias")]
    for kind in ("weight", "bias"):
        pairs += [(f"cls.predictions.transform.dense.{kind}", f"head.transform.0.{kind}"),
                  (f"cls.predictions.transform.LayerNorm.{kind}", f"head.transform.2.{kind}")]
    return pairs


def hf_bert_state_dict(model: BertMLM) -> dict[str, Tensor]:
    """`BertForMaskedLM` state dict (detached copies) holding `model`'s weights.

    Returns:
        Parameter name -> tensor, fp32 as in `model`; word embeddings and decoder bias
        cut to the V real rows, token-type embeddings zero (2, H).

    Raises:
        ValueError: the model is not BERT-compatible (see `check_bert_compatible`).
    """
    check_bert_compatible(model)
    v, h = model.vocab_size, model.cfg.hidden_size
    src = {k: t.detach().clone() for k, t in model.state_dict().items()}
    word = src["embeddings.word_embeddings.weight"][:v]
    out = {
        "bert.embeddings.word_embeddings.weight": word,
        "bert.embeddings.position_embeddings.weight": src["embeddings.position_embeddings.weight"],
        "bert.embeddings.token_type_embeddings.weight": word.new_zeros(TYPE_VOCAB_SIZE, h),
        "bert.embeddings.LayerNorm.weight": src["embeddings.layer_norm.weight"],
        "bert.embeddings.LayerNorm.bias": src["embeddings.layer_norm.bias"],
    }
    for i in range(model.cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        # Our qkv rows are [query (H) | key (H) | value (H)], heads contiguous within each.
        for name, w, b in zip(BERT_QKV,
                              src[ours + "attention.qkv.weight"].chunk(3, dim=0),
                              src[ours + "attention.qkv.bias"].chunk(3, dim=0)):
            out[f"{theirs}attention.self.{name}.weight"] = w.contiguous()
            out[f"{theirs}attention.self.{name}.bias"] = b.contiguous()
    for hf_name, our_name in bert_pairs(model.cfg.num_layers):
        out[hf_name] = src[our_name]
    out["cls.predictions.decoder.weight"] = word  # tied to the word embeddings in HF too
    out["cls.predictions.bias"] = src["head.decoder.bias"][:v]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]  # tied in HF
    return out


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    """ModernBERT's `layer_types` of `cfg`: `full_attention` for a global layer
    (`cfg.is_global`), `sliding_attention` for a local one (transformers builds the same
    list from `global_attn_every_n_layers`: local when `i % n`)."""
    return ["full_attention" if cfg.is_global(i) else "sliding_attention"
            for i in range(cfg.num_layers)]


def hf_modernbert_config(model: BertMLM) -> ModernBertConfig:
    """The `transformers.ModernBertConfig` of `model`'s shape: `layer_types` from
    `global_every`, `local_attention` = `local_attention_window` (HF's sliding mask lets a
    query see keys at most `local_attention // 2` away, as ours), RoPE bases `rope_base`
    (global layers) and `local_rope_base` (local), exact GELU, every bias option = `bias`,
    `decoder_bias` on, each dropout = `dropout`, our special ids, SDPA attention, dense
    logits (`sparse_prediction` off, as pipelines expect).

    Raises:
        ValueError: the model is not ModernBERT-compatible (see `check_compatible`).
    """
    from transformers import ModernBertConfig

    cfg = model.cfg
    check_compatible(cfg, "ModernBertForMaskedLM")
    return ModernBertConfig(
        vocab_size=model.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_activation="gelu",  # exact erf form, as ours (F.gelu)
        classifier_activation="gelu", max_position_embeddings=model.seq_len,
        initializer_range=cfg.initializer_range, norm_eps=cfg.layer_norm_eps,
        norm_bias=cfg.bias, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        classifier_bias=cfg.bias, decoder_bias=True,
        layer_types=hf_layer_types(cfg), local_attention=cfg.local_attention_window,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_base},
        },
        embedding_dropout=cfg.dropout, attention_dropout=cfg.dropout, mlp_dropout=cfg.dropout,
        pad_token_id=PAD_ID, bos_token_id=CLS_ID, cls_token_id=CLS_ID, eos_token_id=SEP_ID,
        sep_token_id=SEP_ID, tie_word_embeddings=True, attn_implementation="sdpa",
    )


def modern_name(key: str) -> str:
    """The `ModernBertForMaskedLM` name of one of our `modern` state-dict keys."""
    renames = [  # (our prefix, theirs), first match wins
        ("embeddings.word_embeddings.", "model.embeddings.tok_embeddings."),
        ("embeddings.layer_norm.", "model.embeddings.norm."),
        ("final_norm.", "model.final_norm."),
        ("head.transform.0.", "head.dense."),
        ("head.transform.2.", "head.norm."),
        ("head.decoder.", "decoder."),
    ]
    for ours, theirs in renames:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    _, i, rest = key.split(".", 2)  # layers.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    blocks = {"attention_norm": "attn_norm", "attention.qkv": "attn.Wqkv",
              "attention.out": "attn.Wo", "ffn_norm": "mlp_norm", "ffn.0": "mlp.Wi",
              "ffn.2": "mlp.Wo"}
    return f"model.layers.{i}.{blocks[module]}.{kind}"


def hf_modernbert_state_dict(model: BertMLM) -> dict[str, Tensor]:
    """`ModernBertForMaskedLM` state dict (detached copies) holding `model`'s weights, one
    HF tensor per tensor of ours.

    Returns:
        Parameter name -> tensor, fp32 as in `model`; token embeddings (= tied decoder
        weight) and decoder bias cut to the V real rows.

    Raises:
        ValueError: the model is not ModernBERT-compatible (see `check_compatible`).
    """
    check_compatible(model.cfg, "ModernBertForMaskedLM")
    v = model.vocab_size
    out = {}
    for key, tensor in model.state_dict().items():
        if key == "head.decoder.weight":  # the word-embedding table (tied)
            continue
        if key in ("embeddings.word_embeddings.weight", "head.decoder.bias"):
            tensor = tensor[:v]
        out[modern_name(key)] = tensor.detach().clone()
    out["decoder.weight"] = out["model.embeddings.tok_embeddings.weight"]
    return out


def _load_exactly(hf: PreTrainedModel, state: dict[str, Tensor], derived: tuple[str, ...],
                  hf_class: str) -> PreTrainedModel:
    """Load `state` into `hf`, tie its weights, eval mode.

    Raises:
        RuntimeError: a parameter of `hf` is not in `state` or a key of `state` is not in
            `hf` (buffers ending in `derived` excepted).
    """
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(derived)]
    if missing or unexpected:
        raise RuntimeError(f"HF {hf_class} mapping incomplete: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def to_hf_bert(model: BertMLM) -> BertForMaskedLM:
    """A `transformers.BertForMaskedLM` computing the same function as `model`.

    The returned model is on the CPU, fp32, in eval mode; given the same `input_ids` (and
    `attention_mask`), its logits equal ours at the real ids (up to float rounding).

    Raises:
        ValueError: the model is not BERT-compatible (see `check_bert_compatible`).
        RuntimeError: `transformers` expects parameters the mapping does not provide
            (a transformers version with a different BERT layout).
    """
    from transformers import BertForMaskedLM

    hf = BertForMaskedLM(hf_bert_config(model))
    # Buffers (position_ids, token_type_ids) are derived, not ours to provide.
    return _load_exactly(hf, hf_bert_state_dict(model), ("position_ids", "token_type_ids"),
                         "BertForMaskedLM")


def to_hf_modernbert(model: BertMLM) -> ModernBertForMaskedLM:
    """A `transformers.ModernBertForMaskedLM` computing the same function as `model`
    (CPU, fp32, eval mode); its logits equal ours at the real ids up to float rounding.

    Raises:
        ValueError: the model is not ModernBERT-compatible (see `check_compatible`).
        RuntimeError: `transformers` expects parameters the mapping does not provide.
    """
    from transformers import ModernBertForMaskedLM

    hf = ModernBertForMaskedLM(hf_modernbert_config(model))
    return _load_exactly(hf, hf_modernbert_state_dict(model), (), "ModernBertForMaskedLM")


def to_hf(model: BertMLM) -> PreTrainedModel:
    """`model` as the `transformers` class of its architecture (`hf_class_name`), CPU,
    fp32, eval mode, with `config.architectures` set to that class.

    Raises:
        ValueError: no Hugging Face class has the model's architecture (the fields that
            differ from the preset's class, BERT's without a preset, are named).
        RuntimeError: `transformers` expects parameters the mapping does not provide.
    """
    hf_class = hf_class_name(model.cfg)
    if hf_class is None:
        check_compatible(model.cfg, HF_CLASSES.get(model.cfg.preset or "bert"))
    hf = to_hf_bert(model) if hf_class == "BertForMaskedLM" else to_hf_modernbert(model)
    hf.config.architectures = [hf_class]
    return hf
