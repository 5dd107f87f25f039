"""Test fakes shared by several modules (STYLE rule 14: fakes implement only what the code
under test calls)."""

from __future__ import annotations

from typing import Any


class FakePart:
    """A Stateful part: only `state_dict` / `load_state_dict`."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def fake_parts(seed: int, random: bool = False) -> dict[str, FakePart]:
    """One `FakePart` per name of the checkpoint layout (`checkpoint.LAYOUT`): a tensor
    state (3 values: `seed` each, or drawn with `seed` when `random`) for the `.pt` parts,
    a JSON value for the `state.json` ones."""
    import torch

    from mlm_pipeline.train.checkpoint import LAYOUT

    g = torch.Generator().manual_seed(seed)
    return {name: FakePart(({"w": torch.randn(3, generator=g)} if random
                            else {"w": torch.full((3,), float(seed))})
                           if not file.endswith(".json") else {"value": seed, "name": name})
            for name, (file, _) in LAYOUT.items()}


class RecordedProgress:
    """A `Progress` reporter that keeps every call: (method, stage, value, fields)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None, dict[str, Any]]] = []

    def start(self, stage: str, total: float | None, unit: str, description: str = "") -> None:
        self.calls.append(("start", stage, total, {"unit": unit}))

    def update(self, stage: str, completed: float, **fields: Any) -> None:
        self.calls.append(("update", stage, completed, fields))

    def finish(self, stage: str, **fields: Any) -> None:
        self.calls.append(("finish", stage, None, fields))
