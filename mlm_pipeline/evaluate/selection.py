"""Fine-tuning's choice on dev (`evaluate.finetune`, step 2 of its protocol): each run's
scores after every epoch, and the learning rate and epoch an arm keeps.

Only dev rows enter the choice: test predictions are kept aside per epoch and read once
the choice is made, for the chosen learning rate and epoch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpochScores:
    """One fine-tuning run's scores after each epoch: dev accuracy and loss, and the test
    predictions (kept aside: read only for the chosen learning rate and epoch)."""

    dev_accuracy: list[float] = field(default_factory=list)
    dev_loss: list[float] = field(default_factory=list)
    test_predictions: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Choice:
    """The learning rate and epoch chosen on dev for one arm, and the mean dev accuracy
    and loss over the seeds there."""

    lr: float
    epoch: int
    """1-based."""
    dev_accuracy: float
    dev_loss: float


def choose_on_dev(runs: dict[float, list[EpochScores]]) -> Choice:
    """The (lr, epoch) of the highest mean dev accuracy over the seeds; ties: lower mean
    dev loss, then the smaller lr, then the earlier epoch. Reads dev scores only.

    Args:
        runs: per learning rate, one `EpochScores` per seed (same epochs each).
    """
    best: tuple[float, float, float, int] | None = None
    for lr in sorted(runs):
        seeds = runs[lr]
        for e in range(len(seeds[0].dev_accuracy)):
            acc = sum(s.dev_accuracy[e] for s in seeds) / len(seeds)
            loss = sum(s.dev_loss[e] for s in seeds) / len(seeds)
            key = (-acc, loss, lr, e)
            if best is None or key < best:
                best = key
    assert best is not None
    return Choice(lr=best[2], epoch=best[3] + 1, dev_accuracy=-best[0], dev_loss=best[1])


def test_accuracies(runs: dict[float, list[EpochScores]], choice: Choice,
                    test_labels: tuple[int, ...]) -> list[float]:
    """Per seed, the test accuracy at the chosen learning rate and epoch."""
    return [sum(p == y for p, y in zip(s.test_predictions[choice.epoch - 1], test_labels))
            / len(test_labels) for s in runs[choice.lr]]
