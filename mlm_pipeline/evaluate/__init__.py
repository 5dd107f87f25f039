"""Stage 6, evaluation (torch): held-out masked-token loss, accuracy and perplexity with
fixed masks at 15 %, fill-mask probes, and the downstream tasks (the linear probe and the
fine-tuning protocol) beside their controls, for our encoder or a Hugging Face one.

Rooms: `stage` (the verb: held-out metrics with fixed masks), `periodic` (evaluation during
training), `probes` (fill-mask probes and their table rows), `hf_fill_mask` (fill-mask with
an exported model), `bpc` (bits per character across tokenizers, and the score on the
fixed holdout text), `tasks` (downstream classification tasks a user brings), `encoders` (ours or a Hugging Face encoder behind one interface), `downstream` (the linear
probe and its controls), `finetune` (the fine-tuning protocol), `selection` (its choice of
learning rate and epoch on dev), `parent` (the weights an adapted run started from, as an
arm of each figure), `stats` (mean, sd and paired intervals), `probe_data` (the shipped
labelled set).
"""

from mlm_pipeline.evaluate.downstream import (
    DownstreamResult,
    linear_probe,
    run_linear_probe,
    run_probe,
)
from mlm_pipeline.evaluate.encoders import TextEncoder, hugging_face, ours
from mlm_pipeline.evaluate.finetune import finetune_metrics, run_finetune
from mlm_pipeline.evaluate.stage import (
    check_evaluable,
    evaluate,
    fill_mask,
    masked_lm_metrics,
)
from mlm_pipeline.evaluate.tasks import TaskSplit, load_task

__all__ = ["DownstreamResult", "TaskSplit", "TextEncoder", "check_evaluable", "evaluate",
           "fill_mask", "finetune_metrics", "hugging_face", "linear_probe", "load_task",
           "masked_lm_metrics", "ours", "run_finetune", "run_linear_probe", "run_probe"]
