"""The eval-loss comparison of `mlm-pipeline compare` (`compare_figure`: train loss and eval
loss in two panels, one line per run against tokens seen), drawn from the metric histories
MLflow holds with the pieces of the run's own loss plot (`tracking.plots`).

mlflow is imported lazily (through the caller's client), matplotlib inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from mlm_pipeline.tracking.plots import metric_series, new_figure, tokens_at

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = ["COMPARED", "COMPARE_FIGSIZE_IN", "Curve", "compare_figure", "run_curves"]


class Curve(NamedTuple):
    """One line of `compare_figure`: its legend label, x (tokens seen, float64 `(n,)`),
    y (loss in nats, float64 `(n,)`) and the metric drawn (`eval/loss` or `train/loss`)."""

    label: str
    tokens: np.ndarray
    values: np.ndarray
    metric: str = "eval/loss"


def run_curves(client: MlflowClient, run: Run, label: str | None = None) -> list[Curve]:
    """The comparison curves of a run against tokens seen: `train/loss`, then `eval/loss`
    when the run logged it; `label` (None: the run name) labels both.

    Raises:
        ValueError: the run logged neither loss, or no `train/tokens_seen`.
    """
    run_id = run.info.run_id
    label = label or run.info.run_name or run_id
    series = {m: metric_series(client, run_id, m) for m in COMPARED}
    if not any(series.values()):
        raise ValueError(f"run {run_id} ({run.info.run_name}) logged neither train/loss nor "
                         "eval/loss")
    tokens = metric_series(client, run_id, "train/tokens_seen")
    if not tokens:
        raise ValueError(f"run {run_id} ({run.info.run_name}) logged no train/tokens_seen")
    return [Curve(label, tokens_at([s for s, _ in points], tokens),
                  np.array([v for _, v in points], dtype=np.float64), metric)
            for metric, points in series.items() if points]


#: The panels of `compare_figure`, left to right: metric and panel title.
COMPARED = {"train/loss": "train/loss (training batches)",
            "eval/loss": "eval/loss (held out, fixed masks)"}
#: Size of the comparison figure: two panels side by side, 1200 x 500 pixels at `DPI`.
COMPARE_FIGSIZE_IN = (12.0, 5.0)


def compare_figure(curves: Sequence[Curve], title: str | None = None) -> Figure:
    """Two panels, train loss left and eval loss right, one line (with markers) per run in
    each against tokens seen: train and eval loss are never drawn on one axis.

    Args:
        curves: the lines (`run_curves`), in legend order; a run without an `eval/loss`
            curve is named in the eval panel's note instead.
        title: figure title (suptitle); None: none.

    Returns:
        A 1200 x 500 pixel figure (`COMPARE_FIGSIZE_IN` at `DPI`) on the Agg canvas with
        two axes, `train/loss` then `eval/loss`; each holds exactly one `Line2D` per curve
        of its metric, labelled with `Curve.label`.
    """
    fig = new_figure()
    fig.set_size_inches(*COMPARE_FIGSIZE_IN)
    labels = list(dict.fromkeys(c.label for c in curves))
    for ax, (metric, panel) in zip(fig.subplots(1, 2), COMPARED.items()):
        mine = [c for c in curves if c.metric == metric]
        for curve in mine:
            ax.plot(curve.tokens, curve.values, marker="o", ms=3, lw=1.2, label=curve.label)
        missing = [lab for lab in labels if lab not in {c.label for c in mine}]
        ax.set_title(panel + (f"\nnot logged by: {', '.join(missing)}" if missing else ""))
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(f"{metric} (nats per masked token)")
        ax.grid(alpha=0.3)
        if mine:
            ax.legend(loc="best")  # clear of the lines (upper right hid their ends)
    if title:
        fig.suptitle(title)
    return fig
