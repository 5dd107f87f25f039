"""Warm start (`train.init_from`): a fresh run initialized with a parent model's weights.

`resolve_init` turns a SOURCE (a checkpoint or run directory, an MLflow parent fetched by
the tracking layer, or a Hugging Face masked LM: `resolve_hf_init`, whose vocabulary may
be larger than the run's, the rows no input can look up cut) into an `InitSource`;
`check_init_compatible` refuses a parent whose architecture, `vocab_size` or tokenizer
differ from the run's. Only the weights are loaded: the optimizer, the LR schedule with
its warm-up, the data order and the step count of the new run start afresh.

Length phases (BERT's 128 -> 512, ModernBERT's 1,024 -> 8,192 context extension): the
child's `shards.seq_len` may differ from the parent's. Rotary positions have no table, and
the RoPE bases may change with the length (ModernBERT raised the global base from 10,000
to 160,000 to extend its context; Warner et al. 2024, section 2.2). A learned position
table is cut, or extended with row i taking the parent's row i mod L_parent (Longformer's
initialization of its 4,096 positions from RoBERTa's 512: Beltagy et al. 2020, section 5).
The run's lineage records what changed (`init_changes`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline.config import ModelConfig, TrainConfig
from mlm_pipeline.config.hf_parent import hf_parent_class
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest
from mlm_pipeline.train.export import find_stage_manifest
from mlm_pipeline.train.hf_import import (directory_digest, fit_vocab, hf_model_fields,
                                          load_hf_model, parent_files)
from mlm_pipeline.train.verified import (STATE_DIGEST, find_checkpoint, load_verified,
                                         read_state, verify_checkpoint)

logger = logging.getLogger(__name__)

#: The line of an exported model card naming its checkpoint (`train.export.model_card`).
_EXPORTED_FROM = re.compile(r"Exported from `(step-\d+)` of run `([^`]+)`")
#: `model` fields that neither shape the weights nor change what they compute once
#: loaded: a parent may differ in them.
_FREE_MODEL_FIELDS = frozenset({"preset", "dropout", "initializer_range"})
#: `model` fields that do not shape the weights but change what they compute: a child
#: may change them (a length phase's RoPE base, positions restarting per document), and
#: its lineage records the change (`init_changes`).
_RECORDED_MODEL_FIELDS = frozenset({"rope_base", "local_rope_base", "document_positions"})


@dataclass(frozen=True)
class InitSource:
    """A verified parent checkpoint of a warm start.

    Attributes:
        source: the SOURCE as the config gives it (`train.init_from`).
        checkpoint: the checkpoint directory resolved from it.
        digest: the checkpoint's `state_sha256` (hex): it covers the sha256 of every file.
        step: optimizer steps the parent had taken.
        state: the checkpoint's verified `state.json`; for a Hugging Face parent, what it
            says in those terms (`config.model`, `seq_len` = its `max_position_
            embeddings`, `vocab_size`, `tokenizer_digest`).
        hf_class: the `transformers` class of a Hugging Face parent (None: a checkpoint).
    """

    source: str
    checkpoint: Path
    digest: str
    step: int
    state: dict[str, Any]
    hf_class: str | None = None

    def record(self, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """What runs record of their parent (checkpoint meta, train manifest, MLflow tags):
        `source`, `checkpoint`, `digest`, `step` (JSON values), `hf_class` for a Hugging
        Face parent, and the `changes` from the parent (`init_changes`) if any."""
        record = {"source": self.source, "checkpoint": str(self.checkpoint),
                  "digest": self.digest, "step": self.step,
                  **({"hf_class": self.hf_class} if self.hf_class else {})}
        return {**record, **({"changes": changes} if changes else {})}


def resolve_init(source: str, checkpoint: str | Path | None = None,
                 trust_unverified: bool = False) -> InitSource:
    """The verified checkpoint of a warm-start SOURCE.

    Args:
        source: `train.init_from`: a checkpoint or training run directory, or a Hugging
            Face masked-LM directory (`resolve_hf_init`).
        checkpoint: the local checkpoint an MLflow SOURCE was fetched to (None: `source`
            is a local path).
        trust_unverified: accept a checkpoint without a digest (`train.trust_unverified_
            checkpoint`); a damaged one is refused all the same.

    Raises:
        ValueError: `source` is not a local path and no `checkpoint` is given (an MLflow
            SOURCE must be fetched by the caller); the checkpoint is damaged or cannot be
            verified (`CheckpointError`, the file named); the errors of `resolve_hf_init`.
        FileNotFoundError: the path holds no complete checkpoint.
    """
    if checkpoint is None:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(
                f"train.init_from {source!r}: no such checkpoint or run directory (an MLflow "
                "run id or models:/ URI is fetched by `mlm-pipeline run` and the flows)")
        if hf_parent_class(path) is not None:
            return resolve_hf_init(source, path)
        _refuse_exported(source, path)
        checkpoint = find_checkpoint(path, trust_unverified)
    path = Path(checkpoint).resolve()
    state = verify_checkpoint(path, trust_unverified)
    step = int((state.get("train_state") or {}).get("step", state.get("step", 0)))
    digest = state.get(STATE_DIGEST) or ""
    return InitSource(source=source, checkpoint=path, digest=digest, step=step, state=state)


def resolve_hf_init(source: str, path: Path) -> InitSource:
    """The `InitSource` of a Hugging Face masked-LM directory: digest = the directory
    digest of every file `load_hf_model` reads, step 0, `hf_class`, and a `state` in a
    checkpoint's terms (`InitSource.state`).

    Raises:
        ValueError: `train.init_from` and the errors of `hf_model_fields` and
            `parent_files` (the file and field named).
    """
    path = path.resolve()
    try:
        hf_class, fields, sizes = hf_model_fields(path)
        files = parent_files(path)
    except ValueError as exc:
        raise ValueError(f"train.init_from {source!r}: {exc}") from None
    tokenizer = None
    if "tokenizer.json" in files:
        from mlm_pipeline.tokenizer import pretrained_tokenizer_digest

        tokenizer = pretrained_tokenizer_digest(path)
    state = {"config": {"model": ModelConfig.model_validate(fields).model_dump(mode="json")},
             "seq_len": sizes["max_position_embeddings"], "vocab_size": sizes["vocab_size"],
             "tokenizer_digest": tokenizer, "hf_class": hf_class, "files": files}
    return InitSource(source=source, checkpoint=path, digest=directory_digest(files), step=0,
                      state=state, hf_class=hf_class)


def _refuse_exported(source: str, path: Path) -> None:
    """Refuse an exported `transformers` model directory (`config.json`, no checkpoint):
    it records no digests to verify it by (ValueError naming its origin checkpoint)."""
    if not (path / "config.json").is_file() or (path / "state.json").is_file() \
            or (path / "checkpoints").is_dir():
        return
    origin = _exported_origin(path)
    raise ValueError(
        f"train.init_from {source!r}: an exported transformers model directory, which holds "
        "no training checkpoint to verify (digests, declared sizes); give the checkpoint "
        f"directory it was exported from{origin}, or the MLflow run id or models:/ URI of "
        "the run that logged it")


def _exported_origin(path: Path) -> str:
    """` (its model card says: checkpoint ... of run ...)` for our export, else ""."""
    card = path / "README.md"
    if card.is_file():
        found = _EXPORTED_FROM.search(card.read_text(encoding="utf-8", errors="replace"))
        if found:
            return (f" (its model card says: checkpoint {found.group(1)} of run "
                    f"{found.group(2)}, in <work_dir>/train/{found.group(2)}/checkpoints)")
    return ""


def init_differences(init: InitSource, model: ModelConfig, shards: ShardManifest,
                     tokenizer: TokenizerManifest | None) -> list[str]:
    """Every field in which the parent differs from the run and may not, as
    `model.hidden_size: 128 in the source, 256 in the config` (empty: compatible).

    The model fields are compared as resolved (`ModelConfig.from_record`), except those a
    child may change; the vocabulary as `vocab_size` and tokenizer digest (same size,
    other pieces: other ids). `seq_len` may differ (a length phase)."""
    fixed = [n for n in ModelConfig.model_fields
             if n not in _FREE_MODEL_FIELDS | _RECORDED_MODEL_FIELDS]
    problems = [f"model.{name}: {a!r} in the source, {b!r} in the config"
                for name, a, b in _differing(_parent_model(init), model, fixed)]
    have = init.state.get("vocab_size")
    if have != shards.vocab_size and not (init.hf_class and have > shards.vocab_size):
        problems.append(f"vocab_size: {have} in the source, {shards.vocab_size} in the "
                        "config's shards")
    if type(init.state.get("seq_len")) is not int:
        problems.append(f"seq_len: {init.state.get('seq_len')!r} in the source is not a "
                        "length")
    parent_tok = init.state.get("tokenizer_digest")
    if init.hf_class and parent_tok is None:
        pass  # a parent saved without its tokenizer: the vocabulary size is all it says
    elif tokenizer is not None and parent_tok != tokenizer.digest and init.hf_class:
        problems.append(f"tokenizer: the source's files (digest {str(parent_tok)[:16]}) are "
                        f"not the config's tokenizer ({tokenizer.digest[:16]}): set "
                        f"tokenizer.adopt_from={init.checkpoint}, as `load_config` does for "
                        f"such a parent{_exported_origin(init.checkpoint)}")
    elif tokenizer is not None and parent_tok != tokenizer.digest:
        problems.append(f"tokenizer: digest {str(parent_tok)[:16]} in the source, "
                        f"{tokenizer.digest[:16]} in the config (other pieces; set "
                        "tokenizer.from_init=true to reuse the source's)")
    return problems


def _parent_model(init: InitSource) -> ModelConfig:
    """The parent's model config as it was trained."""
    return ModelConfig.from_record((init.state.get("config") or {}).get("model") or {})


def _differing(theirs: ModelConfig, ours: ModelConfig,
               names: list[str]) -> list[tuple[str, Any, Any]]:
    """(name, parent's value, child's value) of each field in `names` that differs."""
    return [(n, getattr(theirs, n), getattr(ours, n)) for n in names
            if getattr(theirs, n) != getattr(ours, n)]


def init_changes(init: InitSource, model: ModelConfig, seq_len: int,
                 vocab_size: int | None = None) -> dict[str, Any]:
    """What a compatible child changes from its parent: `{"seq_len": [parent, child],
    "model.rope_base": [parent, child], ...}` (only what differs; `vocab_size`, the
    child's V, for a Hugging Face parent with more rows), plus `positions`, the rule that
    fitted a learned position table to another length (`fit_positions`)."""
    theirs, changes = _parent_model(init), {}
    if init.hf_class and vocab_size is not None and init.state["vocab_size"] != vocab_size:
        changes["vocab_size"] = [init.state["vocab_size"], vocab_size]
    parent_len = int(init.state["seq_len"])
    if parent_len != seq_len:
        changes["seq_len"] = [parent_len, seq_len]
        if model.position == "learned":
            changes["positions"] = ("cut to the first rows" if seq_len < parent_len else
                                    "extended: row i = parent row i mod "
                                    f"{parent_len} (Longformer)")
    for name, a, b in _differing(theirs, model, sorted(_RECORDED_MODEL_FIELDS)):
        changes[f"model.{name}"] = [a, b]
    return changes


def fit_positions(state: dict[str, torch.Tensor], seq_len: int) -> dict[str, torch.Tensor]:
    """`state` with its learned position table (if any) fitted to `seq_len` rows: the first
    `seq_len` rows of a longer table; a shorter table tiled, row i = row i mod L_parent
    (Longformer, Beltagy et al. 2020, section 5). Rotary states are returned as they are.

    Args:
        state: a `BertMLM` state dict (the parent's).
        seq_len: the child's rows, tokens.

    Returns:
        The state dict, the position table replaced by a (seq_len, H) fp32 tensor.
    """
    key = "embeddings.position_embeddings.weight"
    table = state.get(key)
    if table is None or table.shape[0] == seq_len:
        return state
    rows = torch.arange(seq_len) % table.shape[0]
    return {**state, key: table[rows].clone()}


def check_init_compatible(init: InitSource, model: ModelConfig, shards: ShardManifest,
                          tokenizer: TokenizerManifest | None) -> None:
    """Refuse a parent the run cannot start from (see `init_differences`).

    Raises:
        ValueError: one message naming the source and every field that differs.
    """
    problems = init_differences(init, model, shards, tokenizer)
    if problems:
        raise ValueError(f"train.init_from {init.source!r} ({init.checkpoint}) does not fit "
                         "this config: " + "; ".join(problems))


def init_weights(init: InitSource, trust_unverified: bool = False) -> dict[str, torch.Tensor]:
    """The parent's model `state_dict` (CPU, fp32 as saved), read through the verified
    loader (`load_verified`), or a Hugging Face parent's by `hf_import.load_hf_model` (its
    vocabulary rows padded to a multiple of 64: `fit_vocab` fits them to the run's).

    Raises:
        CheckpointError: the checkpoint changed since `resolve_init` (damaged, or its
            declared sizes are not its tensors').
        ValueError: a Hugging Face parent's files changed since `resolve_init` (their
            digest is not the one the run records), or the errors of `load_hf_model`.
    """
    if init.hf_class:
        model, _, record = load_hf_model(init.checkpoint)
        if record["digest"] != init.digest:
            changed = sorted(k for k in {**record["files"], **init.state["files"]}
                             if record["files"].get(k) != init.state["files"].get(k))
            raise ValueError(f"train.init_from {init.source!r}: {changed} in {init.checkpoint} "
                             "changed since the run resolved its parent")
        logger.info("warm start: weights of Hugging Face %s %s (digest %s; %s)",
                    init.hf_class, init.checkpoint, init.digest[:16],
                    record.get("token_type", "every tensor mapped one to one"))
        return model.state_dict()
    model, _ = load_verified(init.checkpoint, "cpu", trust_unverified)
    logger.info("warm start: weights of %s (step %d, digest %s)", init.checkpoint, init.step,
                init.digest[:16])
    return model.state_dict()


def parent_tokenizer(init: InitSource) -> TokenizerManifest:
    """The manifest of the tokenizer the parent was trained with: found by its
    `tokenizer_digest` in a `tokenizer/` directory of the checkpoint's ancestors.

    Raises:
        FileNotFoundError: no such tokenizer output (named with the digest).
        ValueError: the parent is a Hugging Face directory (its tokenizer is adopted).
    """
    if init.hf_class:
        raise ValueError(f"tokenizer.from_init: {init.checkpoint} is a Hugging Face "
                         f"{init.hf_class}: adopt its tokenizer with tokenizer.adopt_from "
                         "(what load_config does for such a parent)")
    digest = init.state.get("tokenizer_digest") or ""
    found = find_stage_manifest(init.checkpoint, "tokenizer", digest, TokenizerManifest)
    if found is None:
        raise FileNotFoundError(
            f"tokenizer.from_init: the tokenizer of {init.checkpoint} (digest {digest[:16]}) "
            "is not in a tokenizer/ directory of its work directory")
    return found


def parent_of_run(cfg: TrainConfig, model: ModelConfig, shards: ShardManifest,
                  tokenizer: TokenizerManifest, resume_from: Path | None,
                  init_checkpoint: Path | None = None
                  ) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor] | None]:
    """The parent record (`InitSource.record`) and weights a run starts from: at a fresh
    start with `cfg.init_from`, the verified, compatible parent and its weights; when
    resuming, the record its checkpoint holds and no weights (the parent is not read again:
    `models:/NAME@champion` may have moved on); else (None, None).

    Args:
        cfg, model, shards, tokenizer: the run's train and model configs and inputs.
        resume_from: the checkpoint the run resumes from, or None (a fresh start).
        init_checkpoint: where an MLflow `cfg.init_from` was fetched to (`resolve_init`).

    Raises:
        ValueError, FileNotFoundError: the errors of `resolve_init` and
            `check_init_compatible`.
    """
    if resume_from is not None:
        return read_state(resume_from).get("init"), None
    if cfg.init_from is None:
        return None, None
    init = resolve_init(cfg.init_from, init_checkpoint, cfg.trust_unverified_checkpoint)
    check_init_compatible(init, model, shards, tokenizer)
    changes = init_changes(init, model, shards.seq_len, shards.vocab_size)
    if changes:
        logger.info("warm start: changes from the parent: %s", changes)
    weights = fit_vocab(fit_positions(init_weights(init, cfg.trust_unverified_checkpoint),
                                      shards.seq_len), shards.vocab_size)
    return init.record(changes), weights
