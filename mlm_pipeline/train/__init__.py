"""Training: the model, data loading, the loop and checkpoints (all torch).

`train()` is the stage function; `BertMLM` the model.
"""

from mlm_pipeline.train.loop import train
from mlm_pipeline.train.model import BertMLM

__all__ = ["BertMLM", "train"]
