"""`train.lr: auto`: the peak learning rate (and warm-up) chosen from the model's recipe.

The choice follows where the LayerNorm sits (`model.norm`, which `model.preset` sets):

- post-LN (`bert`, and the default model): 5e-4 with a warm-up over 6 % of the steps,
  from this project's sweep (`benchmarks/sweep_lr.py --preset bert`, `tiny`'s data and
  4 x 256 shape, 1,000 steps of 16 rows, 30 % masking, accuracy at 15 %; RESULTS.md "The
  `bert` learning rate"), mean of seeds 0 and 1: 1e-4 0.0741, 3e-4 0.1036, 5e-4 0.1175;
  1e-3 0.0363, the most-frequent-token baseline (the run collapses). BERT's own 1e-4
  (Devlin et al. 2019, appendix A.2: 10,000 warm-up steps of 1,000,000 at batch 256) is
  for a million steps; at the short runs this pipeline trains on CPU it is 1.6x below the
  best accuracy. RoBERTa (Liu et al. 2019, table 9) trains post-LN at 6e-4 with a warm-up
  of 4.8 % (24k of 500k). Post-LN needs the warm-up to train at all (Xiong et al. 2020,
  "On Layer Normalization in the Transformer Architecture"), so, when the config sets
  neither `train.warmup_steps` nor `train.warmup_ratio`, the warm-up is the swept share,
  `warmup_ratio` 0.06, which scales with `train.max_steps`.
- pre-LN (`modern`): this project's pre-LN default, 1e-3 (`TrainConfig.lr`'s default, which
  pre-LN trains stably at, Xiong et al. 2020), with the config's warm-up unchanged, so
  `lr: auto` trains exactly as `lr: 1e-3` does (the same resolved config, the same
  digest).

Resolution happens when a `PipelineConfig` is validated (the flattened config logged as
MLflow params therefore holds the resolved values) and again in `train.stage.train` for a
`TrainConfig` passed on its own. Cheap: pydantic only (STYLE rule 3).
"""

from __future__ import annotations

from mlm_pipeline.config.stages import ModelConfig, TrainConfig

#: Peak learning rate of `lr: auto` by `model.norm`.
AUTO_LR = {"post": 5e-4, "pre": 1e-3}
#: Warm-up share of `max_steps` of `lr: auto` by `model.norm` when the config sets none
#: (None: the config's own warm-up rule, `TrainConfig.warmup`).
AUTO_WARMUP_RATIO = {"post": 0.06, "pre": None}


def resolve_lr(train: TrainConfig, model: ModelConfig) -> TrainConfig:
    """`train` with `lr: auto` replaced by the recipe's values (module docstring).

    Args:
        train: the `train` section; returned as is when `lr` is a number.
        model: the `model` section (its `norm` decides).

    Returns:
        A `TrainConfig` whose `lr` is a float (and, for post-LN without a warm-up of its
        own, `warmup_ratio` 0.06).

    Raises:
        ValueError: the resolved warm-up exceeds `max_steps` (as for any config).
    """
    if train.lr != "auto":
        return train
    update: dict[str, object] = {"lr": AUTO_LR[model.norm]}
    ratio = AUTO_WARMUP_RATIO[model.norm]
    if ratio is not None and train.warmup_steps is None and train.warmup_ratio is None:
        update["warmup_ratio"] = ratio
    return TrainConfig.model_validate({**train.model_dump(), **update})
