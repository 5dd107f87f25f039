"""`train.lr: auto`: the peak learning rate (and warm-up) chosen from the model's recipe.

The choice follows where the LayerNorm sits (`model.norm`, which `model.preset` sets):

- post-LN (`bert`, and the default model): BERT's peak learning rate, 1e-4 (Devlin et
  al. 2019, appendix A.2: Adam with lr 1e-4, warm-up over the first 10,000 of 1,000,000
  steps, linear decay). RoBERTa (Liu et al. 2019, table 9) keeps a warm-up of a few
  percent of its steps (24k of 500k for base, at a larger batch and lr 6e-4). Post-LN
  needs the warm-up to train at all (Xiong et al. 2020, "On Layer Normalization in the
  Transformer Architecture"), so, when the config sets neither `train.warmup_steps` nor
  `train.warmup_ratio`, the warm-up is BERT's share of the run: `warmup_ratio` 0.01
  (10k / 1M), which scales with `train.max_steps`.
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
AUTO_LR = {"post": 1e-4, "pre": 1e-3}
#: Warm-up share of `max_steps` of `lr: auto` by `model.norm` when the config sets none
#: (None: the config's own warm-up rule, `TrainConfig.warmup`).
AUTO_WARMUP_RATIO = {"post": 0.01, "pre": None}


def resolve_lr(train: TrainConfig, model: ModelConfig) -> TrainConfig:
    """`train` with `lr: auto` replaced by the recipe's values (module docstring).

    Args:
        train: the `train` section; returned as is when `lr` is a number.
        model: the `model` section (its `norm` decides).

    Returns:
        A `TrainConfig` whose `lr` is a float (and, for post-LN without a warm-up of its
        own, `warmup_ratio` 0.01).

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
