"""Export a `bert`-preset `BertMLM` to Hugging Face `BertForMaskedLM`.

The `bert` preset (post-LN, learned positions, GELU, biases) is BERT itself (Devlin et al.
2019), so its weights map one to one onto `transformers`' BERT, except:

- our fused `qkv` projection (rows: all query heads, then keys, then values) is split into
  `query`, `key`, `value`;
- HF BERT adds token-type embeddings: exported as zeros, so they add nothing;
- our word-embedding table is padded to a multiple of 64 rows, which our model never looks
  up and slices off its logits; the export keeps the V real rows (`vocab_size` = V), so
  logits and softmax (hence loss) equal ours at every real id.

`transformers` is an optional dependency: it is imported inside the functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from mlm_pipeline.config import PAD_ID
from mlm_pipeline.train.model import BertMLM

if TYPE_CHECKING:  # pragma: no cover
    from transformers import BertConfig, BertForMaskedLM

#: Segment ids HF BERT accepts (its default); their embeddings are exported as zeros.
TYPE_VOCAB_SIZE = 2

#: Config fields and the value HF BERT requires.
_BERT_COMPATIBLE = {"norm": "post", "position": "learned", "activation": "gelu", "bias": True}


def check_bert_compatible(model: BertMLM) -> None:
    """Check that `model` has BERT's architecture.

    Raises:
        ValueError: naming every `ModelConfig` field whose value HF BERT cannot express.
    """
    wrong = [f"model.{field}={getattr(model.cfg, field)!r} (BERT needs {want!r})"
             for field, want in _BERT_COMPATIBLE.items() if getattr(model.cfg, field) != want]
    if wrong:
        raise ValueError("model is not Hugging Face BERT compatible: " + ", ".join(wrong))


def hf_bert_config(model: BertMLM) -> BertConfig:
    """The `transformers.BertConfig` of `model`'s shape (SDPA attention, exact GELU).

    Raises:
        ValueError: the model is not BERT-compatible (see `check_bert_compatible`).
    """
    from transformers import BertConfig

    check_bert_compatible(model)
    cfg = model.cfg
    return BertConfig(
        vocab_size=model.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_act="gelu",  # exact erf form, as ours (nn.GELU())
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=model.seq_len,
        type_vocab_size=TYPE_VOCAB_SIZE,
        initializer_range=cfg.initializer_range,
        layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


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
        for name, w, b in zip(("query", "key", "value"),
                              src[ours + "attention.qkv.weight"].chunk(3, dim=0),
                              src[ours + "attention.qkv.bias"].chunk(3, dim=0)):
            out[f"{theirs}attention.self.{name}.weight"] = w.contiguous()
            out[f"{theirs}attention.self.{name}.bias"] = b.contiguous()
        pairs = {
            "attention.output.dense": "attention.out",
            "attention.output.LayerNorm": "attention_norm",
            "intermediate.dense": "ffn.0",
            "output.dense": "ffn.2",
            "output.LayerNorm": "ffn_norm",
        }
        for hf_name, our_name in pairs.items():
            for kind in ("weight", "bias"):
                out[f"{theirs}{hf_name}.{kind}"] = src[f"{ours}{our_name}.{kind}"]
    for kind in ("weight", "bias"):
        out[f"cls.predictions.transform.dense.{kind}"] = src[f"head.transform.0.{kind}"]
        out[f"cls.predictions.transform.LayerNorm.{kind}"] = src[f"head.transform.2.{kind}"]
    out["cls.predictions.decoder.weight"] = word  # tied to the word embeddings in HF too
    out["cls.predictions.bias"] = src["head.decoder.bias"][:v]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]  # tied in HF
    return out


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
    state = hf_bert_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # Buffers (position_ids, token_type_ids) are derived, not ours to provide.
    missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise RuntimeError(f"HF BERT mapping incomplete: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()
