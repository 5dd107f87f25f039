"""Training: the model, data loading, the loop and checkpoints (all torch).

`train()` (`stage`) is the stage function; it wires the Stateful parts (`loop.Parts`,
`meter.Meter`, `schedule`, `data.RowCursor`, the masker) that `run_steps` (`loop`) drives
and the `Checkpointer` (`checkpoint`) saves. `BertMLM` is the model (`model`;
its layers in `layers`, attention in `attention`).
"""

from mlm_pipeline.train.loop import StopSignal
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.stage import train

__all__ = ["BertMLM", "StopSignal", "train"]
