"""Evaluation during training: a validation curve beside `train/loss`.

`PeriodicEvaluator` is the training loop's `Evaluator` (`mlm_pipeline.train.loop`): every
`eval.every_steps` optimizer steps it computes `eval/loss`, `eval/mlm_accuracy`,
`eval/top5_accuracy` and `eval/perplexity` on the first `eval.periodic_rows` validation
rows, masked exactly as the final evaluation masks them (`KeyedMasking` keyed by
`eval.seed` and the global row index): the same rows and positions at every point, so the
points of the curve are comparable, and a point equals `masked_lm_metrics` of the
checkpoint saved at that step. The fill-mask probes run too: their accuracy joins the
metrics and their top-k rows go to `on_probes` (the MLflow table). The final evaluation
(`evaluate.stage.evaluate`) covers the whole validation split (`eval.max_rows`) and gives
the curve's last point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mlm_pipeline.config import EvalConfig, MaskingConfig
from mlm_pipeline.evaluate.probes import probe_metrics, table_rows, warn_answer_problems
from mlm_pipeline.evaluate.stage import eval_masking, masked_lm_metrics, run_probes
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.data import ShardDataset

logger = logging.getLogger(__name__)

#: Receives the fill-mask table rows (`probes.table_rows`) of one evaluation and its step.
ProbeRowsCallback = Callable[[list[dict[str, Any]], int], None]
#: Extra metrics at each evaluation, e.g. the downstream linear probe: (model, step) -> dict.
ExtraMetrics = Callable[[torch.nn.Module, int], dict[str, float]]


class PeriodicEvaluator:
    """Held-out metrics and fill-mask probes every `cfg.every_steps` training steps.

    Args:
        cfg: the `eval` section (`every_steps`, `periodic_rows`, `batch_size`, `seed`,
            `probes`, `top_k`).
        masking: the training run's masking (selection, whole words, `mlm_probability`).
        shards: the run's shards (validation rows are evaluated).
        tokenizer: its tokenizer (probes, whole-word starts).
        document_attention: run the model with document ids, as training does.
        on_probes: receives each evaluation's fill-mask rows and step (None: not kept).
        extra: more metrics per evaluation (None: none).

    Raises:
        ValueError: `cfg.every_steps` is not set, or the validation split has no rows.
    """

    def __init__(self, cfg: EvalConfig, masking: MaskingConfig, shards: ShardManifest,
                 tokenizer: TokenizerManifest, *, document_attention: bool = False,
                 on_probes: ProbeRowsCallback | None = None,
                 extra: ExtraMetrics | None = None) -> None:
        if cfg.every_steps is None:
            raise ValueError("eval.every_steps: not set, so there is nothing to run "
                             "periodically")
        self.cfg, self.every_steps = cfg, cfg.every_steps
        self.dataset = ShardDataset(shards, "validation")
        if len(self.dataset) == 0:
            raise ValueError(f"{shards.output_dir}: the validation split has no rows")
        self.tokenizer = Tokenizer.load(tokenizer)
        self.masking = eval_masking(cfg, masking, shards, self.tokenizer)
        self.seq_len, self.document_attention = shards.seq_len, document_attention
        self.on_probes, self.extra = on_probes, extra
        warn_answer_problems(self.tokenizer, cfg.probes)

    def __call__(self, model: torch.nn.Module, step: int, precision: str) -> dict[str, float]:
        """Evaluate `model` at `step` (see the class docstring).

        Args:
            model: the uncompiled `BertMLM` (on its training device; left in eval mode).
            step: optimizer steps applied so far (the x of the curve).
            precision: `fp32` or `bf16` autocast for the held-out metrics.

        Returns:
            `eval/loss`, `eval/mlm_accuracy`, `eval/top5_accuracy`, `eval/perplexity`, the
            probe accuracies when probes have answers, and `extra`'s metrics.
        """
        device = next(model.parameters()).device
        metrics = masked_lm_metrics(
            model, self.dataset, masking=self.masking, batch_size=self.cfg.batch_size,
            max_rows=self.cfg.periodic_rows, device=device, precision=precision,
            document_attention=self.document_attention)
        # Counts describe the subset, not the model: the final evaluation logs the split's.
        del metrics["eval/masked_tokens"], metrics["eval/rows"]
        if self.cfg.probes:
            results = run_probes(model, self.tokenizer, self.cfg, self.seq_len, device)
            metrics.update(probe_metrics(results, self.cfg.probes, self.cfg.top_k))
            if self.on_probes is not None:
                self.on_probes(table_rows(results, self.cfg.probes, step), step)
        if self.extra is not None:
            metrics.update(self.extra(model, step))
        logger.info("eval at step %d: loss %.4f, mlm_accuracy %.4f, top5 %.4f", step,
                    metrics["eval/loss"], metrics["eval/mlm_accuracy"],
                    metrics["eval/top5_accuracy"])
        return metrics
