"""Held-out evaluation: masked-token loss, accuracy and perplexity with fixed masks at 15 %,
fill-mask probes, and the downstream tasks beside their controls.

Masks come from training's keyed masking function, keyed by (`eval.seed`, epoch 0, global
validation row index): every run, checkpoint and eval batch size sees the same masked
positions and corrupted inputs, so runs are compared on identical predictions. Metrics are
token-weighted (sums over all masked tokens divided once by their count, never a mean of
per-batch means). Evaluation masks at `eval.mlm_probability`
(BERT's 15 %, the rate the field reports, whatever rate training used) with the training
run's selection (`masking.selection`, `masking.whole_word`, 80/10/10), and runs the model
with document attention when `train.document_attention` is set. When training masked at
another rate, the final evaluation also reports the same rows at the training rate,
`eval/loss_at_train_rate` and `eval/mlm_accuracy_at_train_rate` (`eval.train_rate_metrics`);
`eval/mlm_probability` records the rate of the `eval/*` figures.

Besides the model's metrics, `eval/baseline_accuracy` is the accuracy of always predicting
the most frequent ordinary token of the training split, on the same positions: a model
that has learned anything beats it.

The downstream figures (`downstream`: linear probe; `finetune`: fine-tuning) come with
their controls; a figure that is not computed (disabled, no data, too few seeds) is named,
with the reason, in a run tag `unavailable.<figure>` (`EvalManifest.tags`). A run with a
parent (`train.init_from`) is evaluated beside the weights it started from, on the same
rows, masks, splits and seeds (`evaluate.parent`: `eval/parent_loss`, ...).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mlm_pipeline.config import (
    IGNORE_INDEX,
    EvalConfig,
    FinetuneConfig,
    LinearProbeConfig,
    MaskingConfig,
)
from mlm_pipeline.evaluate.downstream import DownstreamResult, run_probe
from mlm_pipeline.evaluate.encoders import ours
from mlm_pipeline.evaluate.finetune import run_finetune
from mlm_pipeline.evaluate.bpc import holdout_metrics, write_holdout_text
from mlm_pipeline.evaluate.parent import PARENT_MLM_KEYS, parent_model, parent_tags
from mlm_pipeline.evaluate.probes import probe_metrics, warn_answer_problems
from mlm_pipeline.manifest import (
    EvalManifest,
    ShardManifest,
    Stopwatch,
    TokenizerManifest,
    TrainManifest,
    compute_digest,
    stage_dir,
    write_manifest,
)
from mlm_pipeline.masking.maskers import KeyedMasking, keyed_masking
from mlm_pipeline.ingest.holdout import Holdout
from mlm_pipeline.progress import NullProgress, Progress, reporting
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.checkpoint import load_model
from mlm_pipeline.train.data import ShardDataset
from mlm_pipeline.train.model import document_ids_from_sep

logger = logging.getLogger(__name__)


@torch.no_grad()
def masked_lm_metrics(
    model: torch.nn.Module, dataset: ShardDataset, *, masking: KeyedMasking, batch_size: int,
    max_rows: int | None = None, baseline_token: int | None = None,
    device: torch.device | str = "cpu", precision: str = "fp32",
    document_attention: bool = False, progress: Progress | None = None,
) -> dict[str, float]:
    """Token-weighted masked-LM metrics over the first `max_rows` rows of `dataset`.

    Args:
        model: a `BertMLM` (its `forward(input_ids, labels=..., document_ids=...)` returns
            logits (N, V) at the N masked positions, in row-major order).
        dataset: validation rows, (rows, seq_len).
        masking: the evaluation masks (`KeyedMasking` with the eval seed), applied with
            epoch 0 to global validation row indices: positions depend on (seed, row)
            and the row's ids only.
        batch_size: rows per forward pass; the metrics do not depend on it.
        max_rows: evaluate on rows [0, max_rows); None for all.
        baseline_token: id whose constant prediction gives `eval/baseline_accuracy`.
        device, precision: where and how to run the model (`bf16` autocast or `fp32`).
        document_attention: run the model with `document_ids` from the [SEP] tokens of
            the unmasked rows (tokens attend within their document only).
        progress: where to report stage `evaluate` (`mlm_pipeline.progress`): batches
            done of ceil(rows / batch_size).

    Returns:
        `eval/loss` (mean cross-entropy, nats per masked token), `eval/mlm_accuracy`,
        `eval/top5_accuracy` (the target among the 5 most probable ids),
        `eval/perplexity` (exp of the loss), `eval/masked_tokens`, `eval/rows`, and
        `eval/baseline_accuracy` when `baseline_token` is given.

    Raises:
        ValueError: when no position was masked (nothing to evaluate).
    """
    model.eval()
    device = torch.device(device)
    rows = len(dataset) if max_rows is None else min(max_rows, len(dataset))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    loss_sum, correct, top5, baseline_hits, masked = 0.0, 0, 0, 0, 0
    progress = progress or NullProgress()
    progress.start("evaluate", float(-(-rows // batch_size)), "batches", f"{rows} rows")
    for done, start in enumerate(range(0, rows, batch_size)):
        progress.update("evaluate", float(done), masked_tokens=masked)
        index = torch.arange(start, min(start + batch_size, rows), dtype=torch.long)
        original = dataset.get(index.numpy())
        input_ids, labels = masking(original, index, 0)
        input_ids, labels = input_ids.to(device), labels.to(device)
        targets = labels[labels != IGNORE_INDEX]
        if targets.numel() == 0:
            continue
        document_ids = document_ids_from_sep(original).to(device) if document_attention else None
        with autocast:
            logits = model(input_ids, labels=labels, document_ids=document_ids).logits
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == targets).sum().item()
        top5 += (logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                 == targets[:, None]).any(dim=-1).sum().item()
        if baseline_token is not None:
            baseline_hits += (targets == baseline_token).sum().item()
        masked += targets.numel()
    progress.finish("evaluate", masked_tokens=masked)
    if masked == 0:
        raise ValueError(f"no masked position in {rows} evaluation rows")
    loss = loss_sum / masked
    metrics = {"eval/loss": loss, "eval/mlm_accuracy": correct / masked,
               "eval/top5_accuracy": top5 / masked,
               "eval/perplexity": math.exp(min(loss, 700.0)),  # exp overflows past ~709
               "eval/masked_tokens": float(masked), "eval/rows": float(rows)}
    if baseline_token is not None:
        metrics["eval/baseline_accuracy"] = baseline_hits / masked
    return metrics


@torch.no_grad()
def fill_mask(model: torch.nn.Module, tokenizer: Tokenizer, texts: list[str], *, seq_len: int,
              top_k: int = 5, device: torch.device | str = "cpu") -> list[dict[str, Any]]:
    """Predict each literal `[MASK]` in `texts`.

    Each text becomes `[CLS] pieces [SEP]` (truncated to `seq_len`), with the tokenizer's
    [MASK] id at every `[MASK]` marker and the other special names written in it their
    ids (`Tokenizer.encode_with_mask`, as the exported tokenizer reads them); the
    tokenizer's special ids (`special_ids.all_special_ids`) are never proposed.

    Returns:
        One dict per text: `text`, and `predictions`, a list per mask of `top_k`
        `{"token": piece, "probability": p}` sorted by probability.

    Raises:
        ValueError: when a text holds no `[MASK]` within `seq_len` tokens.
    """
    model.eval()
    results = []
    for text in texts:
        ids = [tokenizer.cls_id, *tokenizer.encode_with_mask(text), tokenizer.sep_id][:seq_len]
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        positions = (input_ids[0] == tokenizer.mask_id).nonzero().flatten()
        if positions.numel() == 0:
            raise ValueError(f"fill-mask probe has no [MASK] within {seq_len} tokens: {text!r}")
        logits = model(input_ids).logits[0, positions].float()
        logits[:, list(tokenizer.special_ids.all_special_ids)] = float("-inf")
        top = logits.softmax(dim=-1).topk(top_k, dim=-1)
        predictions = [[{"token": tokenizer.id_to_piece(int(i)), "probability": float(p)}
                        for p, i in zip(ps, is_)]
                       for ps, is_ in zip(top.values.tolist(), top.indices.tolist())]
        results.append({"text": text, "predictions": predictions})
    return results


def run_probes(model: torch.nn.Module, tok: Tokenizer, cfg: EvalConfig, seq_len: int,
               device: torch.device) -> list[dict[str, Any]]:
    """`fill_mask` on each of `cfg.probes` (top `cfg.top_k`), one result per probe in order;
    a probe that cannot run (no [MASK] within `seq_len` tokens) is reported with an
    `error` instead of failing the evaluation."""
    results = []
    for probe in cfg.probes:
        try:
            results += fill_mask(model, tok, [probe.text], seq_len=seq_len, top_k=cfg.top_k,
                                 device=device)
        except ValueError as exc:
            results.append({"text": probe.text, "error": str(exc)})
    return results


def eval_masking_config(cfg: EvalConfig, masking: MaskingConfig,
                        rate: float | None = None) -> MaskingConfig:
    """The training run's masking settings at the evaluation rate: `rate` when given, else
    `cfg.mlm_probability`, else (None) the training rate (`masking.eval_probability`)."""
    if rate is None:
        rate = masking.eval_probability if cfg.mlm_probability is None else cfg.mlm_probability
    return masking.model_copy(update={"mlm_probability": float(rate)})


def eval_masking(cfg: EvalConfig, masking: MaskingConfig, shards: ShardManifest,
                 tok: Tokenizer, rate: float | None = None) -> KeyedMasking:
    """The evaluation masks: the training run's masking (selection, whole words, 80/10/10)
    at the evaluation rate (`eval_masking_config`), keyed by `cfg.seed` instead of the
    training seed, with the tokenizer's special ids and word boundaries.

    Raises:
        ValueError: the shards were written with other special ids than `tok`'s.
    """
    if shards.special_ids != tok.special_ids:
        raise ValueError(f"shards {shards.path} were written with special ids "
                         f"{shards.special_ids.roles()}, the tokenizer {tok.path} has "
                         f"{tok.special_ids.roles()}")
    return keyed_masking(eval_masking_config(cfg, masking, rate), tok, seed=cfg.seed)


def most_frequent_token(shards: ShardManifest) -> int:
    """The most frequent ordinary (non-special) id in the training split."""
    counts = ShardDataset(shards, "train").token_counts(shards.vocab_size)
    counts[list(shards.special_ids.all_special_ids)] = -1
    return int(counts.argmax())


def check_evaluable(shards: ShardManifest) -> None:
    """Fail before training when the run could not be evaluated at its end.

    Raises:
        ValueError: the validation split has no rows (evaluation would fail after the
            whole training run); the message names the shards directory and the fields
            to change.
    """
    if shards.validation.rows == 0:
        raise ValueError(
            f"{shards.output_dir}: the validation split has no rows of {shards.seq_len} tokens "
            f"({shards.validation.documents} documents, {shards.validation.tokens_in} tokens), "
            "so the run could not be evaluated; raise ingest.validation_fraction or lower "
            "shards.seq_len")


def evaluation_digest(cfg: EvalConfig, trained: TrainManifest, shards: ShardManifest,
                      tokenizer: TokenizerManifest, holdout: Holdout | None,
                      probe: LinearProbeConfig | None, finetune: FinetuneConfig | None) -> str:
    """The digest of `evaluate`'s output (its arguments of the same names): what decides
    the figures, keyed by the training run, the shards and the tokenizer."""
    mc = MaskingConfig(**trained.config["masking"])
    masks = eval_masking_config(cfg, mc)
    document_attention = bool(trained.config["train"].get("document_attention", False))
    data = probe or LinearProbeConfig()
    return compute_digest(
        "evaluate",
        # The key is added only when set, so digests of earlier evaluations still match.
        # The training masks' seed does not change evaluation masks (`cfg.seed` keys them).
        # The periodic settings shape the curve during training, not this evaluation.
        {"eval": cfg.model_dump(mode="json", exclude={
            "every_steps", "periodic_rows", "holdout_sources", "holdout_digest"}),
         "masking": masks.masks_record(),
         **({"train_masking": mc.masks_record()} if cfg.train_rate_metrics else {}),
         **({"document_attention": True} if document_attention else {}),
         **({"holdout": holdout.digest} if holdout is not None else {}),
         **({"linear_probe": probe} if probe is not None and probe.enabled else {}),
         **({"finetune": finetune, "finetune_data": data}
            if finetune is not None and finetune.enabled else {}),
         # A run with a parent is evaluated beside it (`evaluate.parent`).
         **({"parent_arm": trained.init["digest"]} if trained.init else {})},
        {"train": trained.digest, "shards": shards.digest, "tokenizer": tokenizer.digest},
    )


def parent_mlm_metrics(parent: torch.nn.Module, validation: ShardDataset, fixed: KeyedMasking,
                       mlm: dict[str, Any], after: dict[str, float]) -> dict[str, float]:
    """The parent's masked-LM figures (`PARENT_MLM_KEYS`: `eval/parent_*`) on the same
    validation rows and fixed masks as the adapted model's (`after`, logged beside them);
    `mlm` = `masked_lm_metrics`' keyword arguments."""
    before = masked_lm_metrics(parent, validation, masking=fixed, **mlm)
    logger.info("the parent (before adaptation) on the same %d rows and masks: loss %.4f, "
                "mlm_accuracy %.4f; after: loss %.4f, mlm_accuracy %.4f",
                int(before["eval/rows"]), before["eval/loss"], before["eval/mlm_accuracy"],
                after["eval/loss"], after["eval/mlm_accuracy"])
    return {name: before[key] for key, name in PARENT_MLM_KEYS.items()}


def log_results(probes: list[dict[str, Any]], metrics: dict[str, float]) -> None:
    """Log the fill-mask probes' top 3 per mask (or why one was skipped) and the masked-LM
    figures of `metrics` at its masking rate (`eval/mlm_probability`)."""
    for result in probes:
        if "error" in result:
            logger.warning("fill-mask probe skipped: %s", result["error"])
            continue
        tops = [" / ".join(c["token"] for c in mask[:3]) for mask in result["predictions"]]
        logger.info("fill-mask %r -> %s", result["text"], "; ".join(tops))
    logger.info(
        "eval at %.0f %% masking: loss %.4f, mlm_accuracy %.4f (most-frequent-token baseline "
        "%.4f), perplexity %.1f over %d masked tokens", 100 * metrics["eval/mlm_probability"],
        metrics["eval/loss"], metrics["eval/mlm_accuracy"], metrics["eval/baseline_accuracy"],
        metrics["eval/perplexity"], int(metrics["eval/masked_tokens"]),
    )


def evaluate(
    cfg: EvalConfig, trained: TrainManifest, shards: ShardManifest,
    tokenizer: TokenizerManifest, work_dir: str | Path, probe: LinearProbeConfig | None = None,
    progress: Progress | None = None, holdout: Holdout | None = None,
    finetune: FinetuneConfig | None = None,
) -> EvalManifest:
    """Evaluate a trained checkpoint on the validation split, run the fill-mask probes and
    the downstream tasks.

    Masks follow the training run's masking settings (`trained.config["masking"]`) at
    `cfg.mlm_probability`, keyed by `cfg.seed`; the model runs on the run's device and
    precision (`trained.device`, `trained.precision`) and with its document attention
    setting.

    Args:
        cfg: the `eval` config section.
        trained: the training run to evaluate (its final checkpoint and its config).
        shards: the shards it was trained on (validation rows are evaluated).
        tokenizer: its tokenizer (for the probes).
        work_dir: outputs go to `<work_dir>/evaluate/<digest>/`.
        probe: the `linear_probe` section (its tasks are fine-tuning's too); when given
            and enabled, its `probe/*` metrics (`downstream.run_probe`) join the
            manifest's; a task whose data cannot be obtained is a tag instead.
        progress: where the masked-LM pass reports (`masked_lm_metrics`).
        holdout: the fixed holdout text (`ingest.holdout.read_holdout`); when given, the
            model's `holdout/*` metrics (`evaluate.bpc.holdout_metrics`) join the manifest's, the
            text is written beside it and its digest recorded (`config["holdout"]`).
        finetune: the `finetune` section; when given and enabled, its `finetune/*` metrics
            (`finetune.run_finetune`, on `probe`'s tasks) join the manifest's.

    Returns:
        The `EvalManifest` with metrics, probe predictions, tags (`unavailable.*`,
        `digest.task.*`) and the downstream tasks' records (`config["downstream"]`).

    Raises:
        ValueError: when the validation split has no rows, or a task's data is malformed.
    """
    watch = Stopwatch()
    mc = MaskingConfig(**trained.config["masking"])
    masks = eval_masking_config(cfg, mc)
    document_attention = bool(trained.config["train"].get("document_attention", False))
    digest = evaluation_digest(cfg, trained, shards, tokenizer, holdout, probe, finetune)
    out = stage_dir(work_dir, "evaluate", digest)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(trained.device)
    model = load_model(trained.file(trained.checkpoint_dir), device)
    tok = Tokenizer.load(tokenizer)
    validation = ShardDataset(shards, "validation")
    mlm = dict(batch_size=cfg.batch_size, max_rows=cfg.max_rows,
               baseline_token=most_frequent_token(shards), device=device,
               precision=trained.precision, document_attention=document_attention)
    fixed = eval_masking(cfg, mc, shards, tok)
    metrics = masked_lm_metrics(model, validation, masking=fixed, progress=progress, **mlm)
    metrics["eval/mlm_probability"] = float(masks.mlm_probability)
    parent, parent_reason = parent_model(
        trained.init, model, bool(trained.config["train"].get("trust_unverified_checkpoint")))
    if parent is not None:  # before adaptation: the same rows, the same fixed masks
        metrics.update(parent_mlm_metrics(parent, validation, fixed, mlm, metrics))
    if cfg.train_rate_metrics and not math.isclose(mc.eval_probability, masks.mlm_probability):
        at_train = masked_lm_metrics(
            model, validation, masking=eval_masking(cfg, mc, shards, tok, mc.eval_probability),
            **mlm)
        metrics.update({"eval/loss_at_train_rate": at_train["eval/loss"],
                        "eval/mlm_accuracy_at_train_rate": at_train["eval/mlm_accuracy"]})
    warn_answer_problems(tok, cfg.probes)
    probes = run_probes(model, tok, cfg, shards.seq_len, device)
    metrics.update(probe_metrics(probes, cfg.probes, cfg.top_k))
    held = None
    if holdout is not None:
        held = write_holdout_text(holdout, out)
        metrics.update(holdout_metrics(model, tok, holdout.documents, cfg, device))
    with reporting(progress):  # the probe reports its encoders' rows to the same reporter
        downstream = downstream_results(probe, finetune, model, tok, device, parent)
    metrics.update(downstream.metrics)
    if parent_reason is not None:
        downstream.tags.update(parent_tags(parent_reason, probe is not None and probe.enabled,
                                           finetune is not None and finetune.enabled))
    log_results(probes, metrics)
    manifest = EvalManifest(
        stage="evaluate", digest=digest, output_dir=str(out),
        config={"eval": cfg.model_dump(mode="json"), "masking": masks.masks_record(),
                "train_masking": mc.masks_record(), "document_attention": document_attention,
                **({"holdout": held} if held else {}),
                "linear_probe": probe.model_dump(mode="json") if probe else None,
                **({"finetune": finetune.model_dump(mode="json")} if finetune else {}),
                "downstream": downstream.tasks},
        inputs={"train": trained.digest, "shards": shards.digest, "tokenizer": tokenizer.digest},
        created_at=watch.created_at, wall_time_s=watch.elapsed, metrics=metrics,
        probes=probes, tags=downstream.tags)
    write_manifest(manifest)
    return manifest


def downstream_results(probe: LinearProbeConfig | None, finetune: FinetuneConfig | None,
                       model: torch.nn.Module, tok: Tokenizer, device: torch.device,
                       parent: torch.nn.Module | None = None) -> DownstreamResult:
    """The linear probe and fine-tuning of `model` on `probe`'s tasks, when enabled, with a
    parent arm when `parent` (the weights the run started from, `evaluate.parent`) is
    given; a disabled one is the tag `unavailable.probe` / `unavailable.finetune` with the
    reason."""
    result = DownstreamResult()
    encoder = ours(model, tok)
    if probe is not None and probe.enabled:
        result.update(run_probe(probe, encoder, device=device, parent=parent))
    else:
        result.tags["unavailable.probe"] = "disabled (linear_probe.enabled: false)"
    if finetune is not None and finetune.enabled:
        result.update(run_finetune(finetune, probe or LinearProbeConfig(), encoder,
                                   device=device, parent=parent))
    else:
        result.tags["unavailable.finetune"] = "disabled (finetune.enabled: false)"
    return result
