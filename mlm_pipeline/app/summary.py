"""The run summary: what a user reads at the end of a pipeline run (ids, where things are,
how training went, final metrics, the registry decision), as a JSON-able dict, plain-text
lines for the terminal and a Markdown report.

The `train-evaluate` flow builds it, `runlog` prints it. No torch, no prefect.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mlm_pipeline.manifest import (CorpusManifest, EvalManifest, ShardManifest,
                                   TokenizerManifest, TrainManifest)
from mlm_pipeline.tracking.plots import LOSS_PLOT
from mlm_pipeline.tracking.records import package_versions
from mlm_pipeline.tracking.tracker import MlflowTracker


def summary(tracker: MlflowTracker, run_id: str, corpus: CorpusManifest,
            tokenizer: TokenizerManifest, shards: ShardManifest, trained: TrainManifest,
            evaluated: EvalManifest, started_at: float | None = None,
            registry: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a user needs at the end of a run: ids, where things are, final metrics (JSON-able).

    Args:
        tracker, run_id: the MLflow run (its id, tracking URI and page).
        corpus, tokenizer, shards, trained, evaluated: the stages' manifests.
        started_at: Unix time (s) at which this run started. A stage whose manifest was
            created before it was reused from an earlier run (cache hit): it is listed in
            `reused_stages`, and its `wall_time_s` is the time it took when it was made.
        registry: what `app.publish.publish` decided (None: no model registered).

    Returns:
        Run id, tracking URI and run page, final metrics (the training loop's last log
        interval and evaluation), steps, `max_steps` (the budget trained to: a continued
        run's, which its MLflow param may not show), tokens seen, the tokenizer's `spm.model`,
        `train_time_s` (seconds of training loop over every segment of a resumed run:
        `TrainManifest.train_time_s`, else the training stage's wall time),
        `train_tokens_per_s_mean` (tokens seen / `train_time_s`),
        `train_tokens_per_s_last` (the last log interval's, None without one), whether
        training stopped early and `stop_reason` (`max_steps` or `time_cap`: a run stopped
        by a non-finite loss or an interruption fails and has no summary), `device` and
        `precision` trained with, `mfu_peak_tflops` and `mfu_peak_source`, checkpoint,
        manifests, per-stage wall times (s), `reused_stages`, `versions`
        (`package_versions`), `files_rejected` (path and reason of every input file
        ingestion rejected as bad), `registry` (model name, version, decision and
        reason, both losses, eval data digest; None when not registered), `unavailable`
        (downstream figures not computed, with the reason: `probe`, `finetune`, ...) and
        `validation_overlap` (`overlap_summary`).
    """
    stages = (corpus, tokenizer, shards, trained, evaluated)
    reused = [m.stage for m in stages if started_at is not None and m.created_at < started_at]
    train_time = trained.train_time_s if trained.train_time_s is not None else trained.wall_time_s
    last = trained.final_metrics.get("train/tokens_per_s")
    return {
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": tracker.tracking_uri,
        "mlflow_run_url": tracker.run_url(run_id),
        "mlflow_experiment_id": tracker.run_experiment_id(run_id),
        "loss_plot": LOSS_PLOT,
        "metrics": {**trained.final_metrics, **evaluated.metrics},
        "steps": trained.steps,
        "max_steps": trained.config.get("train", {}).get("max_steps"),
        "tokens_seen": trained.tokens_seen,
        "train_time_s": round(train_time, 2),
        "train_tokens_per_s_mean": round(trained.tokens_seen / max(train_time, 1e-9), 1),
        "train_tokens_per_s_last": None if last is None else round(last, 1),
        "stopped_early": trained.stopped_early,
        "stop_reason": trained.stop_reason,
        "device": trained.device,
        "precision": trained.precision,
        "mfu_peak_tflops": trained.peak_tflops,
        "mfu_peak_source": trained.peak_source,
        "versions": package_versions(),
        "checkpoint": str(trained.file(trained.checkpoint_dir)),
        "tokenizer_model": str(tokenizer.file(tokenizer.model.path)),
        "manifests": {m.stage: str(m.path) for m in stages},
        "wall_time_s": {m.stage: round(m.wall_time_s, 2) for m in stages},
        "reused_stages": reused,
        "files_rejected": [{"path": b.path, "reason": b.reason}
                           for b in getattr(corpus, "bad_files", [])],
        "registry": registry_summary(registry),
        "unavailable": {k.removeprefix("unavailable."): v for k, v in evaluated.tags.items()
                        if k.startswith("unavailable.")},
        "validation_overlap": overlap_summary(corpus),
    }


def overlap_summary(corpus: CorpusManifest) -> dict[str, Any] | None:
    """The corpus's validation<->training n-gram overlap (`ingest.overlap`) with its share,
    JSON-able; None when not measured."""
    overlap = getattr(corpus, "validation_overlap", None)
    if overlap is None:
        return None
    return {**overlap.model_dump(), "share": overlap.share}


def registry_summary(registry: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON-able part of a registry decision shown to users: model, version, model URI,
    decision and reason, the metric decided on, this version's and the previous champion's
    `eval/loss` (the champion's on this version's eval data when it was re-scored:
    `champion_rescored`; its own when not compared), the eval data digest and the
    champion version after the decision."""
    if registry is None:
        return None
    before = registry.get("champion_before") or {}
    theirs = registry.get("champion_eval_loss")
    return {"model": registry["name"], "version": registry["version"],
            "model_uri": registry.get("model_uri"), "decision": registry["decision"],
            "reason": registry["reason"], "metric": registry.get("metric", "eval/loss"),
            "eval_loss": registry["eval_loss"],
            "champion_eval_loss": before.get("eval_loss") if theirs is None else theirs,
            "champion_rescored": bool(registry.get("champion_rescored")),
            "champion_before": before.get("version"),
            "champion_version": registry["champion_version"],
            "eval_data_digest": registry["eval_data"]}


def registry_lines(reg: dict[str, Any]) -> list[str]:
    """The registry decision of a summary as lines of text (CLI and Markdown)."""
    theirs = reg.get("champion_eval_loss")
    return [(f"Registered model: {reg['model']} version {reg['version']} "
             f"(models:/{reg['model']}/{reg['version']})"),
            f"Decision: {reg['decision']}: {reg['reason']}",
            f"eval/loss: {reg['eval_loss']:.4f} (this version), "
            + (f"{theirs:.4f} (champion before"
               + (", re-scored on this version's eval data)" if reg.get("champion_rescored")
                  else ")") if theirs is not None else "no champion loss compared")
            + f"; eval data digest {reg['eval_data_digest'][:16]}",
            (f"Champion now: version {reg['champion_version']} "
             f"(models:/{reg['model']}@champion)")]


def write_summary(summary_dict: dict[str, Any], path: str | Path) -> Path:
    """Write the run summary as indented JSON; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(summary_dict, indent=2, sort_keys=True) + "\n")
    return p


#: What each `stop_reason` means, for a reader of the summary.
STOP_REASONS = {"max_steps": "all train.max_steps trained",
                "time_cap": "stopped early: train.max_time_s was reached",
                "nonfinite": "stopped: the loss or gradient norm became non-finite",
                "interrupted": "stopped: interrupted (SIGINT/SIGTERM)"}


def training_lines(summary_dict: dict[str, Any]) -> list[str]:
    """How training went, as lines of plain text (CLI and Markdown): steps, tokens, training
    time and the mean and last-interval tokens/s, the stop reason, device and precision, the
    MFU peak and its source, the package versions, then what the evaluation shows beside
    its controls (`evaluation_lines`). Keys missing from an older summary are left out."""
    d = summary_dict
    lines = [f"Training: {d['steps']:,} steps, {d['tokens_seen']:,} tokens"
             + (f" in {d['train_time_s']:,.1f} s of training loop" if "train_time_s" in d else "")
             + f"; mean {d.get('train_tokens_per_s_mean', 0):,.0f} tokens/s over the run"
             + (f", {d['train_tokens_per_s_last']:,.0f} tokens/s in the last log interval"
                if d.get("train_tokens_per_s_last") is not None else "")]
    reason = d.get("stop_reason", "max_steps")
    why = STOP_REASONS.get(reason, reason)
    if reason == "max_steps" and d.get("max_steps"):  # the budget this run trained to
        why = f"all {d['max_steps']:,} train.max_steps trained"
    lines.append(f"Stop reason: {reason} ({why})")
    if "device" in d:
        lines.append(f"Device: {d['device']}, precision {d['precision']}"
                     + (f"; MFU peak {d['mfu_peak_tflops']:.4g} TFLOP/s "
                        f"({d['mfu_peak_source']})" if d.get("mfu_peak_tflops") else ""))
    if versions := d.get("versions"):
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    return lines + evaluation_lines(d)


def evaluation_lines(summary_dict: dict[str, Any]) -> list[str]:
    """What the evaluation shows, each figure beside its controls: held-out masked
    accuracy at its masking rate (and at the training rate), the validation<->training
    overlap, the linear probe (`probe_line`), fine-tuning (`finetune_line`) and the figures
    not computed, with the reason."""
    m = summary_dict.get("metrics", {})
    lines = []
    if "eval/mlm_accuracy" in m:
        rate = m.get("eval/mlm_probability")
        lines.append(
            "Held-out masked LM" + (f" at {100 * rate:.0f} % masking" if rate else "")
            + f": accuracy {m['eval/mlm_accuracy']:.4f}, loss {m.get('eval/loss', math.nan):.4f}"
            + (f" (most-frequent-token baseline {m['eval/baseline_accuracy']:.4f})"
               if "eval/baseline_accuracy" in m else "")
            + (f"; at the training rate: accuracy {m['eval/mlm_accuracy_at_train_rate']:.4f}, "
               f"loss {m.get('eval/loss_at_train_rate', math.nan):.4f}"
               if "eval/mlm_accuracy_at_train_rate" in m else "")
            + (f"; the parent (before adaptation), same rows and masks: accuracy "
               f"{m['eval/parent_mlm_accuracy']:.4f}, loss {m['eval/parent_loss']:.4f}"
               if "eval/parent_loss" in m else ""))
    if overlap := summary_dict.get("validation_overlap"):
        lines.append(f"Validation text also in training: {100 * overlap['share']:.1f} % of "
                     f"its {overlap['validation_windows']:,} word {overlap['ngram']}-gram "
                     f"windows ({overlap['lines_removed']:,} training lines removed from it)")
    lines += [line for line in (probe_line(m), finetune_line(m)) if line is not None]
    return lines + [f"Not computed: {figure}: {reason}"
                    for figure, reason in sorted(summary_dict.get("unavailable", {}).items())]


def _f(m: dict[str, float], key: str) -> str:
    """`m[key]` to 4 decimals, or `-`."""
    return f"{m[key]:.4f}" if key in m else "-"


def _sd(m: dict[str, float], key: str) -> str:
    """`m[key]` with its `_sd`, when known."""
    return f"{m[key]:.4f} +- {m[key + '_sd']:.4f}" if key + "_sd" in m else _f(m, key)


def probe_line(metrics: dict[str, float]) -> str | None:
    """The linear probe of the first task beside its controls, in one line; None when
    `metrics` has no `probe/accuracy`."""
    if "probe/accuracy" not in metrics:
        return None
    m = {k.removeprefix("probe/"): v for k, v in metrics.items() if k.startswith("probe/")}
    return (f"Linear probe ({m.get('test_rows', 0):,.0f} test rows): trained "
            f"{m['accuracy']:.4f}"
            + (f" | parent {m['accuracy_parent']:.4f}" if "accuracy_parent" in m else "")
            + f" | random init {_sd(m, 'accuracy_random_init')} | TF-IDF "
            f"{_f(m, 'tfidf_accuracy')} whole text, {_f(m, 'tfidf_accuracy_same_input')} "
            f"same input | majority {_f(m, 'majority_accuracy')}")


def finetune_line(metrics: dict[str, float]) -> str | None:
    """The fine-tuning evaluation (`evaluate.finetune`) of the first task in one line:
    test accuracy mean +- sd over the seeds pretrained and from random weights, the paired
    difference with its 95 % interval, TF-IDF and majority class; None when `metrics` has
    no `finetune/accuracy`."""
    if "finetune/accuracy" not in metrics:
        return None
    m = {k.removeprefix("finetune/"): v for k, v in metrics.items()
         if k.startswith("finetune/")}
    interval = (f" [{m['diff_ci95_low']:+.4f}, {m['diff_ci95_high']:+.4f}] (95 %, paired t "
                "over seeds)" if "diff_ci95_low" in m else "")
    return (f"Fine-tuning ({m.get('seeds', 1):.0f} seeds, up to {m.get('epochs', 0):.0f} "
            f"epochs on {m.get('train_rows', 0):,.0f} rows, lr and epoch chosen on "
            f"{m.get('dev_rows', 0):,.0f} dev rows, tested on {m.get('test_rows', 0):,.0f}): "
            f"pretrained {_sd(m, 'accuracy')}"
            + (f" (lr {m['lr']:g}, epoch {m['epoch']:.0f})" if "lr" in m else "")
            + f" | from random weights {_sd(m, 'scratch_accuracy')}"
            + (f" (lr {m['scratch_lr']:g}, epoch {m['scratch_epoch']:.0f})"
               if "scratch_lr" in m else "")
            + (f" | pretrained - scratch {m['diff']:+.4f}{interval}" if "diff" in m else "")
            + _parent_arm(m)
            + f" | TF-IDF {_f(m, 'tfidf_accuracy')} whole text, "
            f"{_f(m, 'tfidf_accuracy_same_input')} same input | majority "
            f"{_f(m, 'majority_accuracy')}"
            + (f"; {m['wall_time_s']:,.0f} s" if "wall_time_s" in m else ""))


def _parent_arm(m: dict[str, float]) -> str:
    """The fine-tuning's parent arm and the paired adapted - parent difference, or ""."""
    if "parent_accuracy" not in m:
        return ""
    interval = (f" [{m['diff_parent_ci95_low']:+.4f}, {m['diff_parent_ci95_high']:+.4f}] "
                "(95 %, paired t over seeds)" if "diff_parent_ci95_low" in m else "")
    return (f" | parent {_sd(m, 'parent_accuracy')}"
            + (f" (lr {m['parent_lr']:g}, epoch {m['parent_epoch']:.0f})"
               if "parent_lr" in m else "")
            + (f" | adapted - parent {m['diff_parent']:+.4f}{interval}"
               if "diff_parent" in m else ""))


def summary_markdown(summary_dict: dict[str, Any]) -> str:
    """A Markdown report of a finished run: MLflow run (with link when served), how
    training went (`training_lines`), the final metrics, per-stage wall times and reuse,
    and where the checkpoint and manifests are."""
    run = summary_dict["mlflow_run_id"]
    link = summary_dict.get("mlflow_run_url")
    lines = [
        "# mlm-pretraining run",
        "",
        f"MLflow run: [{run}]({link})" if link else
        f"MLflow run: `{run}` (tracking URI `{summary_dict['mlflow_tracking_uri']}`)",
        "",
        f"Loss plot: [{LOSS_PLOT}]({link}/artifacts/{LOSS_PLOT})" if link else
        f"Loss plot: run artifact `{LOSS_PLOT}`",
        "",
        *(f"- {line}" for line in training_lines(summary_dict)),
        "",
        "| metric | value |",
        "|---|---:|",
    ]
    for key, value in sorted(summary_dict["metrics"].items()):
        lines.append(f"| `{key}` | {value:,.4f} |")
    if rejected := summary_dict.get("files_rejected"):
        lines += ["", f"Input files rejected as bad ({len(rejected)}; see the ingest "
                  "manifest): " + ", ".join(f"`{r['path']}` ({r['reason']})" for r in rejected)]
    if reg := summary_dict.get("registry"):
        lines += ["", "## Model registry", ""] + [f"- {line}" for line in registry_lines(reg)]
    lines += ["", f"Checkpoint: `{summary_dict['checkpoint']}`", "", "| stage | seconds | manifest |",
              "|---|---:|---|"]
    reused = set(summary_dict.get("reused_stages", ()))
    for stage, path in summary_dict["manifests"].items():
        seconds = summary_dict["wall_time_s"][stage]
        shown = f"reused ({seconds} when made)" if stage in reused else seconds
        lines.append(f"| {stage} | {shown} | `{path}` |")
    return "\n".join(lines) + "\n"
