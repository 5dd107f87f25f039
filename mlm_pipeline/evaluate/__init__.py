"""Stage 6, evaluation (torch): held-out masked-token loss, accuracy and perplexity with
fixed masks, fill-mask probes, the downstream linear probe and the fine-tuning evaluation.

Rooms: `stage` (the verb: held-out metrics with fixed masks), `periodic` (evaluation during
training), `probes` (fill-mask probes and their table rows), `hf_fill_mask` (fill-mask with
an exported model), `bpc` (bits per character, across tokenizers), `holdout` (the score on
the fixed holdout text), `downstream` (the linear probe), `finetune` (the fine-tuning
evaluation), `probe_data` (their labelled set).
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
