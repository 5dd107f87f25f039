"""The loss plot a run logs at the end of training (`plots/loss.png`, `log_loss_plot`),
drawn from the metric histories MLflow holds, and the pieces every picture of runs shares;
the comparison figure of `mlm-pipeline compare` is `mlm_pipeline.app.compare_plot`.

Figures use matplotlib's object API on the Agg canvas, never `pyplot`: pyplot keeps every
figure in a process-wide registry until it is closed, which leaks memory in a long-lived
worker and picks a GUI backend on a desktop. The x axis is tokens seen, so runs with other
batch sizes or sequence lengths line up. matplotlib is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

    from mlm_pipeline.tracking.tracker import MlflowTracker

__all__ = ["DPI", "FIGSIZE_IN", "LOSS_PLOT", "Series", "log_loss_plot", "loss_figure",
           "metric_series", "new_figure", "tokens_at"]

#: Size of every figure here: 8 x 5 inches at 100 dots per inch, i.e. 800 x 500 pixels.
FIGSIZE_IN = (8.0, 5.0)
DPI = 100
#: Artifact path of the loss plot in the run.
LOSS_PLOT = "plots/loss.png"

#: A metric history: (step, value) pairs sorted by step, one per step.
Series = list[tuple[int, float]]


def _client(tracker_or_client: MlflowTracker | MlflowClient) -> MlflowClient:
    # An MlflowTracker holds its client as `.client`; an MlflowClient has no such attribute.
    return getattr(tracker_or_client, "client", tracker_or_client)


def metric_series(client: MlflowClient, run_id: str, key: str) -> Series:
    """The history of metric `key` of a run as (step, value) pairs sorted by step.

    A step logged twice (a resumed run that repeats a log interval) keeps the value with
    the latest timestamp. An absent metric gives an empty list.

    Raises:
        mlflow.exceptions.MlflowException: the run does not exist.
    """
    latest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in latest or m.timestamp >= latest[m.step][0]:
            latest[m.step] = (m.timestamp, m.value)
    return [(step, value) for step, (_, value) in sorted(latest.items())]


def tokens_at(steps: Sequence[int], tokens_seen: Series) -> np.ndarray:
    """Tokens seen at optimizer steps `steps`, from the `train/tokens_seen` history.

    Between logged steps, linear interpolation (exact: the loop adds the same number of
    tokens each step); before the first or after the last logged step, that point's
    tokens-per-step ratio.

    Returns:
        float64 array, shape `(len(steps),)`, in tokens.

    Raises:
        ValueError: `tokens_seen` is empty (the run logged no `train/tokens_seen`).
    """
    if not tokens_seen:
        raise ValueError("no train/tokens_seen history to place steps on the tokens axis")
    known_steps = np.array([s for s, _ in tokens_seen], dtype=np.float64)
    known_tokens = np.array([t for _, t in tokens_seen], dtype=np.float64)
    x = np.asarray(steps, dtype=np.float64)
    out = np.interp(x, known_steps, known_tokens)
    first, last = tokens_seen[0], tokens_seen[-1]
    if first[0] > 0:
        out[x < first[0]] = x[x < first[0]] * first[1] / first[0]
    if last[0] > 0:
        out[x > last[0]] = x[x > last[0]] * last[1] / last[0]
    return out


def new_figure() -> Figure:
    """An empty `FIGSIZE_IN` figure at `DPI` on the Agg canvas (never `pyplot`: see the
    module docstring), with the constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def loss_figure(train_loss: Series, eval_loss: Series, lr: Series, tokens_seen: Series,
                title: str | None = None) -> Figure:
    """Training curves of one run against tokens seen: `train/loss` as a line, `eval/loss`
    as markers and `train/lr` on a second y axis.

    Args:
        train_loss, eval_loss, lr: histories of `train/loss`, `eval/loss` (nats) and
            `train/lr`, as `metric_series` returns; any may be empty (left out).
        tokens_seen: history of `train/tokens_seen`, which places every step on the x axis.
        title: figure title (e.g. the run name).

    Returns:
        An 800 x 500 pixel figure (`FIGSIZE_IN` at `DPI`) on the Agg canvas.

    Raises:
        ValueError: `tokens_seen` is empty while some curve is not.
    """
    fig = new_figure()
    ax = fig.add_subplot()
    handles = []
    if train_loss:
        x = tokens_at([s for s, _ in train_loss], tokens_seen)
        handles += ax.plot(x, [v for _, v in train_loss], color="tab:blue", lw=1.2,
                           label="train/loss")
    if eval_loss:
        x = tokens_at([s for s, _ in eval_loss], tokens_seen)
        handles += ax.plot(x, [v for _, v in eval_loss], color="tab:orange", marker="o",
                           ls="--", lw=1, label="eval/loss (held out)")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per masked token)")
    ax.grid(alpha=0.3)
    if lr:
        ax_lr = ax.twinx()
        x = tokens_at([s for s, _ in lr], tokens_seen)
        handles += ax_lr.plot(x, [v for _, v in lr], color="tab:green", lw=1, alpha=0.7,
                              label="train/lr")
        ax_lr.set_ylabel("learning rate")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if handles:
        ax.legend(handles=handles, loc="upper right")
    if title:
        ax.set_title(title)
    return fig


def log_loss_plot(tracker_or_client: MlflowTracker | MlflowClient, run_id: str) -> str:
    """Draw `loss_figure` from the run's MLflow histories (`train/loss`, `eval/loss`,
    `train/lr`, `train/tokens_seen`) and log it as the run artifact `plots/loss.png`
    (`tracker_or_client`: an `MlflowTracker` or an `MlflowClient` of the run's store).

    Returns:
        The artifact path, `plots/loss.png`.

    Raises:
        ValueError: the run logged no `train/tokens_seen` but some curve.
        mlflow.exceptions.MlflowException: the run does not exist.
    """
    client = _client(tracker_or_client)
    run = client.get_run(run_id)
    keys = ("train/loss", "eval/loss", "train/lr", "train/tokens_seen")
    train_loss, eval_loss, lr, tokens = (metric_series(client, run_id, k) for k in keys)
    fig = loss_figure(train_loss, eval_loss, lr, tokens, title=run.info.run_name)
    client.log_figure(run_id, fig, LOSS_PLOT, save_kwargs={"dpi": DPI})
    return LOSS_PLOT
