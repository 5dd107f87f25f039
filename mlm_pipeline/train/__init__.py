"""Training: the model, data loading, the loop and checkpoints (all torch).

`train()` (`stage`) is the stage function; it wires the Stateful parts (`loop.Parts`,
`meter.Meter`, `schedule`, `data.RowCursor`, the masker) that `run_steps` (`loop`) drives
and the `Checkpointer` (`checkpoint`) saves. `BertMLM` is the model (`model`;
its layers in `layers`, attention in `attention`).

Rooms besides: `perf` (device, precision, compilation, peak FLOP/s), `verified` (finding,
verifying and loading checkpoints), `warm_start` (a run started from a parent's weights),
`hf` (the mapping onto Hugging Face masked-LM classes), `hf_import` (its inverse: a
published masked LM loaded as ours) and `export` (a checkpoint as a
`transformers` directory), `distributed` (data-parallel training in one worker) and
`launch` (training under torchrun), `kernels` (attention over packed rows:
document and sliding-window masks and their kernels).
"""

from mlm_pipeline.train.loop import StopSignal
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.stage import train

__all__ = ["BertMLM", "StopSignal", "train"]
