"""Fine-tuning evaluation: does pretraining help a classifier trained end to end, and how
sure is the answer?

The linear probe (`downstream`) freezes the encoder; users of an MLM fine-tune it. Here the
encoder plus a classification head is fine-tuned on each downstream task (`tasks`: its
fixed train / dev / test split) in arms that differ only in the encoder's starting
weights: the trained encoder (`pretrained`), the same architecture from random
weights (`scratch`, `TextEncoder.random_init`: never the trained weights) and, in a run
with a parent (`train.init_from`), the weights it started from (`parent`,
`evaluate.parent`). The protocol, identical for every arm and for any encoder, ours or a
Hugging Face one (`encoders`):

1. For every learning rate of the grid (`FinetuneConfig.lr_grid`: {1e-4, 3e-4, 1e-3} below
   hidden size 768, after Turc et al. 2019's grid for small BERTs; BERT's {2e-5, 3e-5,
   5e-5} for the base shapes, Devlin et al. 2019, appendix A.3) and every seed s (`seeds`
   of them from `seed`), fine-tune for `epochs` epochs on the train rows and score the dev
   rows after each epoch. Seed s draws the head, the row order and dropout (and the
   scratch arm's encoder), the same for every arm.
2. Per arm, choose the learning rate and epoch with the highest mean dev accuracy over the
   seeds (`selection.choose_on_dev`): only dev rows enter the choice, never test rows.
3. Report per arm the mean and sample sd over the seeds of the test accuracy, and the
   paired difference pretrained - scratch (seed by seed) with its 95 % paired t interval
   (`stats.paired_difference`), and adapted - parent likewise when there is a parent,
   beside the majority class and TF-IDF on the whole text and on the pieces the encoder
   sees (`downstream.baselines`, the probe's).

The encoder sees the whole text by default (`input: windows`, states mean-pooled over
windows of `seq_len`; `encoders`). The head is BERT's sequence classifier on the mean-pooled
state instead of `[CLS]` (our pretraining has no next-sentence task that would train
`[CLS]` to summarize a row; Reimers & Gurevych 2019): mean -> dropout -> linear (H -> C),
its weight drawn from a truncated normal of std 0.02 (BERT's initializer range), zero bias.
The optimizer is BERT's fine-tuning one (Devlin et al. 2019, appendix A.3;
google-research/bert optimization.py): AdamW, eps 1e-6, decay on matrices only, linear
warm-up then linear decay to 0 over all the epochs, gradient norm clipped at 1,
cross-entropy. Everything runs in fp32; on CPU a seed gives the same weights and figures.

Keys (`finetune/` for the first task, `finetune/<name>/` for others), per arm (prefix:
none for pretrained, `scratch_`, `parent_`): `accuracy`, `accuracy_sd`, the chosen `lr`,
`epoch` and `dev_accuracy`; the paired `diff` (pretrained - scratch) and `diff_parent`
(adapted - parent), each with `_sd`, `_ci95_low`, `_ci95_high`; `seeds`, `epochs`,
`tfidf_accuracy`, `tfidf_accuracy_same_input`, `majority_accuracy`, the split's counts and
`pieces_seen_share`, `wall_time_s`. With one seed the interval is not computed (tag
`unavailable.finetune/diff_ci95`, and `.../diff_parent_ci95`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from mlm_pipeline.config import FinetuneConfig, LinearProbeConfig
from mlm_pipeline.evaluate.downstream import (
    DownstreamResult,
    baselines,
    load_tasks,
    split_counts,
    unavailable_tag,
)
from mlm_pipeline.evaluate.encoders import (
    EncodedTexts,
    TextEncoder,
    encoder_rows,
    ours,
    pooled_states,
    text_batches,
)
from mlm_pipeline.evaluate.selection import EpochScores, choose_on_dev, test_accuracies
from mlm_pipeline.evaluate.stats import PairedDifference, mean_sd, paired_difference
from mlm_pipeline.evaluate.tasks import TaskSplit
from mlm_pipeline.progress import active
from mlm_pipeline.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Gradient-norm clip of BERT's fine-tuning (google-research/bert optimization.py).
MAX_GRAD_NORM = 1.0
#: AdamW epsilon of BERT's optimizer (google-research/bert optimization.py).
ADAM_EPS = 1e-6
#: Std of the head's truncated-normal initialisation (BERT's `initializer_range`).
HEAD_STD = 0.02
#: The arms, in the order they run (`parent` only in a run with a parent).
ARMS = ("pretrained", "scratch", "parent")
#: Metric-key prefix of each arm.
ARM_KEYS = {"pretrained": "", "scratch": "scratch_", "parent": "parent_"}


class SequenceClassifier(nn.Module):
    """An encoder's module, mean pooling over a text's rows, dropout and a linear layer to
    class logits.

    Args:
        encoder: how to run `module` (`TextEncoder.forward`, `pad_id`).
        module: the encoder's parameters (a copy, or a random init); trained in place.
        dropout: dropout probability before the linear layer.
        num_classes: C, output logits per text.
    """

    def __init__(self, encoder: TextEncoder, module: nn.Module, dropout: float,
                 num_classes: int) -> None:
        super().__init__()
        self.spec = encoder
        self.encoder = module
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.hidden_size, num_classes)

    def forward(self, rows: list[list[int]], owner: list[int], n_texts: int) -> torch.Tensor:
        """Class logits, float32 (n_texts, C), of the texts whose rows are `rows`
        (`owner[r]`: row r's text in [0, n_texts))."""
        device = self.classifier.weight.device
        pooled = pooled_states(self.spec, self.encoder, rows, owner, n_texts, device)
        return self.classifier(self.dropout(pooled))


def build_classifiers(encoder: TextEncoder, cfg: FinetuneConfig, seed: int, num_classes: int,
                      parent: nn.Module | None = None) -> list[SequenceClassifier]:
    """The pretrained, the from-scratch and (given `parent`) the parent classifier of one
    seed, with equal heads.

    Deep copies of `encoder.module` and `parent` (both left untouched) and
    `encoder.fresh(seed)`; every head is the same draw (truncated normal of std `HEAD_STD`,
    cut at 2 std, zero bias), seeded by `seed`; the global RNG state is restored.

    Returns:
        [pretrained, scratch(, parent)], in train mode on the CPU.
    """
    modules = [encoder.copy().module, encoder.random_init(seed).module]
    if parent is not None:
        modules.append(copy.deepcopy(parent))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(encoder.hidden_size, num_classes)
        nn.init.trunc_normal_(head.weight, std=HEAD_STD, a=-2 * HEAD_STD, b=2 * HEAD_STD)
        nn.init.zeros_(head.bias)
    out = []
    for module in modules:
        clf = SequenceClassifier(encoder, module.cpu().float(), cfg.dropout, num_classes)
        clf.classifier.load_state_dict(head.state_dict())
        out.append(clf.train())
    return out


def _param_groups(clf: SequenceClassifier, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (dim >= 2), not biases or norms (BERT's
    `exclude_from_weight_decay`); each parameter once (tied weights deduplicated)."""
    decay, no_decay = [], []
    for param in clf.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def finetune_run(clf: SequenceClassifier, encoded: dict[str, EncodedTexts],
                 labels: dict[str, tuple[int, ...]], cfg: FinetuneConfig, lr: float,
                 seed: int, device: torch.device | str = "cpu",
                 on_epoch: Callable[[float], None] | None = None) -> EpochScores:
    """Fine-tune `clf` in place for `cfg.epochs` epochs at peak `lr`, scoring dev (and
    predicting test) after each epoch.

    Each epoch visits the train texts in an order drawn by `seed` (a new permutation per
    epoch from one generator); dropout is seeded by `seed` (the global RNG is restored
    after). `clf` is left on `device`, in eval mode.

    Args:
        clf: a classifier of `build_classifiers`.
        encoded: `train`, `dev` and `test` as the encoder sees them (`encoder_rows`).
        labels: the class ids of each split.
        cfg: `epochs`, `batch_size`, `warmup_ratio`, `weight_decay`.
        lr, seed, device: the peak learning rate, the run's seed, where to train.
        on_epoch: called after each epoch with its dev accuracy (progress).
    """
    clf.to(device).train()
    optimizer = torch.optim.AdamW(_param_groups(clf, cfg.weight_decay), lr=lr, eps=ADAM_EPS)
    n_train = len(labels["train"])
    total = cfg.epochs * math.ceil(n_train / cfg.batch_size)
    warmup = int(cfg.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup
        else max(0.0, (total - s) / max(1, total - warmup)))
    scores = EpochScores()
    forked = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        order = torch.Generator().manual_seed(seed)
        for _ in range(cfg.epochs):
            clf.train()
            permutation = torch.randperm(n_train, generator=order).tolist()
            for picked, rows, owner in text_batches(encoded["train"], cfg.batch_size,
                                                    permutation):
                y = torch.tensor([labels["train"][i] for i in picked], device=device)
                loss = nn.functional.cross_entropy(clf(rows, owner, len(picked)), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(clf.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                scheduler.step()
            dev_logits = predict_logits(clf, encoded["dev"], cfg.batch_size)
            dev_y = torch.tensor(labels["dev"])
            scores.dev_accuracy.append(float((dev_logits.argmax(-1) == dev_y).float().mean()))
            scores.dev_loss.append(float(nn.functional.cross_entropy(dev_logits, dev_y)))
            scores.test_predictions.append(
                predict_logits(clf, encoded["test"], cfg.batch_size).argmax(-1).tolist())
            if on_epoch is not None:
                on_epoch(scores.dev_accuracy[-1])
    clf.eval()
    return scores


@torch.no_grad()
def predict_logits(clf: SequenceClassifier, encoded: EncodedTexts, batch_size: int
                   ) -> torch.Tensor:
    """Logits (texts, C) float32 on the CPU, in eval mode (no dropout), texts in order;
    the mode is restored afterwards."""
    was_training = clf.training
    clf.eval()
    try:
        out = [clf(rows, owner, len(picked)).cpu()
               for picked, rows, owner in text_batches(encoded, batch_size)]
    finally:
        clf.train(was_training)
    return torch.cat(out)


def finetune_task(cfg: FinetuneConfig, data: LinearProbeConfig, encoder: TextEncoder,
                  split: TaskSplit, *, device: torch.device | str = "cpu",
                  parent: nn.Module | None = None
                  ) -> tuple[dict[str, float], dict[str, object]]:
    """The protocol (module docstring) on one task.

    Args:
        cfg: the `finetune` section.
        data: the `linear_probe` section (`max_windows`, `tfidf_C`).
        encoder: the trained encoder (copied, never changed).
        split: the task's split.
        device: where to fine-tune.
        parent: the module the run started from (copied, never changed): the `parent`
            arm and the paired `diff_parent`.

    Returns:
        The metrics without their prefix, and the per-seed record (test accuracies of each
        arm, chosen learning rates and epochs, the grid, the seeds).
    """
    start = time.perf_counter()
    splits = {"train": split.train, "dev": split.dev, "test": split.test}
    encoded = {name: encoder_rows(encoder, rows.texts, rows.pairs, input=cfg.input,
                                  seq_len=cfg.seq_len, max_windows=data.max_windows)
               for name, rows in splits.items()}
    labels = {name: rows.labels for name, rows in splits.items()}
    grid = cfg.lr_grid(encoder.hidden_size)
    seeds = [cfg.seed + k for k in range(cfg.seeds)]
    arms = ARMS if parent is not None else ARMS[:2]
    runs: dict[str, dict[float, list[EpochScores]]] = {a: {lr: [] for lr in grid} for a in arms}
    stage, progress, done = f"finetune {split.name}", active(), 0
    progress.start(stage, float(len(seeds) * len(grid) * len(arms) * cfg.epochs), "epochs",
                   f"{len(arms)} arms x {len(grid)} learning rates x {len(seeds)} seeds")
    for seed in seeds:
        for lr in grid:
            for arm, clf in zip(arms, build_classifiers(encoder, cfg, seed, split.num_classes,
                                                        parent)):

                def epoch_done(dev_accuracy: float, arm: str = arm, lr: float = lr,
                               seed: int = seed) -> None:
                    nonlocal done
                    done += 1
                    progress.update(stage, float(done), arm=arm, lr=f"{lr:g}", seed=seed,
                                    dev_accuracy=round(dev_accuracy, 4))

                runs[arm][lr].append(finetune_run(clf, encoded, labels, cfg, lr, seed, device,
                                                  on_epoch=epoch_done))
                del clf
    progress.finish(stage)
    choice = {arm: choose_on_dev(runs[arm]) for arm in arms}
    acc = {arm: test_accuracies(runs[arm], choice[arm], split.test.labels) for arm in arms}
    metrics: dict[str, float] = {}
    for arm in arms:
        name, chosen = ARM_KEYS[arm], choice[arm]
        metrics[f"{name}accuracy"], metrics[f"{name}accuracy_sd"] = mean_sd(acc[arm])
        metrics.update({f"{name}lr": chosen.lr, f"{name}epoch": float(chosen.epoch),
                        f"{name}dev_accuracy": chosen.dev_accuracy})
    for other, key in (("scratch", "diff"), ("parent", "diff_parent")):
        if other in acc:
            metrics.update(_paired(key, paired_difference(acc["pretrained"], acc[other])))
    metrics.update({"seeds": float(len(seeds)), "epochs": float(cfg.epochs)})
    metrics.update(baselines(encoder, split, {"train": encoded["train"],
                                              "test": encoded["test"]}, data.tfidf_C))
    metrics.update(split_counts(split, list(encoded.values())))
    metrics["wall_time_s"] = time.perf_counter() - start
    record = {"seeds": seeds, "lr_grid": list(grid), "epochs": cfg.epochs,
              "test_accuracy": acc, "lr": {a: choice[a].lr for a in arms},
              "epoch": {a: choice[a].epoch for a in arms}}
    return metrics, record


def _paired(key: str, diff: PairedDifference) -> dict[str, float]:
    """`key`, `key_sd` and, with 2 seeds or more, `key_ci95_low` / `key_ci95_high`."""
    out = {key: diff.mean, f"{key}_sd": diff.sd}
    if diff.n >= 2:
        out.update({f"{key}_ci95_low": diff.low, f"{key}_ci95_high": diff.high})
    return out


def run_finetune(cfg: FinetuneConfig, data: LinearProbeConfig, encoder: TextEncoder, *,
                 device: torch.device | str = "cpu", parent: nn.Module | None = None
                 ) -> DownstreamResult:
    """The fine-tuning protocol on every task of the `linear_probe` section `data`
    (`cfg.enabled` is not consulted here); with a `parent` arm (`finetune_task`).

    Returns:
        Metrics (module docstring), tags (`unavailable.*`, `digest.task.*`) and task
        records with the per-seed results under `finetune`.

    Raises:
        ValueError: malformed task data (file and line named).
    """
    result = DownstreamResult()
    for key, split in load_tasks(data, "finetune", result):
        got, record = finetune_task(cfg, data, encoder, split, device=device, parent=parent)
        result.metrics.update({key + k: v for k, v in got.items()})
        next(t for t in result.tasks if t["name"] == split.name)["finetune"] = record
        for diff in ("diff", "diff_parent") if parent is not None else ("diff",):
            if len(record["seeds"]) < 2:
                result.tags[unavailable_tag(key + diff + "_ci95")] = (
                    "one seed (finetune.seeds: 1): no interval")
        logger.info(
            "fine-tuning %s (%d seeds, lr grid %s, %d epochs, dev %d rows): test accuracy "
            "%.4f +- %.4f pretrained (lr %g, epoch %d), %.4f +- %.4f from scratch (lr %g, "
            "epoch %d); pretrained - scratch %+.4f, 95 %% interval [%.4f, %.4f]; TF-IDF "
            "%.4f whole text, %.4f same input; majority %.4f; %d test rows; %.0f s",
            split.name, got["seeds"], record["lr_grid"], cfg.epochs, len(split.dev),
            got["accuracy"], got["accuracy_sd"], got["lr"], got["epoch"],
            got["scratch_accuracy"], got["scratch_accuracy_sd"], got["scratch_lr"],
            got["scratch_epoch"], got["diff"], got.get("diff_ci95_low", math.nan),
            got.get("diff_ci95_high", math.nan), got["tfidf_accuracy"],
            got["tfidf_accuracy_same_input"], got["majority_accuracy"], len(split.test),
            got["wall_time_s"])
        if parent is not None:
            logger.info(
                "fine-tuning %s: the parent %.4f +- %.4f (lr %g, epoch %d); adapted - parent "
                "%+.4f, 95 %% interval [%.4f, %.4f]", split.name, got["parent_accuracy"],
                got["parent_accuracy_sd"], got["parent_lr"], got["parent_epoch"],
                got["diff_parent"], got.get("diff_parent_ci95_low", math.nan),
                got.get("diff_parent_ci95_high", math.nan))
    return result


def finetune_metrics(cfg: FinetuneConfig, data: LinearProbeConfig, model: nn.Module,
                     tokenizer: Tokenizer, *, device: torch.device | str = "cpu"
                     ) -> dict[str, float] | None:
    """`run_finetune`'s metrics for our model (a `BertMLM`, copied, never changed); None
    when no task could be run (a warning says why)."""
    result = run_finetune(cfg, data, ours(model, tokenizer), device=device)
    if not result.metrics:
        logger.warning("fine-tuning evaluation skipped: no task could be run (%s)",
                       "; ".join(result.tags.get(k, "") for k in result.tags
                                 if k.startswith("unavailable.")))
        return None
    return result.metrics
