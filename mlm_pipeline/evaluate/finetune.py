"""Fine-tuning evaluation: does pretraining help a classifier trained end to end?

The linear probe (`downstream`) freezes the encoder; users of an MLM fine-tune it. Here
the trained encoder plus a classification head is fine-tuned on the probe's French
book-review polarity, on the probe's fixed split (`downstream.load_split`), and scored on
its test rows; the honest baseline is the **same architecture from random weights**,
fine-tuned with the same recipe from the same head initialisation. TF-IDF word 1-2-grams
and the majority class on the same split complete the table.

The head is BERT's sequence classifier on a mean-pooled state instead of the `[CLS]`
state: the mean of the final hidden states over the real tokens -> dropout -> linear
(H -> 2), the pooling of the linear probe (Reimers & Gurevych 2019), because our
pretraining has no next-sentence task that would train `[CLS]` to summarize a row. The
recipe is BERT's GLUE fine-tuning (Devlin et al. 2019, appendix A.3): AdamW, linear
warm-up then linear decay to 0, gradient norm clipped at 1, cross-entropy; its numbers are
the `finetune` config section. Everything runs in fp32; on CPU a seed gives the same
weights and figures.

Metrics (`finetune_metrics`): `finetune/accuracy`, `finetune/scratch_accuracy`,
`finetune/tfidf_accuracy`, `finetune/majority_accuracy`, `finetune/train_rows`,
`finetune/test_rows`, `finetune/epochs`, `finetune/wall_time_s`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator

import torch
from torch import nn

from mlm_pipeline.config import FinetuneConfig, LinearProbeConfig
from mlm_pipeline.evaluate.downstream import (
    load_split,
    mean_pool,
    pad_rows,
    tfidf_accuracy,
    token_rows,
)
from mlm_pipeline.evaluate.probe_data import ProbeSplit, majority_rate
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.model import BertMLM

logger = logging.getLogger(__name__)

#: Classes of the polarity set (0 negative, 1 positive).
NUM_CLASSES = 2
#: Gradient-norm clip of BERT's fine-tuning (google-research/bert optimization.py).
MAX_GRAD_NORM = 1.0
#: AdamW epsilon of BERT's optimizer (google-research/bert optimization.py).
ADAM_EPS = 1e-6


class SequenceClassifier(nn.Module):
    """A `BertMLM` encoder, mean pooling, dropout and a linear layer to class logits.

    Args:
        encoder: the encoder (its MLM head is kept but unused: it gets no gradient).
        dropout: dropout probability before the linear layer.
        num_classes: C, output logits per row.
    """

    def __init__(self, encoder: BertMLM, dropout: float, num_classes: int = NUM_CLASSES
                 ) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.cfg.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Class logits.

        Args:
            input_ids: int64 (B, L), L <= the encoder's `seq_len`.
            attention_mask: bool (B, L), True at real tokens.

        Returns:
            float32 logits (B, C).
        """
        hidden = self.encoder.encode(input_ids, attention_mask)         # (B, L, H)
        return self.classifier(self.dropout(mean_pool(hidden, attention_mask)))


def build_classifiers(model: nn.Module, cfg: FinetuneConfig
                      ) -> tuple[SequenceClassifier, SequenceClassifier]:
    """The pretrained and the from-scratch classifier, with equal heads.

    The pretrained one holds a copy of `model` (which is left untouched); the scratch one a
    `BertMLM` of the same shape (`cfg`, `vocab_size`, `seq_len`) drawn with BERT's
    initialisation. Both heads are the same draw (truncated normal of the model's
    `initializer_range`, zero bias), seeded by `cfg.seed`. The global RNG state is restored.

    Args:
        model: a trained `BertMLM`, or a wrapper of one (`module`, `_orig_mod`).
        cfg: the `finetune` section (`dropout`, `seed`).

    Returns:
        (pretrained, scratch), both in train mode on the CPU.
    """
    encoder = getattr(model, "module", model)
    encoder = getattr(encoder, "_orig_mod", encoder)
    pretrained = copy.deepcopy(encoder).cpu().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        scratch = BertMLM(encoder.cfg, encoder.vocab_size, encoder.seq_len)
        head = nn.Linear(encoder.cfg.hidden_size, NUM_CLASSES)
        std = encoder.cfg.initializer_range
        nn.init.trunc_normal_(head.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(head.bias)
    out = []
    for enc in (pretrained, scratch):
        clf = SequenceClassifier(enc, cfg.dropout)
        clf.classifier.load_state_dict(head.state_dict())
        out.append(clf.train())
    return out[0], out[1]


def _batches(rows: list[list[int]], labels: tuple[int, ...], batch_size: int,
             pad_id: int, generator: torch.Generator | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, labels) batches, shuffled by `generator` when given."""
    order = (torch.randperm(len(rows), generator=generator).tolist() if generator is not None
             else list(range(len(rows))))
    for start in range(0, len(order), batch_size):
        picked = order[start:start + batch_size]
        input_ids, mask = pad_rows([rows[i] for i in picked], pad_id)
        yield input_ids, mask, torch.tensor([labels[i] for i in picked])


def _row_len(cfg: FinetuneConfig, clf: SequenceClassifier) -> int:
    return min(cfg.seq_len or clf.encoder.seq_len, clf.encoder.seq_len)


def train_classifier(clf: SequenceClassifier, tokenizer: Tokenizer, texts: tuple[str, ...],
                     labels: tuple[int, ...], cfg: FinetuneConfig,
                     device: torch.device | str = "cpu") -> None:
    """Fine-tune `clf` in place on `texts`: `cfg.epochs` passes in a seeded shuffled order,
    AdamW (`cfg.lr`, `cfg.weight_decay` on matrices only, eps 1e-6), linear warm-up over
    `cfg.warmup_ratio` of the steps then linear decay to 0, gradients clipped to norm 1.

    The row order and dropout are seeded by `cfg.seed` (the global RNG is restored after).
    `clf` is left on `device`, in eval mode.

    Args:
        clf: a classifier of `build_classifiers`.
        tokenizer: the encoder's tokenizer.
        texts, labels: the train rows and their classes (0 or 1).
        cfg: the `finetune` section.
        device: where to train.
    """
    clf.to(device).train()
    rows = token_rows(tokenizer, texts, _row_len(cfg, clf))
    groups = clf.encoder.param_groups(cfg.weight_decay)
    groups[0]["params"].append(clf.classifier.weight)
    groups[1]["params"].append(clf.classifier.bias)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, eps=ADAM_EPS)
    total = cfg.epochs * math.ceil(len(rows) / cfg.batch_size)
    warmup = int(cfg.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup
        else max(0.0, (total - s) / max(1, total - warmup)))
    forked = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(cfg.seed)
        order = torch.Generator().manual_seed(cfg.seed)
        for _ in range(cfg.epochs):
            for input_ids, mask, y in _batches(rows, labels, cfg.batch_size,
                                               tokenizer.pad_id, order):
                logits = clf(input_ids.to(device), mask.to(device))
                loss = nn.functional.cross_entropy(logits.float(), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(clf.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                scheduler.step()
    clf.eval()


@torch.no_grad()
def classifier_accuracy(clf: SequenceClassifier, tokenizer: Tokenizer,
                        texts: tuple[str, ...], labels: tuple[int, ...],
                        cfg: FinetuneConfig, device: torch.device | str = "cpu") -> float:
    """Fraction of `texts` whose argmax class (eval mode, no dropout) is its label."""
    clf.to(device).eval()
    rows = token_rows(tokenizer, texts, _row_len(cfg, clf))
    hits = 0
    for input_ids, mask, y in _batches(rows, labels, cfg.batch_size, tokenizer.pad_id, None):
        hits += int((clf(input_ids.to(device), mask.to(device)).argmax(-1).cpu() == y).sum())
    return hits / len(rows)


def finetune_metrics(cfg: FinetuneConfig, data: LinearProbeConfig, model: nn.Module,
                     tokenizer: Tokenizer, *, device: torch.device | str = "cpu"
                     ) -> dict[str, float] | None:
    """Fine-tune `model` and the same architecture from random weights on the linear
    probe's split and score both on its test rows.

    Args:
        cfg: the `finetune` section (`enabled` is not consulted here).
        data: the `linear_probe` section: where the data comes from and how it is split
            (`data_path`, `archive_url`, `cache_dir`, `test_fraction`, `max_rows`) and the
            TF-IDF baseline's `tfidf_C`.
        model: the trained `BertMLM` (copied, never changed).
        tokenizer: its tokenizer.
        device: where to fine-tune.

    Returns:
        `finetune/accuracy` (pretrained), `finetune/scratch_accuracy`,
        `finetune/tfidf_accuracy`, `finetune/majority_accuracy` (fractions of the test
        rows), `finetune/train_rows`, `finetune/test_rows`, `finetune/epochs` and
        `finetune/wall_time_s` (both fine-tunings and test scorings, seconds); or None after a
        warning when the data cannot be obtained.

    Raises:
        ValueError: as `downstream.load_split` (a malformed CSV, with its file and line).
    """
    split = load_split(data)
    if split is None:
        logger.warning("fine-tuning evaluation skipped: no labelled data (see the warning "
                       "above)")
        return None
    start = time.perf_counter()
    pretrained, scratch = build_classifiers(model, cfg)
    acc = {name: _finetune_one(clf, tokenizer, split, cfg, device)
           for name, clf in (("pretrained", pretrained), ("scratch", scratch))}
    elapsed = time.perf_counter() - start
    metrics = {
        "finetune/accuracy": acc["pretrained"],
        "finetune/scratch_accuracy": acc["scratch"],
        "finetune/tfidf_accuracy": tfidf_accuracy(split, data.tfidf_C),
        "finetune/majority_accuracy": majority_rate(split),
        "finetune/train_rows": float(len(split.train_texts)),
        "finetune/test_rows": float(len(split.test_texts)),
        "finetune/epochs": float(cfg.epochs),
        "finetune/wall_time_s": elapsed,
    }
    logger.info("fine-tuning: accuracy %.4f pretrained, %.4f from scratch (TF-IDF %.4f, "
                "majority %.4f) on %d test rows after %d epochs on %d train rows, %.1f s",
                acc["pretrained"], acc["scratch"], metrics["finetune/tfidf_accuracy"],
                metrics["finetune/majority_accuracy"], len(split.test_texts), cfg.epochs,
                len(split.train_texts), metrics["finetune/wall_time_s"])
    return metrics


def _finetune_one(clf: SequenceClassifier, tokenizer: Tokenizer, split: ProbeSplit,
                  cfg: FinetuneConfig, device: torch.device | str) -> float:
    train_classifier(clf, tokenizer, split.train_texts, split.train_labels, cfg, device)
    return classifier_accuracy(clf, tokenizer, split.test_texts, split.test_labels, cfg,
                               device)
