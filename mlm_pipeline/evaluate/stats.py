"""Summaries over seeds: mean and standard deviation, and the paired difference of two arms
with its t interval.

Fine-tuning runs each arm (pretrained, from scratch) with the same seeds: seed s draws the
same head, row order and dropout for both, so the per-seed differences are paired, and the
95 % interval of their mean is Student's paired t interval, mean +- t(0.975, n - 1) *
sd / sqrt(n) over the n seeds (Student 1908; e.g. Dror et al. 2018, "The Hitchhiker's Guide
to Testing Statistical Significance in NLP"). With 3 seeds t(0.975, 2) = 4.303: the
interval is wide, which is the honest statement of what 3 seeds can show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (divisor n - 1; 0.0 for one value).

    Raises:
        ValueError: `values` is empty.
    """
    if not values:
        raise ValueError("mean_sd: no value")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class PairedDifference:
    """Mean of `a[i] - b[i]` over n pairs, its sample sd and its t interval."""

    mean: float
    sd: float
    n: int
    low: float
    """Lower end of the interval (NaN for n < 2)."""
    high: float
    """Upper end (NaN for n < 2)."""
    confidence: float


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95
                      ) -> PairedDifference:
    """The paired t interval of mean(a - b) (module docstring).

    Args:
        a, b: one value per seed each, pair i being (a[i], b[i]).
        confidence: two-sided coverage of the interval, in (0, 1).

    Raises:
        ValueError: `a` and `b` differ in length or are empty.
    """
    from scipy.stats import t

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference: {len(a)} and {len(b)} values")
    diffs = [x - y for x, y in zip(a, b)]
    mean, sd = mean_sd(diffs)
    n = len(diffs)
    if n < 2:
        return PairedDifference(mean, sd, n, math.nan, math.nan, confidence)
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return PairedDifference(mean, sd, n, mean - half, mean + half, confidence)
