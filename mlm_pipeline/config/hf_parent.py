"""A published Hugging Face masked LM as a run's parent (`train.init_from` naming a
`save_pretrained` directory): what its `config.json` says the `model` section is, and the
run config that follows from it.

`hf_parent_class(path)` says whether a path is such a directory (a `config.json` whose
`architectures[0]` ends in `ForMaskedLM`). `hf_model_fields(path)` maps its `config.json`
onto `ModelConfig` fields, the inverse of `train.hf` (`BertForMaskedLM` -> the `bert`
preset, `ModernBertForMaskedLM` -> `modern`), refusing what `BertMLM` cannot compute,
naming the file and field. `apply_hf_parent(tree, overrides)` is what `load_config` does
with a config tree whose `train.init_from` is such a directory, once, before validation:

- the parent's `config.json` replaces the `model` section (a published parent defines the
  architecture); a `--set model.FIELD=...` that disagrees with it is one error naming every
  such field (`dropout` and `document_positions` excepted: training choices, not part of
  the weights' function at inference);
- the parent's tokenizer is adopted (`tokenizer.adopt_from` = the directory) unless the
  config adopts one itself; `tokenizer.from_init` means the same here; a `--set
  tokenizer.FIELD=...` asking for a SentencePiece tokenizer is an error (its ids would not
  be the parent's).

transformers' defaults apply to keys a `config.json` leaves out (`BertConfig`,
`ModernBertConfig` of transformers 5: `global_attn_every_n_layers` 3, `local_attention`
128, RoPE bases 160,000 global and 10,000 local). This module imports neither torch nor
transformers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mlm_pipeline.config.stages import ModelConfig
from mlm_pipeline.errors import ConfigError

logger = logging.getLogger(__name__)

#: The file `save_pretrained` writes the model's config to.
HF_CONFIG = "config.json"
#: The masked-LM classes a parent may be, and the preset each maps onto.
HF_PRESETS = {"BertForMaskedLM": "bert", "ModernBertForMaskedLM": "modern"}
#: `model` fields a run may set apart from its parent's `config.json`.
FREE_FIELDS = frozenset({"dropout", "document_positions"})
#: `tokenizer` fields that do not ask for a SentencePiece tokenizer.
_TOKENIZER_ADOPT_FIELDS = frozenset({"adopt_from", "from_init"})
#: transformers' `ModernBertConfig` defaults for keys older files leave out.
_MODERN_DEFAULTS = {"global_attn_every_n_layers": 3, "local_attention": 128,
                    "global_rope_theta": 160_000.0, "local_rope_theta": 10_000.0}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of directory `path`.

    Raises:
        ValueError: the file is missing, not UTF-8 JSON, or not a JSON object (named).
    """
    file = Path(path).expanduser() / HF_CONFIG
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{file}: missing (a save_pretrained directory has one)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def hf_parent_class(path: str | Path) -> str | None:
    """The masked-LM class of a `save_pretrained` directory: `architectures[0]` of its
    `config.json` when it ends in `ForMaskedLM` (supported or not: `hf_model_fields`
    refuses an unknown one); None for anything else (no directory, no `config.json`, no
    such entry: one of our checkpoints or run directories, an MLflow SOURCE).

    Raises:
        ValueError: `config.json` is there but is not a JSON object.
    """
    p = Path(path).expanduser()
    if not (p / HF_CONFIG).is_file() or (p / "state.json").is_file():
        return None
    arch = read_hf_config(p).get("architectures")
    first = arch[0] if isinstance(arch, list) and arch else None
    return first if isinstance(first, str) and first.endswith("ForMaskedLM") else None


def _refuse(file: Path, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{file}: field {field!r} = {value!r}: {why}")


def _layers_global_every(file: Path, types: Any, num_layers: int) -> int:
    """`global_every` of a ModernBERT `layer_types` list: layer 0 and every n-th after it
    `full_attention`, the others `sliding_attention` (n = num_layers when layer 0 alone is
    global, 1 when every layer is).

    Raises:
        ValueError: another pattern (`layer_types` named).
    """
    if not isinstance(types, list) or len(types) != num_layers:
        raise _refuse(file, "layer_types", types, f"not a list of {num_layers} layer types")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    n = full[1] if len(full) > 1 else num_layers
    want = ["sliding_attention" if i % n else "full_attention" for i in range(num_layers)]
    if types != want:
        raise _refuse(file, "layer_types", types, "not a pattern of one full_attention layer "
                      "every n layers from layer 0 (model.global_every), the others "
                      "sliding_attention")
    return n


def _rope_bases(file: Path, hf: dict[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE bases from `rope_parameters` (transformers 5) or
    `global_rope_theta` / `local_rope_theta` (earlier files), transformers' defaults
    otherwise.

    Raises:
        ValueError: a RoPE type other than `default` or a rope scaling (named).
    """
    if hf.get("rope_scaling") not in (None, {}):
        raise _refuse(file, "rope_scaling", hf["rope_scaling"], "scaled RoPE is not computed "
                      "by this pipeline")
    params = hf.get("rope_parameters") or {}
    bases = []
    for kind, old in (("full_attention", "global_rope_theta"),
                      ("sliding_attention", "local_rope_theta")):
        entry = params.get(kind) or {}
        rope_type = entry.get("rope_type", "default")
        if rope_type != "default":
            raise _refuse(file, f"rope_parameters.{kind}.rope_type", rope_type,
                          "only the default RoPE is computed by this pipeline")
        if entry.get("partial_rotary_factor", 1.0) != 1.0:
            raise _refuse(file, f"rope_parameters.{kind}.partial_rotary_factor",
                          entry["partial_rotary_factor"], "partial RoPE is not computed")
        bases.append(float(entry.get("rope_theta", hf.get(old, _MODERN_DEFAULTS[old]))))
    return bases[0], bases[1]


def _require(file: Path, hf: dict[str, Any], **wants: Any) -> None:
    """Refuse the first field whose value (its wanted value when absent) is another."""
    for field, want in wants.items():
        if (value := hf.get(field, want)) != want:
            raise _refuse(file, field, value, f"this pipeline computes only {want!r}")


def _bert_fields(file: Path, hf: dict[str, Any]) -> dict[str, Any]:
    _require(file, hf, hidden_act="gelu", position_embedding_type="absolute", is_decoder=False,
             add_cross_attention=False)
    return {"preset": "bert", "layer_norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
            "dropout": float(hf.get("hidden_dropout_prob", 0.1))}


def _modern_fields(file: Path, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    _require(file, hf, hidden_activation="gelu", classifier_activation="gelu",
             decoder_bias=True)
    biases = {f: bool(hf.get(f, False)) for f in
              ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias")}
    if len(set(biases.values())) > 1:
        raise _refuse(file, "norm_bias/attention_bias/mlp_bias/classifier_bias", biases,
                      "one model.bias covers all four: they must be equal")
    hf = {**_MODERN_DEFAULTS, **hf}  # transformers' defaults for the keys left out
    if hf.get("layer_types") is not None:
        every = _layers_global_every(file, hf["layer_types"], num_layers)
    else:
        every = hf["global_attn_every_n_layers"]
        if not isinstance(every, int) or every < 1:
            raise _refuse(file, "global_attn_every_n_layers", every, "not a positive integer")
    window = hf["local_attention"]
    if not isinstance(window, int) or window < 2 or window % 2:
        raise _refuse(file, "local_attention", window, "not an even window of >= 2 tokens")
    rope, local_rope = _rope_bases(file, hf)
    dropout = max(float(hf.get(f, 0.0)) for f in
                  ("embedding_dropout", "attention_dropout", "mlp_dropout"))
    return {"preset": "modern", "bias": next(iter(biases.values())),
            "layer_norm_eps": float(hf.get("norm_eps", 1e-5)), "dropout": dropout,
            "global_every": min(every, num_layers) if num_layers > 1 else 1,
            "local_attention_window": window, "rope_base": rope, "local_rope_base": local_rope}


def hf_model_fields(path: str | Path) -> tuple[str, dict[str, Any], dict[str, int]]:
    """Map the `config.json` of a `save_pretrained` masked-LM directory onto `ModelConfig`.

    Returns:
        (class name, `ModelConfig` fields: the preset and every field it computes with,
        {"vocab_size": rows of its embedding table, "max_position_embeddings": its longest
        input, tokens}).

    Raises:
        ValueError: naming the file and field: missing or damaged `config.json`, a class
            other than `HF_PRESETS`, a missing size, or a value `BertMLM` cannot compute
            (another activation, position type, a `layer_types` pattern not of
            `model.global_every`'s form, unequal ModernBERT bias options, scaled RoPE,
            untied word embeddings).
    """
    file = Path(path).expanduser() / HF_CONFIG
    hf = read_hf_config(path)
    arch = hf.get("architectures")
    hf_class = arch[0] if isinstance(arch, list) and arch else arch
    if hf_class not in HF_PRESETS:
        raise _refuse(file, "architectures", arch, f"not one of {sorted(HF_PRESETS)}")
    sizes = {}
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings"):
        value = hf.get(field)
        if type(value) is not int or value < 1:
            raise _refuse(file, field, value, "missing or not a positive integer")
        sizes[field] = value
    _require(file, hf, tie_word_embeddings=True)
    fields = {"hidden_size": sizes["hidden_size"], "num_layers": sizes["num_hidden_layers"],
              "num_heads": sizes["num_attention_heads"],
              "intermediate_size": sizes["intermediate_size"],
              "initializer_range": float(hf.get("initializer_range", 0.02))}
    if hf_class == "BertForMaskedLM":
        fields |= _bert_fields(file, hf)
    else:
        fields |= _modern_fields(file, hf, sizes["num_hidden_layers"])
    return hf_class, fields, {"vocab_size": sizes["vocab_size"],
                              "max_position_embeddings": sizes["max_position_embeddings"]}


def _resolved(fields: dict[str, Any]) -> dict[str, Any]:
    return ModelConfig.model_validate(fields).model_dump()


def apply_hf_parent(tree: dict[str, Any], origin: dict[tuple[str, ...], str]) -> dict[str, Any]:
    """`tree` (a config as loaded, overrides applied) with the `model` and `tokenizer`
    sections a Hugging Face parent implies (module docstring); `tree` itself when
    `train.init_from` is not such a directory.

    Args:
        tree: the config mapping before validation.
        origin: dotted key -> the `--set` item that set it (the user's overrides).

    Raises:
        ConfigError: one message naming every `--set model.FIELD` that disagrees with the
            parent's `config.json`, or a `--set tokenizer.FIELD` asking for SentencePiece;
            the errors of `hf_model_fields` (the file and field named).
    """
    train = tree.get("train")
    source = train.get("init_from") if isinstance(train, dict) else None
    if not isinstance(source, str):
        return tree
    try:
        hf_class = hf_parent_class(source)
        if hf_class is None:
            return tree
        hf_class, fields, _ = hf_model_fields(source)
        parent = _resolved(fields)
    except ValueError as exc:
        raise ConfigError(f"train.init_from {source!r}: {exc}") from None
    model = dict(fields)
    wrong = []
    for key, item in sorted(origin.items()):
        if key == ("model",):
            wrong.append(f"--set {item} (config.json gives the whole section)")
        if len(key) != 2 or key[0] != "model":
            continue
        field, value = key[1], (tree.get("model") or {}).get(key[1])
        if field in FREE_FIELDS:
            model[field] = value
            continue
        try:
            mine = _resolved({**fields, field: value}).get(field, value)
        except ValueError:
            mine = value
        if field not in parent or mine != parent[field]:
            wrong.append(f"--set {item} (config.json: {parent.get(field, 'no such field')!r})")
    if wrong:
        raise ConfigError(
            f"train.init_from {source!r} is a Hugging Face {hf_class} whose config.json "
            "defines the model; these overrides disagree with it: " + "; ".join(wrong)
            + " (drop them, or start from random weights)")
    sentencepiece = [item for key, item in sorted(origin.items())
                     if len(key) == 2 and key[0] == "tokenizer"
                     and key[1] not in _TOKENIZER_ADOPT_FIELDS]
    tokenizer = dict(tree.get("tokenizer") or {})
    if tokenizer.get("adopt_from") is None and sentencepiece:
        raise ConfigError(
            f"train.init_from {source!r} is a Hugging Face {hf_class}: its tokenizer is "
            f"adopted (its ids are the weights'); {', '.join('--set ' + s for s in sentencepiece)}"
            " asks for a SentencePiece tokenizer, whose vocabulary would not match")
    if tokenizer.pop("from_init", False) or tokenizer.get("adopt_from") is None:
        tokenizer["adopt_from"] = source
    logger.info("train.init_from %s is a Hugging Face %s: its config.json replaces the model "
                "section (%s) and the tokenizer is adopted from %s", source, hf_class,
                model, tokenizer["adopt_from"])
    return {**tree, "model": model, "tokenizer": tokenizer}
