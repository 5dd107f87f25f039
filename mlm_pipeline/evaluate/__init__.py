"""Stage 6, evaluation (torch): held-out masked-token loss, accuracy and perplexity with
fixed masks, fill-mask probes, the downstream linear probe and the fine-tuning evaluation.
"""

from mlm_pipeline.evaluate.downstream import linear_probe, run_linear_probe
from mlm_pipeline.evaluate.finetune import finetune_metrics
from mlm_pipeline.evaluate.stage import (
    check_evaluable,
    evaluate,
    fill_mask,
    masked_lm_metrics,
)

__all__ = ["check_evaluable", "evaluate", "fill_mask", "finetune_metrics", "linear_probe",
           "masked_lm_metrics", "run_linear_probe"]
