"""Load a Hugging Face masked LM (`save_pretrained` directory) as a `BertMLM`: the inverse
of `train.hf`, for continuing the pretraining of a published encoder on one's own corpus
(domain-adaptive pretraining: Gururangan et al. 2020, "Don't Stop Pretraining"; what
transformers' `run_mlm.py --model_name_or_path` does).

`load_hf_model(path)` maps `config.json` (`config.hf_parent.hf_model_fields`) and the
weights (`model.safetensors`, a sharded index, or `pytorch_model.bin` through
`torch.load(weights_only=True)`), checks every tensor's name and shape against the class,
and maps them name for name onto ours:

- HF BERT's `query`, `key`, `value` are fused into our `qkv` (rows [q | k | v]);
- HF BERT's token-type embeddings: this pipeline feeds no segment ids, so HF computes
  with row 0 everywhere; row 0 is added to every row of the position table, which gives
  the same sum `word + position + type[0]` before the embedding LayerNorm (logits
  unchanged up to fp32 rounding), and the other rows (segment B) are dropped;
- the word-embedding table (= the tied decoder) and decoder bias get zero rows up to a
  multiple of 64 (`model.VOCAB_PAD_MULTIPLE`), rows our model never looks up;
- BERT's pooler and next-sentence head and the `position_ids` buffer are ignored, as
  `BertForMaskedLM.from_pretrained` ignores them; old `LayerNorm.gamma/beta` names are
  read as `weight/bias`, as transformers does.

Nothing is trusted unread: a safetensors header is checked against the file's size before
a tensor is read, and the parent's identity is the digest over the sha256 of every file
read (`directory_digest`). Every refusal names the file and the field or tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mlm_pipeline.config import ModelConfig
from mlm_pipeline.config.hf_parent import HF_CONFIG, hf_model_fields
from mlm_pipeline.manifest import sha256_file
from mlm_pipeline.tokenizer.pretrained import COMPANION_FILES, TOKENIZER_JSON
from mlm_pipeline.train.hf import BERT_QKV, bert_pairs, modern_name
from mlm_pipeline.train.model import VOCAB_PAD_MULTIPLE, BertMLM

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
#: Tokenizer files `save_pretrained` writes beside a model (hashed when present): the
#: files the tokenizer adoption reads (`tokenizer.pretrained`).
TOKENIZER_FILES = (TOKENIZER_JSON, *COMPANION_FILES)
#: Tensors a masked LM's file may carry that it does not compute with.
_IGNORED = re.compile(r"^(bert\.pooler\.|cls\.seq_relationship\.|.*position_ids$)")
#: Tied copies of the word embeddings / decoder bias, present or not in a file.
_TIED = {"BertForMaskedLM": ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"),
         "ModernBertForMaskedLM": ("decoder.weight",)}
_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
           "U8": 1, "BOOL": 1}


def weight_files(path: Path) -> list[Path]:
    """The weight files of directory `path`: `model.safetensors`, the shards a
    `model.safetensors.index.json` names, else `pytorch_model.bin`.

    Raises:
        ValueError: none of them, or an index that is not JSON or names a missing shard.
    """
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index (weight_map: {exc})") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"{index}: names missing shard files {missing}")
        return [index, *(path / s for s in shards)]
    if (path / PYTORCH_BIN).is_file():
        return [path / PYTORCH_BIN]
    raise ValueError(f"{path}: no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or "
                     f"{PYTORCH_BIN})")


def parent_files(path: str | Path) -> dict[str, str]:
    """File name -> sha256 (hex) of every file `load_hf_model(path)` reads: `config.json`,
    the weight files, the tokenizer files present.

    Raises:
        ValueError: `config.json` or the weights are missing (`weight_files`).
    """
    path = Path(path).expanduser().resolve()
    if not (path / HF_CONFIG).is_file():
        raise ValueError(f"{path / HF_CONFIG}: missing (a save_pretrained directory has one)")
    files = [path / HF_CONFIG, *weight_files(path),
             *(path / n for n in TOKENIZER_FILES if (path / n).is_file())]
    return {f.name: sha256_file(f) for f in files}


def directory_digest(files: dict[str, str]) -> str:
    """The parent's identity: sha256 (hex) of the sorted `name sha256` lines of `files`."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_safetensors(file: Path) -> None:
    """Check a safetensors file's header against its size: an 8-byte little-endian header
    length, a JSON header, every tensor's `data_offsets` inside the data and of the size
    its dtype and shape need.

    Raises:
        ValueError: naming the file and the tensor or field: damaged header, truncated
            data, a size that does not match.
    """
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: damaged safetensors header (file of {size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ValueError(f"{file}: damaged safetensors header (header length {n} > "
                             f"the file's {size - 8} bytes) or truncated file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: damaged safetensors header (not JSON: {exc})") from None
    data = size - 8 - n
    if not isinstance(header, dict):
        raise ValueError(f"{file}: damaged safetensors header (not a JSON object)")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            need = math.prod(entry["shape"]) * _DTYPES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: damaged safetensors header (tensor {name!r}: "
                             f"{entry!r})") from None
        if end > data:
            raise ValueError(f"{file}: truncated: tensor {name!r} ends at byte {end} of the "
                             f"data, which has {data}")
        if end - begin != need:
            raise ValueError(f"{file}: damaged safetensors header: tensor {name!r} spans "
                             f"{end - begin} bytes, its {entry['dtype']} shape "
                             f"{entry['shape']} needs {need}")


def read_weights(files: list[Path]) -> dict[str, Tensor]:
    """Name -> tensor (CPU, as stored) of the weight files (`weight_files`).

    Raises:
        ValueError: a damaged or truncated file (named; `check_safetensors`), or a `.bin`
            that `torch.load(weights_only=True)` cannot read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, Tensor] = {}
    for file in files:
        if file.name == SAFETENSORS_INDEX:
            continue
        if file.suffix == ".safetensors":
            check_safetensors(file)
            try:
                out.update(load_file(file, device="cpu"))
            except SafetensorError as exc:
                raise ValueError(f"{file}: unreadable safetensors file ({exc})") from None
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 -- truncated zip, pickle refused, ...
                raise ValueError(f"{file}: unreadable weights ({type(exc).__name__}: "
                                 f"{exc})") from None
            if not isinstance(state, dict):
                raise ValueError(f"{file}: not a state dict")
            out.update(state)
    return {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight",
                   re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v for k, v in out.items()}


def _expected(model: BertMLM, hf_class: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor `hf_class` computes with, for `model`'s shape."""
    from mlm_pipeline.train.hf import hf_bert_state_dict, hf_modernbert_state_dict

    state = (hf_bert_state_dict(model) if hf_class == "BertForMaskedLM"
             else hf_modernbert_state_dict(model))
    return {k: tuple(t.shape) for k, t in state.items()}


def _check_names(hf: dict[str, Tensor], expected: dict[str, tuple[int, ...]], hf_class: str,
                 where: str) -> list[str]:
    """Refuse missing, unexpected or misshapen tensors; the ignored names (sorted).

    Raises:
        ValueError: naming the weights file and every such tensor.
    """
    tied = _TIED[hf_class]
    ignored = sorted(k for k in hf if _IGNORED.match(k))
    token_type = "bert.embeddings.token_type_embeddings.weight"
    missing = [k for k in expected if k not in hf and k not in tied]
    unexpected = [k for k in hf if k not in expected and k not in ignored]
    if missing or unexpected:
        raise ValueError(f"{where}: not the tensors of a {hf_class} of its config.json: "
                         f"missing {missing}, unexpected {unexpected}")
    wrong = [f"{k}: {tuple(hf[k].shape)}, config.json implies {shape}"
             for k, shape in expected.items() if k in hf
             and tuple(hf[k].shape) != shape
             and not (k == token_type and hf[k].ndim == 2 and hf[k].shape[1] == shape[1])]
    if wrong:
        raise ValueError(f"{where}: tensors of the wrong shape: " + "; ".join(wrong))
    return ignored


def _padded(t: Tensor, rows: int) -> Tensor:
    """`t` with zero rows appended up to `rows` rows."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _bert_state(hf: dict[str, Tensor], cfg: ModelConfig, rows: int) -> dict[str, Tensor]:
    word = _padded(hf["bert.embeddings.word_embeddings.weight"], rows)
    type0 = hf["bert.embeddings.token_type_embeddings.weight"][0]
    out = {"embeddings.word_embeddings.weight": word,
           "embeddings.position_embeddings.weight":
               hf["bert.embeddings.position_embeddings.weight"] + type0,
           "embeddings.layer_norm.weight": hf["bert.embeddings.LayerNorm.weight"],
           "embeddings.layer_norm.bias": hf["bert.embeddings.LayerNorm.bias"],
           "head.decoder.weight": word,
           "head.decoder.bias": _padded(hf["cls.predictions.bias"], rows)}
    for i in range(cfg.num_layers):
        base = f"bert.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            out[f"layers.{i}.attention.qkv.{kind}"] = torch.cat(
                [hf[f"{base}{name}.{kind}"] for name in BERT_QKV])
    out |= {ours: hf[theirs] for theirs, ours in bert_pairs(cfg.num_layers)}
    return out


def _modern_state(hf: dict[str, Tensor], model: BertMLM, rows: int) -> dict[str, Tensor]:
    out = {}
    for key in model.state_dict():
        if key == "head.decoder.weight":
            continue
        t = hf[modern_name(key)]
        out[key] = _padded(t, rows) if key in ("embeddings.word_embeddings.weight",
                                               "head.decoder.bias") else t
    out["head.decoder.weight"] = out["embeddings.word_embeddings.weight"]
    return out


def fit_vocab(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """`state` with its word-embedding table, tied decoder and decoder bias cut to the rows
    of a `vocab_size` model (`vocab_size` rounded up to a multiple of 64); a state of that
    many rows already is returned as it is (a Hugging Face parent with more rows than the
    run's tokenizer has ids: the rows cut are ids no input holds).
    """
    rows = -(-vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    keys = ("embeddings.word_embeddings.weight", "head.decoder.weight", "head.decoder.bias")
    return {k: (t[:rows].clone() if k in keys and t.shape[0] > rows else t)
            for k, t in state.items()}


def load_hf_model(path: str | Path, attention_kernel: str = "auto"
                  ) -> tuple[BertMLM, ModelConfig, dict[str, Any]]:
    """A `BertMLM` computing what the `BertForMaskedLM` / `ModernBertForMaskedLM` saved in
    `path` computes (module docstring: token-type row 0 folded into the positions).

    Args:
        path: a local `save_pretrained` directory.
        attention_kernel: `BertMLM`'s kernel (`kernels.KERNELS`).

    Returns:
        (the model: CPU, fp32, eval mode, `vocab_size` = config.json's, `seq_len` = its
        `max_position_embeddings`; its `ModelConfig`; the record: `source` (the resolved
        directory), `hf_class`, `files` (name -> sha256 of every file read), `digest`
        (`directory_digest`), `vocab_size`, `max_position_embeddings`, `ignored` (tensors
        not computed with) and, for BERT, `token_type` (what became of those rows)).

    Raises:
        ValueError: naming the file and field or tensor: missing `config.json` or weights,
            an unknown architecture or a config field `ModelConfig` cannot represent
            (`hf_model_fields`), a damaged safetensors header or truncated file, missing
            or unexpected tensors, a tensor of the wrong shape.
    """
    path = Path(path).expanduser().resolve()
    hf_class, fields, sizes = hf_model_fields(path)
    cfg = ModelConfig.model_validate(fields)
    files = weight_files(path)
    digests = parent_files(path)
    hf = read_weights(files)
    vocab, seq_len = sizes["vocab_size"], sizes["max_position_embeddings"]
    model = BertMLM(cfg, vocab, seq_len, attention_kernel)
    where = ", ".join(f.name for f in files if f.name != SAFETENSORS_INDEX)
    ignored = _check_names(hf, _expected(model, hf_class), hf_class, str(path / where))
    hf = {k: v.float() for k, v in hf.items() if k not in ignored}
    rows = model.padded_vocab_size
    state = (_bert_state(hf, cfg, rows) if hf_class == "BertForMaskedLM"
             else _modern_state(hf, model, rows))
    model.load_state_dict(state, strict=True)
    record = {"source": str(path), "hf_class": hf_class, "files": digests,
              "digest": directory_digest(digests), "vocab_size": vocab,
              "max_position_embeddings": seq_len, "ignored": ignored}
    if hf_class == "BertForMaskedLM":
        types = hf["bert.embeddings.token_type_embeddings.weight"].shape[0]
        record["token_type"] = (f"row 0 added to the position embeddings; {types - 1} other "
                                "row(s) (segment ids > 0) dropped")
    return model.eval(), cfg, record
