"""The model an adapted run started from, as an evaluation arm: before vs after adaptation.

A run with a parent (`train.init_from`: a Hugging Face directory, one of our checkpoints,
an MLflow source fetched to one) continues pretraining it. Its evaluation reports the
parent beside the adapted model, with the same code, seeds, splits and masks:

- `eval/parent_loss`, `eval/parent_mlm_accuracy`, `eval/parent_top5_accuracy`: the
  parent's masked-LM figures on the run's own validation rows with the final evaluation's
  fixed masks (the same `eval.mlm_probability`, 15 % by default, the same rows);
- `probe/accuracy_parent` (`downstream.probe_task`) and fine-tuning's parent arm
  (`finetune/parent_accuracy` ..., `finetune/diff_parent`: adapted - parent, paired by
  seed, with its 95 % interval; `finetune.finetune_task`).

The parent arm is the weights the run was initialised with at step 0 (its lineage record
`TrainManifest.init`), read, checked and fitted to the run's architecture as the warm start
does (`parent_weights`), in a copy of the trained model. A parent that cannot be read any
more (moved, deleted, changed since the run) is no arm: the figures are tags
`unavailable.<figure>` with the reason (`PARENT_FIGURES`), never a failed evaluation.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline.train.hf_import import fit_vocab
from mlm_pipeline.train.warm_start import (
    fit_positions,
    init_weights,
    resolve_hf_init,
    resolve_init,
)

logger = logging.getLogger(__name__)

#: The figures of the parent arm, each named by a tag `unavailable.<figure>` when the
#: parent cannot be read (`probe/` and `finetune/` only when those evaluations run).
PARENT_FIGURES = ("eval/parent_loss", "probe/accuracy_parent", "finetune/parent_accuracy")
#: `masked_lm_metrics` keys reported for the parent, and the names they get.
PARENT_MLM_KEYS = {"eval/loss": "eval/parent_loss",
                   "eval/mlm_accuracy": "eval/parent_mlm_accuracy",
                   "eval/top5_accuracy": "eval/parent_top5_accuracy"}


def parent_weights(init: dict[str, Any], vocab_size: int, seq_len: int,
                   trust_unverified: bool = False) -> dict[str, torch.Tensor]:
    """The state dict a run with lineage record `init` started from (CPU, fp32), fitted
    to the run's `seq_len` and `vocab_size` (`warm_start.parent_of_run`'s weights).

    Args:
        init: the run's `TrainManifest.init` (`InitSource.record`: `source`,
            `checkpoint`, `digest`, `hf_class` for a Hugging Face parent).
        vocab_size: the run's tokenizer ids (V).
        seq_len: the run's row length, tokens.
        trust_unverified: accept a checkpoint without a digest (the run's
            `train.trust_unverified_checkpoint`).

    Raises:
        ValueError: the parent's digest is not the record's (it changed since the run),
            or the errors of `resolve_init` / `resolve_hf_init` / `init_weights`.
        FileNotFoundError: the parent is gone.
    """
    checkpoint = Path(init["checkpoint"])
    if not checkpoint.exists():
        raise FileNotFoundError(f"{checkpoint}: no such directory")
    source = str(init.get("source") or checkpoint)
    found = (resolve_hf_init(source, checkpoint) if init.get("hf_class")
             else resolve_init(source, checkpoint, trust_unverified))
    if init.get("digest") and found.digest != init["digest"]:
        raise ValueError(f"{checkpoint}: digest {found.digest[:16]}, the run started from "
                         f"{str(init['digest'])[:16]} (the parent changed since)")
    return fit_vocab(fit_positions(init_weights(found, trust_unverified), seq_len), vocab_size)


def parent_model(init: dict[str, Any] | None, model: torch.nn.Module,
                 trust_unverified: bool = False) -> tuple[torch.nn.Module | None, str | None]:
    """The parent arm: a copy of `model` (a `BertMLM`, left unchanged) holding the weights
    the run started from (`parent_weights`), on `model`'s device, in eval mode.

    Returns:
        (the parent model, None); (None, None) for a run without a parent (`init` None);
        (None, reason) when the parent cannot be read (`unavailable.*` tags say why).
    """
    if init is None:
        return None, None
    module = getattr(model, "_orig_mod", model)
    try:
        state = parent_weights(init, module.vocab_size, module.seq_len, trust_unverified)
        parent = copy.deepcopy(module)
        parent.load_state_dict(state, strict=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        logger.warning("evaluation: the parent %s cannot be read, no parent arm: %s",
                       init.get("source"), exc)
        return None, f"parent {init.get('source')!r} not readable: {exc}"[:1000]
    logger.info("evaluation: parent arm %s (digest %s)", init.get("source"),
                str(init.get("digest"))[:16])
    return parent.eval(), None


def parent_tags(reason: str, probe: bool, finetune: bool) -> dict[str, str]:
    """`unavailable.<figure>` -> `reason` for each parent figure (`PARENT_FIGURES`) whose
    evaluation runs (`probe`, `finetune`: those evaluations are enabled)."""
    wanted = dict(zip(PARENT_FIGURES, (True, probe, finetune), strict=True))
    return {f"unavailable.{figure}": reason for figure in PARENT_FIGURES if wanted[figure]}
