"""Stage 6, evaluation (torch): held-out masked-token loss, accuracy and perplexity with
fixed masks, and fill-mask probes.
"""

from mlm_pipeline.evaluate.stage import (
    check_evaluable,
    evaluate,
    fill_mask,
    masked_lm_metrics,
)

__all__ = ["check_evaluable", "evaluate", "fill_mask", "masked_lm_metrics"]
