"""`KeyedMasking` (the settings of one masking, applied with `mask_tokens`) and the stateful
maskers the training loop calls: dynamic (keyed by epoch) or precomputed (the
copies `mlm_pipeline.shards.masked_copies` wrote, read through a `MaskedCopies` reader).

Both produce exactly what `mlm_pipeline.masking.keyed.mask_tokens` gives for (seed, epoch, row):
the dynamic masker computes it on the training device, the precomputed one reads the
copies the shards stage wrote with it. `build_masker` is the single dispatch point on
`MaskingConfig.mode`.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mlm_pipeline.config import NUM_SPECIAL, MaskingConfig, schedule_problems
from mlm_pipeline.manifest import ShardManifest
from mlm_pipeline.masking.keyed import MASKING_ALGORITHM, mask_tokens

logger = logging.getLogger(__name__)


class KeyedMasking:
    """One masking setup, the single object training, precomputed copies and evaluation
    mask with: the `MaskingConfig` settings, the vocabulary, the seed and (whole words) the
    word starts, applied by `mask_tokens`.

    Args:
        cfg: probabilities, `selection`, `whole_word` and (unless `seed` is given) `seed`;
            the rate used when a call names none is `cfg.eval_probability` (the constant
            `mlm_probability`, or a schedule's fixed `eval_rate`).
        vocab_size: number of ids, the special tokens included.
        word_starts: bool (vocab_size,) tensor or array, True where an id begins a word
            (`Tokenizer.word_starts()`); required when `cfg.whole_word`, ignored otherwise.
        seed: the key, when it is not `cfg.seed` (evaluation masks with `eval.seed`).

    Raises:
        ValueError: `vocab_size <= NUM_SPECIAL`, `cfg.whole_word` without `word_starts`, or
            `word_starts` not shaped (vocab_size,).
    """

    def __init__(self, cfg: MaskingConfig, vocab_size: int, word_starts=None,
                 seed: int | None = None) -> None:
        if vocab_size <= NUM_SPECIAL:
            raise ValueError(
                f"masking: vocab_size {vocab_size} must exceed NUM_SPECIAL={NUM_SPECIAL}"
            )
        if cfg.whole_word and word_starts is None:
            raise ValueError(
                "masking: masking.whole_word is set but no word_starts were given "
                "(pass Tokenizer.word_starts())"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.seed = cfg.seed if seed is None else seed
        self.mlm_probability = cfg.eval_probability
        self._word_starts: dict[torch.device, Tensor] = {}
        if cfg.whole_word:
            starts = torch.as_tensor(word_starts).to("cpu", torch.bool)
            if starts.shape != (vocab_size,):
                raise ValueError(f"masking: word_starts has shape {tuple(starts.shape)}, "
                                 f"expected ({vocab_size},)")
            self._word_starts[starts.device] = starts

    def _starts_on(self, device: torch.device) -> Tensor | None:
        """The word starts on `device` (copied once per device), or None for tokens."""
        if not self._word_starts:
            return None
        if device not in self._word_starts:
            self._word_starts[device] = next(iter(self._word_starts.values())).to(device)
        return self._word_starts[device]

    def __call__(self, input_ids: Tensor, row_index: Tensor | None, epoch: int,
                 mlm_probability: float | None = None) -> tuple[Tensor, Tensor]:
        """Corrupt a batch: `mask_tokens` with these settings (shapes, dtypes, errors there).

        Args:
            input_ids: token ids (B, L), integer dtype; not modified.
            row_index: int64 (B,) global row ids (None: `arange(B)`).
            epoch: epoch number (copy number for precomputed copies, 0 for evaluation).
            mlm_probability: the selection rate of this batch (a schedule's rate at the
                step); None: `self.mlm_probability`.

        Returns:
            `(input_ids, labels)`, int64 (B, L) on the device of `input_ids`.
        """
        return mask_tokens(
            input_ids, vocab_size=self.vocab_size, row_index=row_index, seed=self.seed,
            epoch=epoch,
            mlm_probability=self.mlm_probability if mlm_probability is None else mlm_probability,
            mask_replace_prob=self.cfg.mask_replace_prob,
            random_replace_prob=self.cfg.random_replace_prob,
            selection=self.cfg.selection, word_starts=self._starts_on(input_ids.device),
        )


@runtime_checkable
class Masker(Protocol):
    """Turns a batch of token ids into (input_ids, labels); stateful for checkpoints."""

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int, step: int = 0
                 ) -> tuple[Tensor, Tensor]:
        """Corrupt `input_ids` (B, L) for rows `row_index` (B,) in `epoch`, for the optimizer
        step that follows `step` completed steps; see `mask_tokens`."""
        ...

    def mlm_probability_at(self, step: int) -> float:
        """The selection rate of the optimizer step that follows `step` completed steps."""
        ...

    def state_dict(self) -> dict:
        """Everything needed to reproduce the masks after a resume."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        ...


class DynamicMasker:
    """Dynamic masking (RoBERTa, Liu et al. 2019, §4.1): a fresh mask per epoch, keyed.

    Stateless apart from the seed: the mask of a row is a pure function of
    (seed, epoch, row index, row ids) and, with a masking-rate schedule, of the step (the
    rate), so a resume reproduces it without any RNG state. With Bernoulli selection a
    lower rate selects a subset of a higher rate's tokens (the same draws, a lower
    threshold).

    Args:
        masking: the settings (`KeyedMasking`: config, vocabulary, seed, word starts).
        max_steps: `train.max_steps`, the span of a `linear` schedule without `end_step`.
    """

    mode = "dynamic"

    def __init__(self, masking: KeyedMasking, max_steps: int = 1) -> None:
        self.masking = masking
        self.max_steps = max_steps

    def mlm_probability_at(self, step: int) -> float:
        """The selection rate after `step` completed optimizer steps
        (`MaskingConfig.mlm_probability_at`)."""
        return self.masking.cfg.mlm_probability_at(step, self.max_steps)

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int, step: int = 0
                 ) -> tuple[Tensor, Tensor]:
        """Corrupt a batch; see `mask_tokens` for shapes, dtypes and errors.

        Args:
            input_ids: token ids (B, L), integer dtype; not modified.
            row_index: int64 (B,) global row ids.
            epoch: epoch number.
            step: completed optimizer steps (selects the rate of a schedule).

        Returns:
            `(input_ids, labels)`, int64 (B, L).
        """
        return self.masking(input_ids, row_index, epoch, self.mlm_probability_at(step))

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size", "selection", "whole_word", "algorithm"}`
        (plain Python values)."""
        m = self.masking
        return {"mode": self.mode, "seed": m.seed, "vocab_size": m.vocab_size,
                "selection": m.cfg.selection, "whole_word": m.cfg.whole_word,
                "algorithm": MASKING_ALGORITHM}

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpoint's masking state against this masker and restore the seed.

        Raises:
            ValueError: the state comes from another masking mode, vocabulary size,
                selection, whole-word setting or masking algorithm version.
        """
        mine = self.state_dict()
        differ = {k: state.get(k) for k in mine if k != "seed" and state.get(k) != mine[k]}
        if differ:
            raise ValueError(
                f"masking: checkpoint masking state {differ} does not match this run's "
                f"{ {k: mine[k] for k in differ} }"
            )
        self.masking.seed = int(state["seed"])


@runtime_checkable
class MaskedCopies(Protocol):
    """Reader of precomputed masked copies (`mlm_pipeline.train.data.PrecomputedShardDataset`)."""

    dupe_factor: int

    def get(self, indices: np.ndarray, epoch: int) -> tuple[Tensor, Tensor]:
        """`(input_ids, labels)` int64 (len(indices), L) of copy `epoch % dupe_factor`."""
        ...


class PrecomputedMasker:
    """Precomputed (static) masking (BERT, Devlin et al. 2019): reads the masked copies the
    shards stage wrote with `mask_tokens` keyed by (seed, copy, row); epoch `e` gets copy
    `e % dupe_factor`. With `dupe_factor` > the epochs trained, the masks equal dynamic
    masking's; the position is the data cursor's epoch, so there is no state to restore.

    Args:
        cfg: masking config (must be the one the copies were written with, seed included).
        vocab_size: number of ids, the special tokens included.
        source: the masked copies of the training split.
    """

    mode = "precomputed"

    def __init__(self, cfg: MaskingConfig, vocab_size: int, source: MaskedCopies) -> None:
        self.cfg, self.vocab_size, self.seed, self.source = cfg, vocab_size, cfg.seed, source

    def mlm_probability_at(self, step: int) -> float:
        """The copies' one rate (precomputed masking takes no schedule), at any `step`."""
        return self.cfg.mlm_probability_at(step, 1)

    def __call__(self, input_ids: Tensor, row_index: Tensor, epoch: int, step: int = 0
                 ) -> tuple[Tensor, Tensor]:
        """The precomputed corruption of rows `row_index` in `epoch`.

        Args:
            input_ids: the unmasked rows (B, L); only their shape and device are used (the
                copies were made from the same rows by the shards stage).
            row_index: int64 (B,) global training row ids.
            epoch: epoch number; copy `epoch % dupe_factor` is read.
            step: completed optimizer steps (unused: the copies have one rate).

        Returns:
            `(input_ids, labels)`, int64 (B, L) on the device of `input_ids`.

        Raises:
            ValueError: the copies' rows are not shaped like `input_ids`.
        """
        ids, labels = self.source.get(row_index.cpu().numpy(), epoch)
        if ids.shape != input_ids.shape:
            raise ValueError(
                f"masking: precomputed rows {tuple(ids.shape)} differ from the batch "
                f"{tuple(input_ids.shape)}"
            )
        device = input_ids.device
        return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """Return `{"mode", "seed", "vocab_size", "dupe_factor", "selection",
        "whole_word"}` (plain Python values)."""
        return {"mode": self.mode, "seed": self.seed, "vocab_size": self.vocab_size,
                "dupe_factor": self.source.dupe_factor, "selection": self.cfg.selection,
                "whole_word": self.cfg.whole_word}

    def load_state_dict(self, state: dict) -> None:
        """Check that a checkpoint's masking matches these copies (nothing else to restore).

        Raises:
            ValueError: the state comes from another mode, vocabulary, seed, dupe_factor,
                selection or whole-word setting.
        """
        if state != self.state_dict():
            raise ValueError(
                f"masking: checkpoint state {state} does not match {self.state_dict()}"
            )


def build_masker(
    cfg: MaskingConfig, vocab_size: int, shards: ShardManifest | None = None,
    word_starts: Tensor | np.ndarray | None = None, copies: MaskedCopies | None = None,
    max_steps: int | None = None,
) -> Masker:
    """Build the masker selected by `cfg.mode` (the single dispatch point, STYLE rule 6).

    Args:
        cfg: masking config (its `seed` keys the masks).
        vocab_size: number of ids, the special tokens included.
        shards: the training shards; required by `precomputed` mode, whose manifest records
            the masking the copies were written with.
        word_starts: bool (vocab_size,), True where an id begins a word
            (`Tokenizer.word_starts()`); required by `dynamic` mode with `cfg.whole_word`
            (precomputed copies already hold their whole-word masks), ignored otherwise.
        copies: the reader of the shards' masked copies
            (`train.data.PrecomputedShardDataset(shards)`); required by `precomputed` mode.
        max_steps: `train.max_steps`; required when `cfg.mlm_probability` is a schedule.

    Returns:
        A `Masker`.

    Raises:
        ValueError: unknown `cfg.mode`, `vocab_size <= NUM_SPECIAL`, in `dynamic` mode
            `cfg.whole_word` without `word_starts`, or in `precomputed` mode: no `shards` or
            `copies`, or copies written with another masking config or seed than `cfg`; a
            schedule without `max_steps` or with steps beyond it.
    """
    if cfg.mode == "dynamic":
        if cfg.scheduled:
            if max_steps is None:
                raise ValueError("masking.mlm_probability: a schedule needs train.max_steps "
                                 "(pass max_steps)")
            if problems := schedule_problems(cfg.mlm_probability, max_steps):
                raise ValueError("; ".join(problems))
        masking = KeyedMasking(cfg, vocab_size, word_starts if cfg.whole_word else None)
        return DynamicMasker(masking, max_steps or 1)
    if cfg.mode == "precomputed":
        if shards is None or copies is None:
            raise ValueError("masking: precomputed mode needs the shard manifest and its copies")
        want = {"masking": cfg.masks_record(), "masking_seed": cfg.seed,
                "masking_algorithm": MASKING_ALGORITHM}
        have = {k: shards.config.get(k) for k in want}
        if have != want:
            raise ValueError(
                f"masking: the shards in {shards.output_dir} were written with {have}, but "
                f"training asks for {want}; rewrite them with this masking config"
            )
        return PrecomputedMasker(cfg, vocab_size, copies)
    raise ValueError(f"masking: unknown mode {cfg.mode!r}")
