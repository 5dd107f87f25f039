"""`KeyedMasking` (the settings of one masking, applied with `mask_tokens`) and the stateful
maskers the training loop calls, both giving exactly `mask_tokens`' result for (seed, epoch,
row): dynamic (computed on the training device) or precomputed (the copies
`mlm_pipeline.shards.masked_copies` wrote, read through a `MaskedCopies` reader).
`build_masker` is the single dispatch point on `MaskingConfig.mode`.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mlm_pipeline.config import MaskingConfig, SpecialIds, schedule_problems
from mlm_pipeline.manifest import ShardManifest
from mlm_pipeline.masking.keyed import MASKING_ALGORITHM, mask_tokens
from mlm_pipeline.masking.vocab import masking_vocab

logger = logging.getLogger(__name__)


class KeyedMasking:
    """One masking setup, the single object training, precomputed copies and evaluation
    mask with: the `MaskingConfig` settings, the vocabulary and its special ids, the seed
    and (whole words) the word boundaries, applied by `mask_tokens`.

    Args:
        cfg: probabilities, `selection`, `whole_word` and (unless `seed` is given) `seed`;
            the rate used when a call names none is `cfg.eval_probability` (the constant
            `mlm_probability`, or a schedule's fixed `eval_rate`).
        vocab_size: number of ids, the special tokens included.
        word_starts: bool (vocab_size,) tensor or array, True where an id begins a word
            (`Tokenizer.word_starts()`); required when `cfg.whole_word`, ignored otherwise.
        seed: the key, when it is not `cfg.seed` (evaluation masks with `eval.seed`).
        special_ids: the tokenizer's special ids (`Tokenizer.special_ids`, or the
            shards' `ShardManifest.special_ids`): never selected, never drawn, and the
            [MASK] id. None: `SENTENCEPIECE_SPECIAL_IDS`, the ids of the SentencePiece
            tokenizers this pipeline trains.
        word_ends: bool (vocab_size,), True where a word ends with an id
            (`Tokenizer.word_ends()`, byte-level BPE); None: only special tokens end words.

    Raises:
        ValueError: a special id is not below `vocab_size` or no ordinary id is left,
            `cfg.whole_word` without `word_starts`, or a word table not shaped
            (vocab_size,).
    """

    def __init__(self, cfg: MaskingConfig, vocab_size: int, word_starts=None,
                 seed: int | None = None, *, special_ids: SpecialIds | None = None,
                 word_ends=None) -> None:
        self.vocab = masking_vocab(vocab_size, special_ids)
        if cfg.whole_word and word_starts is None:
            raise ValueError(
                "masking: masking.whole_word is set but no word_starts were given "
                "(pass Tokenizer.word_starts())"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.special_ids = self.vocab.special_ids
        self.seed = cfg.seed if seed is None else seed
        self.mlm_probability = cfg.eval_probability
        self._tables: dict[torch.device, tuple[Tensor | None, Tensor | None]] = {}
        if cfg.whole_word:
            tables = []
            for name, table in (("word_starts", word_starts), ("word_ends", word_ends)):
                if table is not None:
                    table = torch.as_tensor(table).to("cpu", torch.bool)
                    if table.shape != (vocab_size,):
                        raise ValueError(f"masking: {name} has shape {tuple(table.shape)}, "
                                         f"expected ({vocab_size},)")
                tables.append(table)
            self._tables[torch.device("cpu")] = (tables[0], tables[1])

    def _tables_on(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """`(word_starts, word_ends)` on `device`, copied once; Nones for tokens."""
        if not self._tables:
            return None, None
        if device not in self._tables:
            starts, ends = self._tables[torch.device("cpu")]
            self._tables[device] = (starts.to(device),
                                    None if ends is None else ends.to(device))
        return self._tables[device]

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
        starts, ends = self._tables_on(input_ids.device)
        p = self.mlm_probability if mlm_probability is None else mlm_probability
        return mask_tokens(
            input_ids, vocab_size=self.vocab_size, row_index=row_index, seed=self.seed,
            epoch=epoch, mlm_probability=p, mask_replace_prob=self.cfg.mask_replace_prob,
            random_replace_prob=self.cfg.random_replace_prob, selection=self.cfg.selection,
            word_starts=starts, word_ends=ends, special_ids=self.special_ids)


def keyed_masking(cfg: MaskingConfig, tokenizer, seed: int | None = None) -> KeyedMasking:
    """The `KeyedMasking` of `cfg` for a tokenizer (`mlm_pipeline.tokenizer.Tokenizer`):
    its vocabulary size and special ids, and with `cfg.whole_word` its word boundaries
    (`word_starts`, `word_ends`).

    Raises:
        ValueError: `KeyedMasking`'s, and with `cfg.whole_word` a tokenizer that does not
            mark words.
    """
    starts = ends = None
    if cfg.whole_word:
        starts, ends = tokenizer.word_starts(), tokenizer.word_ends()
    return KeyedMasking(cfg, tokenizer.vocab_size, starts, seed,
                        special_ids=tokenizer.special_ids, word_ends=ends)


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

    Stateless apart from the seed: a row's mask is a pure function of (seed, epoch, row
    index, row ids) and, with a rate schedule, of the step, so a resume reproduces it.
    With Bernoulli selection a lower rate selects a subset of a higher rate's tokens (the
    same draws, a lower threshold).

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
        """Corrupt `input_ids` (B, L, integer dtype; not modified) of rows `row_index`
        (int64 (B,)) in `epoch` at the rate after `step` completed optimizer steps:
        `(input_ids, labels)`, int64 (B, L) (shapes, dtypes and errors: `mask_tokens`)."""
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
            raise ValueError(f"masking: checkpoint masking state {differ} does not match this "
                             f"run's { {k: mine[k] for k in differ} }")
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
        """The precomputed corruption (copy `epoch % dupe_factor`) of rows `row_index`
        (int64 (B,) global training row ids): `(input_ids, labels)`, int64 (B, L) on the
        device of `input_ids` (the unmasked rows (B, L): only their shape and device are
        used). `step` is unused: the copies have one rate.

        Raises:
            ValueError: the copies' rows are not shaped like `input_ids`.
        """
        ids, labels = self.source.get(row_index.cpu().numpy(), epoch)
        if ids.shape != input_ids.shape:
            raise ValueError(f"masking: precomputed rows {tuple(ids.shape)} differ from the "
                             f"batch {tuple(input_ids.shape)}")
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
            raise ValueError(f"masking: checkpoint state {state} does not match "
                             f"{self.state_dict()}")


def build_masker(
    cfg: MaskingConfig, vocab_size: int, shards: ShardManifest | None = None,
    word_starts: Tensor | np.ndarray | None = None, copies: MaskedCopies | None = None,
    max_steps: int | None = None, *, special_ids: SpecialIds | None = None,
    word_ends: Tensor | np.ndarray | None = None,
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
        special_ids: the ids the shards were written with (`ShardManifest.special_ids`);
            None: `SENTENCEPIECE_SPECIAL_IDS`. In `precomputed` mode they must be the
            shards' (the copies were masked with them).
        word_ends: bool (vocab_size,), where words end (`Tokenizer.word_ends()`), with
            `word_starts`; None: only special tokens end words.

    Raises:
        ValueError: unknown `cfg.mode`, a special id outside the vocabulary, in `dynamic` mode
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
        masking = KeyedMasking(cfg, vocab_size, word_starts if cfg.whole_word else None,
                               special_ids=special_ids, word_ends=word_ends)
        return DynamicMasker(masking, max_steps or 1)
    if cfg.mode == "precomputed":
        if shards is None or copies is None:
            raise ValueError("masking: precomputed mode needs the shard manifest and its copies")
        want = {"masking": cfg.masks_record(), "masking_seed": cfg.seed,
                "masking_algorithm": MASKING_ALGORITHM}
        have = {k: shards.config.get(k) for k in want}
        if have != want:
            raise ValueError(f"masking: the shards in {shards.output_dir} were written with "
                             f"{have}, but training asks for {want}; rewrite them with this "
                             "masking config")
        masking_vocab(vocab_size, special_ids)  # the ids fit the vocabulary
        if special_ids is not None and special_ids != shards.special_ids:
            raise ValueError(
                f"masking: the copies in {shards.output_dir} were masked with special ids "
                f"{shards.special_ids.roles()}, training asks for {special_ids.roles()}")
        return PrecomputedMasker(cfg, vocab_size, copies)
    raise ValueError(f"masking: unknown mode {cfg.mode!r}")
