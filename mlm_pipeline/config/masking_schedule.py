"""Masking-rate schedules: `masking.mlm_probability` as a function of the optimizer step.

A float is the constant rate (what every config said before schedules existed, and what it
still dumps and hashes as). A mapping with a `schedule` key is one of:

- `linear` (Ankner et al. 2024, "Dynamic Masking Rate Schedules for MLM Pretraining":
  30 % falling linearly to 15 %): `{"schedule": "linear", "start": 0.3, "end": 0.15}`;
- `stepwise` (mmBERT, Marone et al. 2025: 30 %, then 15 %, then 5 % by training phase):
  `{"schedule": "stepwise", "rates": [[0, 0.3], [8000, 0.15], [9500, 0.05]]}`.

The rate is a pure function of `step`, the optimizer steps completed before the step it
masks for (0 for the first step, `max_steps - 1` for the last; the convention of
`train.schedule.lr_multiplier`), so a resumed run masks exactly as an uninterrupted one.
Held-out evaluation masks at one fixed rate: the constant itself, or a schedule's
`eval_rate` (15 % by default, BERT's rate), so its points stay comparable along a run
and across runs. Cheap: pydantic only (STYLE rule 3).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from mlm_pipeline.config.base import StrictModel

#: A masking rate: a share of maskable tokens, in the open interval (0, 1).
Rate = Annotated[float, Field(gt=0.0, lt=1.0)]


class LinearRate(StrictModel):
    """A rate moving linearly from `start` (step 0) to `end` (step `end_step`), then held."""

    schedule: Literal["linear"]
    """`linear`."""
    start: Rate
    """Rate of the first optimizer step."""
    end: Rate
    """Rate from `end_step` on."""
    end_step: int | None = Field(default=None, ge=1)
    """Completed optimizer steps at which `end` is reached (at most `train.max_steps - 1`);
    None: the last step (`train.max_steps - 1`)."""
    eval_rate: Rate = 0.15
    """Rate the held-out evaluation masks at (fixed for the whole run, so eval points are
    comparable; BERT's 15 % by default)."""

    def at(self, step: int, max_steps: int) -> float:
        """The rate of the optimizer step that follows `step` completed steps.

        Args:
            step: completed optimizer steps (>= 0).
            max_steps: `train.max_steps`.

        Returns:
            `start + (end - start) * min(step, E) / E`, E = `end_step` or
            `max(1, max_steps - 1)` (float64).
        """
        span = self.end_step if self.end_step is not None else max(1, max_steps - 1)
        return self.start + (self.end - self.start) * (min(max(step, 0), span) / span)


class StepwiseRate(StrictModel):
    """A piecewise-constant rate: `[step, rate]` pairs, each rate holding from its step
    (completed optimizer steps) until the next pair's."""

    schedule: Literal["stepwise"]
    """`stepwise`."""
    rates: list[tuple[Annotated[int, Field(ge=0)], Rate]] = Field(min_length=1)
    """`[step, rate]` pairs with strictly increasing steps, the first at step 0, every
    step below `train.max_steps`."""
    eval_rate: Rate = 0.15
    """Rate the held-out evaluation masks at (fixed for the whole run, so eval points are
    comparable; BERT's 15 % by default)."""

    @model_validator(mode="after")
    def _check_steps(self) -> StepwiseRate:
        steps = [s for s, _ in self.rates]
        if steps[0] != 0:
            raise ValueError(f"rates: the first [step, rate] pair must be at step 0, got "
                             f"step {steps[0]}")
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"rates: steps {steps} must be strictly increasing")
        return self

    def at(self, step: int, max_steps: int) -> float:
        """The rate of the optimizer step that follows `step` completed steps.

        Args:
            step: completed optimizer steps (>= 0).
            max_steps: `train.max_steps` (unused: the pairs name their steps).

        Returns:
            The rate of the last pair whose step is `<= step`.
        """
        del max_steps
        rate = self.rates[0][1]
        for start, value in self.rates:
            if start > step:
                break
            rate = value
        return rate


def _kind(value: Any) -> str:
    """`schedule` for a mapping (or a schedule model), else `constant`: the one branch
    whose errors a bad value reports."""
    return "schedule" if isinstance(value, dict | LinearRate | StepwiseRate) else "constant"


#: What `masking.mlm_probability` holds: a constant rate or a schedule.
MlmProbability = Annotated[
    Annotated[Rate, Tag("constant")]
    | Annotated[LinearRate | StepwiseRate, Field(discriminator="schedule"), Tag("schedule")],
    Discriminator(_kind),
]


def rate_at(value: float | LinearRate | StepwiseRate, step: int, max_steps: int) -> float:
    """The masking rate of `value` (constant or schedule) after `step` completed steps.

    Args:
        value: `masking.mlm_probability`.
        step: completed optimizer steps (>= 0).
        max_steps: `train.max_steps`.

    Returns:
        The rate, in (0, 1).
    """
    return float(value) if isinstance(value, float | int) else value.at(step, max_steps)


def schedule_problems(value: float | LinearRate | StepwiseRate, max_steps: int) -> list[str]:
    """What makes a schedule impossible with `train.max_steps` (empty when none).

    Args:
        value: `masking.mlm_probability`.
        max_steps: `train.max_steps`.

    Returns:
        One message per problem, each naming `masking.mlm_probability` and
        `train.max_steps`.
    """
    if isinstance(value, LinearRate) and value.end_step is not None:
        if value.end_step > max_steps - 1:
            return [f"masking.mlm_probability.end_step {value.end_step} is out of range: "
                    f"steps run 0..{max_steps - 1} (train.max_steps {max_steps})"]
    if isinstance(value, StepwiseRate):
        late = [s for s, _ in value.rates if s > max_steps - 1]
        if late:
            return [f"masking.mlm_probability.rates: steps {late} are out of range: steps "
                    f"run 0..{max_steps - 1} (train.max_steps {max_steps})"]
    return []
