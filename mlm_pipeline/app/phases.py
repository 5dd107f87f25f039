"""Phases of one recipe: a config that continues another config's run (`train.phase_of`),
as BERT's seq_len 512 phase continues its 128 phase (`configs/bert-base-512.yaml`) and
ModernBERT's context extension continues its first phase (`configs/modern-base-8k.yaml`).

`phase_chain` derives the chain that ends with a config; `child_overrides` starts a phase
from its parent phase's MLflow run, whose final checkpoint the warm start fetches wherever
the child trains. The `mlm-phases` flow runs the chain. No torch, no prefect.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import load_config, shipped_configs
from mlm_pipeline.errors import ConfigError

#: Longest chain `phase_chain` follows (a guard against a chain that never ends).
MAX_PHASES = 16


def phase_chain(config: str, overrides: Sequence[str] = ()) -> list[str]:
    """The phases that end with `config`, parent first: `config`'s `train.phase_of` (read
    with `overrides` applied), that config's own `phase_of` (as its file says), and so on
    to a config that names no parent; then `config` itself.

    Args:
        config: a config name or path (`load_config`).
        overrides: the dotted overrides of the run (they may set `train.phase_of` of
            `config`; the parents' are read from their files).

    Returns:
        Config names (a path for `config` itself when given as one), e.g.
        `["bert-base", "bert-base-512"]`; `[config]` for a config that names no parent.

    Raises:
        ConfigError: a `train.phase_of` is not a shipped config (the config naming it
            and the shipped names are given), the chain comes back to a config it passed
            (the chain is given), or is longer than `MAX_PHASES`; the errors of
            `load_config`.
    """
    chain = [config]
    parent = load_config(config, list(overrides)).train.phase_of
    while parent is not None:
        if parent not in shipped_configs():
            raise ConfigError(f"train.phase_of {parent!r} of config {chain[0]!r} is not a "
                              f"shipped config (shipped: {', '.join(sorted(shipped_configs()))})")
        if parent in chain:
            raise ConfigError("train.phase_of: the chain of phases comes back to "
                              f"{parent!r}: {' -> '.join([parent, *chain])}")
        if len(chain) == MAX_PHASES:
            raise ConfigError(f"train.phase_of: more than {MAX_PHASES} phases before "
                              f"{config!r}: {' -> '.join(chain[::-1])}")
        chain.insert(0, parent)
        parent = load_config(parent).train.phase_of
    return chain


def child_overrides(parent_run_id: str) -> list[str]:
    """The overrides a phase adds to start from its parent phase: `train.init_from` =
    the parent's MLflow run id (its final checkpoint: `tracking.fetch`), applied after
    the phase's own overrides.

    Raises:
        ValueError: `parent_run_id` is empty (the parent phase reported no MLflow run).
    """
    if not parent_run_id:
        raise ValueError("a phase's parent reported no MLflow run id to start from")
    return [f"train.init_from={parent_run_id}"]


def alone_warning(cfg: PipelineConfig) -> str | None:
    """What to tell a user who runs a phase config alone without a parent checkpoint
    (`train.phase_of` set, `train.init_from` unset): it trains from random weights, and
    which flow runs the chain; None otherwise."""
    if cfg.train.phase_of is None or cfg.train.init_from is not None:
        return None
    return (f"config {cfg.name!r} is a phase of {cfg.train.phase_of!r} "
            "(train.phase_of) but sets no train.init_from: it trains from random weights. "
            f"Start it from a finished {cfg.train.phase_of} run with --set "
            "train.init_from=RUN_ID, or run the chain with the mlm-phases flow "
            "(docs/deploy.md, Phases)")
