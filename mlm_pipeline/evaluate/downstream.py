"""Downstream linear probe, beside its controls: is the encoder useful for classification?

Logistic regression on the frozen encoder's mean-pooled final hidden states (a linear
probe: Alain & Bengio 2016, "Understanding intermediate layers using linear classifier
probes"; mean pooling as in Sentence-BERT, Reimers & Gurevych 2019), on each downstream
task's fixed split (`tasks`): fit on the train rows, scored on the test rows (the dev rows
are fine-tuning's). A probe figure means little alone: randomly initialised encoders of
our `tiny` shape score 0.59-0.66 on the review set, inside the range of trained ones. So
the same code runs, in the same call, on:

- the trained encoder: `probe/accuracy`;
- `linear_probe.random_init_seeds` randomly initialised encoders of the same architecture
  (`TextEncoder.random_init`, seeds 0, 1, ...; never the trained weights):
  `probe/accuracy_random_init` (their mean) and `probe/accuracy_random_init_sd`;
- in a run with a parent (`train.init_from`), the weights it started from
  (`evaluate.parent`): `probe/accuracy_parent`;
- the majority class of train: `probe/majority_accuracy`;
- TF-IDF word 1-2-grams + logistic regression on the whole text, `probe/tfidf_accuracy`,
  and on exactly the pieces the encoder sees, decoded (`encoders.seen_texts`),
  `probe/tfidf_accuracy_same_input`.

With `linear_probe.input: windows` (the default) the encoder sees the whole text, so the two
TF-IDF figures differ only by what decoding normalizes; with `head` they differ by the
truncation (on the review set at 128 tokens, 60 % of reviews are longer).

Keys: the first task's are `probe/<figure>`, another task's `probe/<task name>/<figure>`;
also `.../train_rows`, `dev_rows`, `test_rows`, `classes`, `duplicates_dropped` and
`pieces_seen_share`. A task that cannot be run leaves its figures out and says why in the
tag `unavailable.probe` (`unavailable.probe/<task name>`). The data, split and TF-IDF
figures do not depend on the model and are cached per process, so the probe is cheap to
repeat at each periodic evaluation (`controls=False` runs the trained encoder alone).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mlm_pipeline.config import ClassificationTask, LinearProbeConfig
from mlm_pipeline.errors import DataUnavailable
from mlm_pipeline.evaluate.encoders import (
    EncodedTexts,
    TextEncoder,
    encoder_rows,
    full_texts,
    length_batches,
    ours,
    pooled_sums,
    seen_texts,
)
from mlm_pipeline.evaluate.stats import mean_sd
from mlm_pipeline.evaluate.tasks import Rows, TaskSplit, load_task, majority_rate
from mlm_pipeline.manifest import TokenizerManifest, TrainManifest
from mlm_pipeline.progress import active
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.checkpoint import load_model

logger = logging.getLogger(__name__)

#: Iteration cap of scikit-learn's lbfgs solver (its default of 100 stops short of
#: convergence on 1-2-gram TF-IDF features).
MAX_ITER = 2000
#: Longest reason kept in an `unavailable.*` tag (MLflow caps tag values at 8,000).
MAX_TAG_CHARS = 1000


@dataclass
class DownstreamResult:
    """What a downstream evaluation adds to the evaluation manifest: metrics, run tags
    (`unavailable.*` reasons, `digest.task.*`) and a record per task run."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    tasks: list[dict[str, Any]] = field(default_factory=list)

    def update(self, other: DownstreamResult) -> None:
        """Add `other`'s metrics, tags and task records (a task recorded once: what
        `other`'s record of it adds, fine-tuning's per-seed `finetune`, joins the first)."""
        self.metrics.update(other.metrics)
        self.tags.update(other.tags)
        for task in other.tasks:
            mine = next((t for t in self.tasks if t["name"] == task["name"]), None)
            if mine is None:
                self.tasks.append(task)
            else:
                mine.update({k: v for k, v in task.items() if k not in mine})


def prefix(kind: str, index: int, task: ClassificationTask) -> str:
    """Metric-key prefix of a task: `kind/` for the first, `kind/<name>/` for the others."""
    return f"{kind}/" if index == 0 else f"{kind}/{task.name}/"


def unavailable_tag(key_prefix: str) -> str:
    """The tag naming why a figure (or a task's figures, `probe/`) was not computed."""
    return "unavailable." + key_prefix.rstrip("/")


def load_tasks(cfg: LinearProbeConfig, kind: str, result: DownstreamResult
               ) -> list[tuple[str, TaskSplit]]:
    """`(key prefix, split)` of every task of `cfg` that can be loaded; for one that
    cannot, a warning and the tag `unavailable.<kind>[/<name>]` with the reason in `result`;
    every loaded task's split digest as tag `digest.task.<name>` and record.

    Raises:
        ValueError: as `tasks.load_task` (malformed data).
    """
    loaded = []
    for i, task in enumerate(cfg.tasks):
        key = prefix(kind, i, task)
        try:
            split = load_task(task, cfg)
        except DataUnavailable as exc:
            logger.warning("%s: task %s skipped: %s", kind, task.name, exc)
            result.tags[unavailable_tag(key)] = f"no data: {exc}"[:MAX_TAG_CHARS]
            continue
        result.tags[f"digest.task.{task.name}"] = split.digest
        result.tasks.append(split.record())
        loaded.append((key, split))
    return loaded


@torch.no_grad()
def embed(encoder: TextEncoder, module: torch.nn.Module, encoded: EncodedTexts, *,
          batch_size: int = 32, device: torch.device | str = "cpu",
          on_rows: Callable[[int], None] | None = None) -> np.ndarray:
    """Mean-pooled final hidden states of the encoded texts (`encoders.pooled_states`),
    `module` frozen: float32 (texts, H), row i the text i of `encoded`. `on_rows(n)` is
    called after each batch with the `n` rows it encoded (progress).

    Rows run in batches of about `batch_size` texts' worth of rows sorted by length
    (`encoders.length_batches`), each text's sums accumulated over the batches its rows fall
    in. The module runs in eval mode under `no_grad`, its mode restored afterwards.
    """
    n_texts = len(encoded.seen)
    rows_per_batch = max(1, round(batch_size * len(encoded.rows) / max(1, n_texts)))
    sums = torch.zeros(n_texts, encoder.hidden_size)
    counts = torch.zeros(n_texts)
    was_training = module.training
    module.eval()
    try:
        for batch in length_batches(encoded, rows_per_batch):
            got, n = pooled_sums(encoder, module, [encoded.rows[r] for r in batch],
                                 [encoded.owner[r] for r in batch], n_texts, device)
            sums += got.cpu()
            counts += n.cpu()
            if on_rows is not None:
                on_rows(len(batch))
    finally:
        module.train(was_training)
    return (sums / counts.unsqueeze(-1)).numpy()


def encode_split(encoder: TextEncoder, rows: Rows, cfg: LinearProbeConfig,
                 input: str | None = None, seq_len: int | None = None) -> EncodedTexts:
    """What `encoder` sees of a split's rows under `cfg` (`input`, `max_windows`;
    `input` and `seq_len` override)."""
    return encoder_rows(encoder, rows.texts, rows.pairs, input=input or cfg.input,
                        seq_len=seq_len, max_windows=cfg.max_windows)


def probe_accuracy(features: dict[str, np.ndarray], split: TaskSplit, C: float) -> float:
    """Test accuracy of `StandardScaler` + `LogisticRegression(C=C)` fit on the train
    features (`features["train"]`, `features["test"]`: (rows, H))."""
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=MAX_ITER))
    clf.fit(features["train"], np.asarray(split.train.labels))
    return float(clf.score(features["test"], np.asarray(split.test.labels)))


@functools.lru_cache(maxsize=16)
def tfidf_accuracy(train: tuple[str, ...], train_labels: tuple[int, ...],
                   test: tuple[str, ...], test_labels: tuple[int, ...], C: float) -> float:
    """Test accuracy of TF-IDF word 1-2-grams + `LogisticRegression(C=C)` fit on `train`
    (cached per texts). The vectorizer keeps scikit-learn's defaults otherwise: lowercased
    words of 2+ word characters, raw tf times smoothed idf, rows l2-normalized."""
    clf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2)),
                        LogisticRegression(C=C, max_iter=MAX_ITER))
    clf.fit(list(train), list(train_labels))
    return float(clf.score(list(test), list(test_labels)))


def baselines(encoder: TextEncoder, split: TaskSplit, encoded: dict[str, EncodedTexts],
              C: float) -> dict[str, float]:
    """The model-free controls on `split`: `majority_accuracy`, `tfidf_accuracy` (whole
    text) and `tfidf_accuracy_same_input` (the decoded pieces of `encoded["train"]` and
    `encoded["test"]`, what the encoder sees)."""
    same = {name: tuple(seen_texts(encoder, e)) for name, e in encoded.items()}
    return {
        "majority_accuracy": majority_rate(split),
        "tfidf_accuracy": tfidf_accuracy(
            tuple(full_texts(split.train.texts, split.train.pairs)), split.train.labels,
            tuple(full_texts(split.test.texts, split.test.pairs)), split.test.labels, C),
        "tfidf_accuracy_same_input": tfidf_accuracy(
            same["train"], split.train.labels, same["test"], split.test.labels, C),
    }


def split_counts(split: TaskSplit, encoded: Sequence[EncodedTexts]) -> dict[str, float]:
    """Row counts of `split`, its classes, its duplicates and the share of pieces seen."""
    pieces = sum(e.pieces for e in encoded)
    seen = sum(e.pieces_seen_share * e.pieces for e in encoded)
    return {"train_rows": float(len(split.train)), "dev_rows": float(len(split.dev)),
            "test_rows": float(len(split.test)), "classes": float(split.num_classes),
            "duplicates_dropped": float(split.duplicates_dropped),
            "pieces_seen_share": seen / max(1, pieces)}


def probe_task(cfg: LinearProbeConfig, encoder: TextEncoder, split: TaskSplit, *,
               device: torch.device | str = "cpu", controls: bool = True,
               parent: torch.nn.Module | None = None) -> dict[str, float]:
    """The probe on one task (module docstring), keys without their prefix.

    Args:
        cfg: the `linear_probe` section (`input`, `max_windows`, `C`, `tfidf_C`,
            `random_init_seeds`, `batch_size`).
        encoder: the trained encoder (its module is not changed).
        split: the task's split.
        device: where the encoder runs (the random-init ones too).
        controls: False: the trained encoder's `accuracy` alone.
        parent: the module the run started from (same architecture as `encoder.module`,
            not changed), probed with the same code: `accuracy_parent` (with `controls`).

    Reports stage `probe <task>` (rows encoded, of every encoder) to the active reporter
    (`progress.active`).
    """
    encoded = {"train": encode_split(encoder, split.train, cfg),
               "test": encode_split(encoder, split.test, cfg)}
    stage, progress, done = f"probe {split.name}", active(), 0
    parents = [parent] if controls and parent is not None else []
    seeds = cfg.random_init_seeds if controls else 0
    rows = (1 + len(parents) + seeds) * sum(len(e.rows) for e in encoded.values())
    progress.start(stage, float(rows), "rows",
                   f"the trained encoder, {len(parents)} parent and {seeds} random inits")

    def rows_done(n: int) -> None:
        nonlocal done
        done += n
        progress.update(stage, float(done))

    def accuracy(module: torch.nn.Module) -> float:
        features = {name: embed(encoder, module, e, batch_size=cfg.batch_size, device=device,
                                on_rows=rows_done)
                    for name, e in encoded.items()}
        return probe_accuracy(features, split, cfg.C)

    metrics = {"accuracy": accuracy(encoder.module)}
    for module in parents:
        metrics["accuracy_parent"] = accuracy(module.to(device))
    random = [accuracy(encoder.random_init(seed).module.to(device)) for seed in range(seeds)]
    progress.finish(stage)
    if not controls:
        return metrics
    metrics["accuracy_random_init"], metrics["accuracy_random_init_sd"] = mean_sd(random)
    metrics.update(baselines(encoder, split, encoded, cfg.tfidf_C))
    metrics.update(split_counts(split, list(encoded.values())))
    return metrics


def run_probe(cfg: LinearProbeConfig, encoder: TextEncoder, *,
              device: torch.device | str = "cpu", controls: bool = True,
              parent: torch.nn.Module | None = None) -> DownstreamResult:
    """The linear probe on every task of `cfg` (`enabled` is not consulted here).

    Args:
        cfg: the `linear_probe` section.
        encoder: the trained encoder, ours or a Hugging Face one (`encoders`).
        device: where it runs.
        controls: False: `probe/accuracy` of the trained encoder alone (periodic
            evaluations); no tags then.
        parent: the module the run started from: `probe/accuracy_parent` (`probe_task`).

    Returns:
        Metrics (module docstring), tags and task records; a task whose data cannot be
        obtained has a tag instead of metrics.

    Raises:
        ValueError: malformed task data (file and line named).
    """
    result = DownstreamResult()
    for key, split in load_tasks(cfg, "probe", result):
        got = probe_task(cfg, encoder, split, device=device, controls=controls, parent=parent)
        result.metrics.update({key + k: v for k, v in got.items()})
        if controls:
            logger.info(
                "linear probe %s: accuracy %.4f (%srandom init %.4f +- %.4f over %d seeds; "
                "TF-IDF %.4f whole text, %.4f same input; majority %.4f) on %d test rows, "
                "%d train rows", split.name, got["accuracy"],
                f"parent {got['accuracy_parent']:.4f}; " if "accuracy_parent" in got else "",
                got["accuracy_random_init"], got["accuracy_random_init_sd"],
                cfg.random_init_seeds, got["tfidf_accuracy"], got["tfidf_accuracy_same_input"],
                got["majority_accuracy"], len(split.test), len(split.train))
            if cfg.random_init_seeds < 2:
                result.tags[unavailable_tag(key + "accuracy_random_init_sd")] = (
                    "one random-init seed (linear_probe.random_init_seeds: 1)")
    if not controls:
        result.tags.clear()
        result.tasks.clear()
    return result


def linear_probe(cfg: LinearProbeConfig, model: torch.nn.Module, tokenizer: Tokenizer, *,
                 seq_len: int | None = None, device: torch.device | str = "cpu",
                 controls: bool = False) -> dict[str, float] | None:
    """The probe's metrics for our model: by default `probe/accuracy` of the trained encoder
    alone, per task (what the periodic evaluation logs as a curve); `controls` adds the
    controls (`run_probe`).

    Args:
        cfg, device, controls: as `run_probe`.
        model: a `BertMLM` (or a wrapper of one); not changed.
        tokenizer: its tokenizer.
        seq_len: tokens per row; None: the model's.

    Returns:
        The metrics, or None when no task could be run.
    """
    encoder = ours(model, tokenizer)
    if seq_len is not None:
        encoder = replace(encoder, seq_len=min(seq_len, encoder.seq_len))
    return run_probe(cfg, encoder, device=device, controls=controls).metrics or None


def run_linear_probe(cfg: LinearProbeConfig, trained: TrainManifest,
                     tokenizer: TokenizerManifest) -> DownstreamResult | None:
    """Run the probe on a training run's final checkpoint, rebuilt on the run's device
    (`trained.device`); None when `cfg.enabled` is False.

    Raises:
        ValueError: as `run_probe`.
        FileNotFoundError: the checkpoint is incomplete.
    """
    if not cfg.enabled:
        logger.info("linear probe disabled (linear_probe.enabled: false)")
        return None
    device = torch.device(trained.device)
    model = load_model(Path(trained.file(trained.checkpoint_dir)), device)
    return run_probe(cfg, ours(model, Tokenizer.load(tokenizer)), device=device)
