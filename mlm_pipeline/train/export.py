"""Export a checkpoint as a Hugging Face `transformers` model directory.

`export_checkpoint(checkpoint_dir, out_dir)` writes what `AutoModelForMaskedLM`,
`AutoTokenizer` and `transformers.pipeline("fill-mask", model=out_dir)` load:
`config.json` and `model.safetensors` (the weights under the Hugging Face class of the
model's architecture, `train.hf`, fp32, the vocabulary's padding rows sliced away); the
tokenizer files (our tokenizer rebuilt with `tokenizers`, `tokenizer.hf_files`, found from
the checkpoint's tokenizer digest in the work directory); and a `README.md` model card.

The directory is written under a temporary name beside `out_dir` and renamed, so a failed
export leaves nothing that looks complete. `transformers` (and `tokenizers`, `safetensors`)
are imported inside the functions to keep this module cheap.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlm_pipeline import __version__
from mlm_pipeline.config import ModelConfig, SpecialIds
from mlm_pipeline.manifest import (CorpusManifest, EvalManifest, ShardManifest,
                                   TokenizerManifest, TrainManifest, read_manifest)
from mlm_pipeline.tokenizer.hf_files import export_tokenizer, require
from mlm_pipeline.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def export_class(state: dict[str, Any]) -> str:
    """The `transformers` class a checkpoint exports as: the one of its model config's
    architecture (`hf.hf_class_name`), which must be the class the checkpoint records
    (`hf_class` in `state.json`, when recorded).

    Raises:
        ValueError: no Hugging Face class has the architecture (the fields that differ
            from the preset's class are named), or the checkpoint records another class
            (a layout this version does not map).
    """
    from mlm_pipeline.train.hf import HF_CLASSES, check_compatible, hf_class_name

    cfg = ModelConfig.from_record(state["config"]["model"])
    hf_class = hf_class_name(cfg)
    if hf_class is None:
        check_compatible(cfg, HF_CLASSES[cfg.preset or "bert"])
    recorded = state.get("hf_class")
    if recorded is not None and recorded != hf_class:
        raise ValueError(f"the checkpoint records hf_class {recorded!r}, its model config "
                         f"maps to {hf_class!r}")
    return hf_class


def find_stage_manifest(start: Path, stage: str, digest: str, cls):
    """The manifest of stage output `<work_dir>/<stage>/<digest[:16]>` with `digest`,
    looked for in `start` and each directory above it (a run directory lives at
    `<work_dir>/train/<run>`); None when no directory holds it."""
    for root in (start, *start.parents):
        path = root / stage / digest[:16] / "manifest.json"
        if path.is_file():
            try:
                m = read_manifest(path, cls)
            except ValueError:
                continue
            if m.digest == digest:
                return m.model_copy(update={"output_dir": str(path.parent.resolve())})
    return None


def set_special_ids(config: Any, special_ids: SpecialIds) -> None:
    """Write the tokenizer's special ids into an exported model's `transformers` config:
    `pad_token_id`, and `bos_token_id` / `cls_token_id` ([CLS]) and `eos_token_id` /
    `sep_token_id` ([SEP]) where the config has them set (`ModernBertConfig`)."""
    roles = {"pad_token_id": special_ids.pad_id, "bos_token_id": special_ids.cls_id,
             "cls_token_id": special_ids.cls_id, "eos_token_id": special_ids.sep_id,
             "sep_token_id": special_ids.sep_id}
    for name, value in roles.items():
        if getattr(config, name, None) is not None:
            setattr(config, name, value)


def _train_state(state: dict[str, Any]) -> dict[str, int]:
    """`step` and `tokens_seen` of a checkpoint state (both checkpoint formats)."""
    return state.get("train_state") or {"step": state["step"],
                                        "tokens_seen": state["tokens_seen"]}


def _load_tokenizer(checkpoint: Path, state: dict[str, Any],
                    tokenizer: str | os.PathLike[str] | None,
                    ) -> tuple[Tokenizer, TokenizerManifest | None]:
    """The tokenizer the checkpoint was trained with (checked by digest and vocab size)
    and its manifest if any; FileNotFoundError when none is found, ValueError when the
    given one is not the checkpoint's."""
    digest = state["tokenizer_digest"]
    if tokenizer is None:
        manifest = find_stage_manifest(checkpoint, "tokenizer", digest, TokenizerManifest)
        if manifest is None:
            raise FileNotFoundError(
                f"{checkpoint}: its tokenizer (digest {digest[:16]}) is not in a tokenizer/ "
                "directory of its work directory; pass the tokenizer stage directory")
        tok = Tokenizer.load(manifest)
    else:
        tok = Tokenizer.load(tokenizer)
        p = Path(tokenizer)
        p = p / "manifest.json" if p.is_dir() else p.with_name("manifest.json")
        try:
            manifest = read_manifest(p, TokenizerManifest)
        except (OSError, ValueError):
            manifest = None
        if manifest is not None and manifest.digest != digest:
            raise ValueError(f"{tokenizer}: tokenizer digest {manifest.digest[:16]} differs "
                             f"from the checkpoint's {digest[:16]}")
    if tok.vocab_size != state["vocab_size"]:
        raise ValueError(f"{tok.path}: {tok.vocab_size} pieces, the checkpoint has "
                         f"vocab_size {state['vocab_size']}")
    return tok, manifest


def _eval_metrics(checkpoint: Path) -> dict[str, float]:
    """The run's evaluation metrics if this is its final checkpoint (else empty)."""
    run = checkpoint.parent.parent
    try:
        trained = read_manifest(run / "manifest.json", TrainManifest)
    except (OSError, ValueError):
        return {}
    if (run / trained.checkpoint_dir).resolve() != checkpoint.resolve():
        return {}
    for root in run.parents:
        for path in sorted((root / "evaluate").glob("*/manifest.json")):
            try:
                ev = read_manifest(path, EvalManifest)
            except (OSError, ValueError):
                continue
            if ev.inputs.get("train") == trained.digest:
                return dict(ev.metrics)
    return {}


def modern_layout(state: dict[str, Any]) -> str:
    """The attention layout of a `modern` checkpoint in words, as trained (a checkpoint
    written before the layout existed is all-global: `ModelConfig.from_record`)."""
    cfg = ModelConfig.from_record(state["config"]["model"])
    if not cfg.has_local_layers:
        return f"global attention in every layer, RoPE base {cfg.rope_base:g}"
    return (f"a global layer every {cfg.global_every} layers (RoPE base {cfg.rope_base:g}), "
            f"the others sliding-window over {cfg.local_attention_window} tokens (RoPE "
            f"base {cfg.local_rope_base:g})")


def model_card(*, hf_class: str, state: dict[str, Any], tok: Tokenizer,
               tok_manifest: TokenizerManifest | None, corpus: CorpusManifest | None,
               corpus_digest: str | None, shards: ShardManifest | None,
               metrics: dict[str, float], checkpoint: Path) -> str:
    """The `README.md` of an exported model (Markdown with YAML front matter)."""
    counts, cfg = _train_state(state), state["config"]
    model, train, masking = cfg["model"], cfg.get("train", {}), cfg.get("masking", {})
    sources = "corpus manifest not found in the work directory"
    if corpus is not None:
        sources = ", ".join(f"`{Path(s.path).name}` (sha256 {s.sha256[:12]})"
                            for s in corpus.sources[:5])
        if len(corpus.sources) > 5:
            sources += f" and {len(corpus.sources) - 5} more"
    lines = [
        "---", "library_name: transformers", "pipeline_tag: fill-mask", "tags:",
        "- masked-lm", "- mlm-pipeline", "---", "",
        f"# {hf_class} pretrained with mlm-pipeline", "",
        (f"A {model['num_layers']}-layer, {model['hidden_size']}-wide BERT-style encoder "
         f"({model.get('preset') or 'custom'} preset; {model['num_heads']} heads, "
         f"feed-forward {model['intermediate_size']}) trained from scratch with masked "
         f"language modelling by mlm-pipeline {__version__}."), "",
        "## Data", "",
        f"- Corpus digest: `{corpus_digest or 'unknown'}`; sources: {sources}",
    ]
    if corpus is not None:
        lines.append(f"- Documents: {corpus.documents_train:,} train, "
                     f"{corpus.documents_validation:,} validation "
                     f"({corpus.config.get('normalization', 'NFC')} normalized)")
    kind = (f"SentencePiece {tok_manifest.model_type if tok_manifest else 'model'}"
            if tok.encoder_spec()[0] == "sentencepiece" else
            f"adopted Hugging Face {tok_manifest.model_type if tok_manifest else 'tokenizer'}"
            + (f" (from `{tok_manifest.source}`)" if tok_manifest and tok_manifest.source
               else ""))
    lines += [
        f"- Tokenizer: {kind}, {tok.vocab_size:,} pieces, digest `{state['tokenizer_digest']}`",
        f"- Shards digest: `{state['shards_digest']}`; sequences of {state['seq_len']} tokens"
        + (f", {shards.train.rows:,} training rows" if shards is not None else ""),
        "", "## Training", "",
        f"- Steps: {counts['step']:,}; tokens seen: {counts['tokens_seen']:,}",
    ]
    if hf_class == "ModernBertForMaskedLM":
        lines.append(f"- Architecture: ModernBERT, {modern_layout(state)}")
    if train:
        warmup = (f"{train['warmup_steps']} warm-up steps" if train.get("warmup_steps")
                  is not None else f"warm-up ratio {train.get('warmup_ratio')}")
        lines.append(f"- AdamW: lr {train.get('lr')}, {train.get('decay')} decay, {warmup}, "
                     f"weight decay {train.get('weight_decay')}; batch "
                     f"{train.get('micro_batch_size')} x {train.get('grad_accum_steps', 1)} "
                     f"sequences per step; precision {train.get('precision')}")
        if train.get("document_attention"):
            lines.append("- Trained with document attention (tokens attend within their "
                         "document of a packed row, positions restarting there); the "
                         "exported model attends over its whole input: give it one "
                         "document per row")
    if masking:
        rate = masking.get("mlm_probability")
        if isinstance(rate, dict):  # a masking-rate schedule (config.masking_schedule)
            rate = ", ".join(f"{k} {v}" for k, v in rate.items() if v is not None)
            rate = f"a schedule ({rate})"
        lines.append(f"- Masking: {rate} of tokens "
                     f"({masking.get('mask_replace_prob')} [MASK], "
                     f"{masking.get('random_replace_prob')} random)")
    lines += ["", "## Evaluation", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|",
                  *(f"| `{k}` | {v:.4f} |" for k, v in sorted(metrics.items()))]
    else:
        lines.append("Not evaluated (no evaluation of this checkpoint in its work directory).")
    lines += [
        "", "## Use", "", "```python",
        "from transformers import pipeline",
        "fill = pipeline(\"fill-mask\", model=\"PATH/TO/THIS/DIRECTORY\")",
        "fill(\"Le [MASK] du chat est doux et chaud.\")", "```", "",
        ("The tokenizer reproduces the training tokenizer's ids exactly. A literal "
         "\"[MASK]\" in a text is the mask token; pass `split_special_tokens=True` to "
         "encode special-token names as plain text, as the training data was."), "",
        f"Exported from `{checkpoint.name}` of run `{checkpoint.parent.parent.name}`.", "",
    ]
    return "\n".join(lines)


def export_checkpoint(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      *, tokenizer: str | os.PathLike[str] | None = None,
                      overwrite: bool = False, trust_unverified: bool = False) -> Path:
    """Write a `transformers` model directory from one of our checkpoints.

    Args:
        checkpoint_dir: a checkpoint (`.../checkpoints/step-XXXXXXXX`).
        out_dir: the model directory to create.
        tokenizer: the tokenizer stage directory (or its `.model` file or manifest); by
            default the one with the checkpoint's digest under its work directory.
        overwrite: replace an existing non-empty `out_dir`.
        trust_unverified: export a checkpoint that cannot be verified (no digest).

    Returns:
        `out_dir`, resolved.

    Raises:
        FileNotFoundError: `checkpoint_dir` is not a checkpoint, or its tokenizer not found.
        FileExistsError: `out_dir` exists, is not empty, and `overwrite` is false.
        CheckpointError: (a ValueError) the checkpoint is damaged, cannot be verified
            (unless `trust_unverified`), or declares sizes its tensors do not have.
        ValueError: the model cannot be exported (fields no Hugging Face class can
            express; see `export_class`), or the tokenizer is not the checkpoint's.
        RuntimeError: `transformers` or `tokenizers` cannot be imported (an incomplete
            install; the message says how to reinstall).
    """
    from mlm_pipeline.train.verified import load_verified, read_state
    from mlm_pipeline.train.hf import to_hf

    checkpoint = Path(checkpoint_dir).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    export_class(read_state(checkpoint))  # an unexportable model: refused before loading
    model, state = load_verified(checkpoint, trust_unverified=trust_unverified)
    hf_class = export_class(state)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (choose a new directory, "
                              "or overwrite)")
    require("transformers")
    tok, tok_manifest = _load_tokenizer(checkpoint, state, tokenizer)
    corpus_digest = tok_manifest.inputs.get("corpus") if tok_manifest else None
    corpus = (find_stage_manifest(Path(tok_manifest.output_dir), "ingest", corpus_digest,
                                  CorpusManifest) if corpus_digest else None)
    shards = find_stage_manifest(checkpoint, "shards", state["shards_digest"], ShardManifest)
    metrics = _eval_metrics(checkpoint)

    hf = to_hf(model)
    set_special_ids(hf.config, tok.special_ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        export_tokenizer(tok, tmp, model_max_length=state["seq_len"])
        card = model_card(hf_class=hf_class, state=state, tok=tok, tok_manifest=tok_manifest,
                          corpus=corpus, corpus_digest=corpus_digest, shards=shards,
                          metrics=metrics, checkpoint=checkpoint)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s (%s, step %d) to %s", checkpoint, hf_class,
                _train_state(state)["step"], out)
    return out

