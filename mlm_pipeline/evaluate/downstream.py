"""Downstream linear probe: is the encoder useful for classification?

Logistic regression on the frozen encoder's mean-pooled final hidden states (a linear
probe: Alain & Bengio 2016, "Understanding intermediate layers using linear classifier
probes"; mean pooling as in Sentence-BERT, Reimers & Gurevych 2019), on French book-review
polarity (`probe_data`), against a TF-IDF word 1-2-gram logistic regression and the
majority class on the same fixed split, computed in the same run. The data, its split and
the TF-IDF figure do not depend on the model and are computed once per process
(`functools.lru_cache`), so the probe is cheap to repeat at each periodic evaluation.

Metrics (`linear_probe`): `probe/accuracy`, `probe/tfidf_accuracy`,
`probe/majority_accuracy`, `probe/train_rows`, `probe/test_rows`,
`probe/duplicates_dropped`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mlm_pipeline.config import LinearProbeConfig
from mlm_pipeline.evaluate.probe_data import (
    ProbeSplit,
    deduplicate,
    majority_rate,
    probe_csv,
    read_polarity_csv,
    split_rows,
)
from mlm_pipeline.manifest import TokenizerManifest, TrainManifest
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.checkpoint import load_model

logger = logging.getLogger(__name__)

#: Iteration cap of scikit-learn's lbfgs solver (its default of 100 stops short of
#: convergence on 1-2-gram TF-IDF features).
MAX_ITER = 2000


@functools.lru_cache(maxsize=4)
def _split(path: str, sha256: str, test_fraction: float, max_rows: int | None) -> ProbeSplit:
    """Read, deduplicate and split a CSV (cached by its path and content hash)."""
    del sha256  # part of the cache key only: a changed file is read again
    rows, dropped = deduplicate(read_polarity_csv(path), path)
    return split_rows(rows, test_fraction, max_rows, dropped)


def load_split(cfg: LinearProbeConfig) -> ProbeSplit | None:
    """The probe's data split under `cfg` (read once per file content and settings).

    Returns:
        The split, or None after a warning when the data cannot be obtained
        (`probe_data.probe_csv`).

    Raises:
        ValueError: the CSV is malformed (file and line named), or the split leaves a
            class without train or test rows.
    """
    path = probe_csv(cfg)
    if path is None:
        return None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return _split(str(path.resolve()), digest, cfg.test_fraction, cfg.max_rows)


@functools.lru_cache(maxsize=4)
def tfidf_accuracy(split: ProbeSplit, C: float) -> float:
    """Test accuracy of TF-IDF word 1-2-grams + `LogisticRegression(C=C)` trained on
    `split`'s train rows (cached per split). The vectorizer keeps scikit-learn's defaults
    otherwise: lowercased words of 2+ word characters, raw tf times smoothed idf, rows
    l2-normalized."""
    clf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2)),
                        LogisticRegression(C=C, max_iter=MAX_ITER))
    clf.fit(list(split.train_texts), list(split.train_labels))
    return float(clf.score(list(split.test_texts), list(split.test_labels)))


@torch.no_grad()
def embed_texts(model: torch.nn.Module, tokenizer: Tokenizer, texts: list[str] | tuple[str, ...],
                *, seq_len: int, batch_size: int = 32,
                device: torch.device | str = "cpu") -> np.ndarray:
    """Mean-pooled final hidden states of `texts`, the model frozen.

    Each text becomes `[CLS] pieces [SEP]`, its pieces truncated so the row holds at most
    `seq_len` tokens; a batch is padded with `[PAD]` to its longest row and run with an
    attention mask; the states (B, L, H) are averaged over the non-pad positions ([CLS]
    and [SEP] included). The model runs in eval mode under `no_grad`; its train/eval mode
    is restored afterwards, so the probe can run in the middle of training.

    Args:
        model: a `BertMLM` (its `encode(input_ids, attention_mask)` -> (B, L, H)), or a
            wrapper of one (`torch.compile`'s `_orig_mod`, DDP's `module`).
        tokenizer: the tokenizer the model was trained with.
        texts: the documents.
        seq_len: longest row, tokens (>= 3; the model's `seq_len`).
        batch_size: rows per forward pass.
        device: where the model is.

    Returns:
        float32 array (len(texts), H).

    Raises:
        ValueError: `seq_len` < 3.
    """
    if seq_len < 3:
        raise ValueError(f"linear probe: seq_len {seq_len} leaves no room for a piece")
    encoder = getattr(model, "module", model)
    encoder = getattr(encoder, "_orig_mod", encoder)
    was_training = encoder.training
    encoder.eval()
    rows = token_rows(tokenizer, texts, seq_len)
    out = []
    try:
        for start in range(0, len(rows), batch_size):
            input_ids, mask = pad_rows(rows[start:start + batch_size], tokenizer.pad_id)
            out.append(mean_pool(encoder.encode(input_ids.to(device), mask.to(device)).float(),
                                 mask.to(device)))                           # (B, H)
    finally:
        encoder.train(was_training)
    return torch.cat(out).cpu().numpy()


def token_rows(tokenizer: Tokenizer, texts: list[str] | tuple[str, ...],
               seq_len: int) -> list[list[int]]:
    """`[CLS] pieces [SEP]` per text, its pieces truncated so a row holds at most `seq_len`
    (>= 3) tokens."""
    return [[tokenizer.cls_id, *ids[: seq_len - 2], tokenizer.sep_id]
            for ids in tokenizer.encode(list(texts))]


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with `pad_id` to the longest: int64 `input_ids` (B, L) and bool
    `attention_mask` (B, L), True at real tokens."""
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return input_ids, mask


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of `hidden` (B, L, H) over the positions where `attention_mask` (B, L) is
    true; (B, H) in `hidden`'s dtype."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)


def linear_probe(cfg: LinearProbeConfig, model: torch.nn.Module, tokenizer: Tokenizer, *,
                 seq_len: int, device: torch.device | str = "cpu") -> dict[str, float] | None:
    """Run the linear probe on an in-memory model.

    A `StandardScaler` + `LogisticRegression(C=cfg.C)` pipeline is fit on the train rows'
    `embed_texts` features and scored on the test rows; the baseline is `tfidf_accuracy`
    with `cfg.tfidf_C`.

    Args:
        cfg: the `linear_probe` config section (`enabled` is not consulted here).
        model, tokenizer, seq_len, device: see `embed_texts`.

    Returns:
        `probe/accuracy`, `probe/tfidf_accuracy`, `probe/majority_accuracy` (fractions of
        the test rows), `probe/train_rows`, `probe/test_rows`, `probe/duplicates_dropped`;
        or None after a warning when the data cannot be obtained.

    Raises:
        ValueError: as `load_split` (a malformed CSV, with its file and line).
    """
    split = load_split(cfg)
    if split is None:
        return None
    features = {name: embed_texts(model, tokenizer, texts, seq_len=seq_len,
                                  batch_size=cfg.batch_size, device=device)
                for name, texts in (("train", split.train_texts), ("test", split.test_texts))}
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=cfg.C, max_iter=MAX_ITER))
    clf.fit(features["train"], np.asarray(split.train_labels))
    metrics = {
        "probe/accuracy": float(clf.score(features["test"], np.asarray(split.test_labels))),
        "probe/tfidf_accuracy": tfidf_accuracy(split, cfg.tfidf_C),
        "probe/majority_accuracy": majority_rate(split),
        "probe/train_rows": float(len(split.train_texts)),
        "probe/test_rows": float(len(split.test_texts)),
        "probe/duplicates_dropped": float(split.duplicates_dropped),
    }
    logger.info("linear probe: accuracy %.4f (TF-IDF 1-2-grams %.4f, majority %.4f) on %d "
                "test rows, %d train rows, %d duplicates dropped", metrics["probe/accuracy"],
                metrics["probe/tfidf_accuracy"], metrics["probe/majority_accuracy"],
                len(split.test_texts), len(split.train_texts), split.duplicates_dropped)
    return metrics


def run_linear_probe(cfg: LinearProbeConfig, trained: TrainManifest,
                     tokenizer: TokenizerManifest) -> dict[str, float] | None:
    """Run the linear probe on a training run's final checkpoint.

    The model is rebuilt from the checkpoint (`train.checkpoint.load_model`) on the run's
    device (`trained.device`), with the checkpoint's own `seq_len`.

    Returns:
        `linear_probe`'s metrics; None when `cfg.enabled` is False or the data cannot be
        obtained (a warning says why).

    Raises:
        ValueError: as `linear_probe`.
        FileNotFoundError: the checkpoint is incomplete.
    """
    if not cfg.enabled:
        logger.info("linear probe disabled (linear_probe.enabled: false)")
        return None
    if load_split(cfg) is None:  # no data: do not load the model for nothing
        return None
    device = torch.device(trained.device)
    model = load_model(Path(trained.file(trained.checkpoint_dir)), device)
    return linear_probe(cfg, model, Tokenizer.load(tokenizer), seq_len=model.seq_len,
                        device=device)
