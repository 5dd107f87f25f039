"""Encoders for the downstream protocol, ours or a Hugging Face one, and what they see of
a text.

`TextEncoder` is what the linear probe (`downstream`) and fine-tuning (`finetune`) need of
an encoder. `ours` wraps a `BertMLM`; `hugging_face` any `transformers` encoder, with its
own tokenizer or ours, so a benchmark puts a peer through the very same code.

What the encoder sees (`encoder_rows`) is one function, used by the probe, by fine-tuning
and by the "same input" TF-IDF baseline (`seen_texts`, the decoded pieces the encoder's
rows hold), so the baseline and the encoder cannot see different text under that label.
Inputs (`config.EncoderInput`), with a row budget of B = `seq_len - 2` pieces:

- `windows`: the text's pieces in consecutive windows of B (each `[CLS] w [SEP]`), at most
  `max_windows` of them; the states are mean-pooled over every real token of every window
  of the text, so the whole text (up to `max_windows * B` pieces) is seen;
- `head_tail`: one row of the first B // 4 and the last B - B // 4 pieces when the text is
  longer than B (Sun et al. 2019, "How to Fine-Tune BERT for Text Classification?",
  section 5.3.1: head+tail truncation, 128 + 382 of 510);
- `head`: the first B pieces.

A text pair is one row `[CLS] a [SEP] b [SEP]` whatever the input, its longer text cut
first until both fit (`transformers`' `longest_first`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mlm_pipeline.config import EncoderInput
from mlm_pipeline.tokenizer import Tokenizer

#: (module, input_ids int64 (B, L), attention_mask bool (B, L)) -> hidden states (B, L, H).
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TextEncoder:
    """An encoder and its tokenizer, as the downstream protocol uses them.

    Attributes:
        name: what it is, for logs (`ours (modern)`, `BertForMaskedLM`).
        module: the parameters (fine-tuning copies and updates them; never this one).
        hidden_size: H, the width of the hidden states.
        seq_len: the longest row the encoder takes, tokens.
        cls_id, sep_id, pad_id: its special ids.
        tokenize: texts -> their piece ids, no special tokens.
        decode: piece ids -> text (what TF-IDF reads as "the same input").
        forward: runs `module` to final hidden states (`Forward`).
        fresh: seed -> a randomly initialised module of the same architecture (its own
            weights, drawn by that seed; the global RNG is restored).
    """

    name: str
    module: nn.Module
    hidden_size: int
    seq_len: int
    cls_id: int
    sep_id: int
    pad_id: int
    tokenize: Callable[[list[str]], list[list[int]]]
    decode: Callable[[list[int]], str]
    forward: Forward
    fresh: Callable[[int], nn.Module]

    def random_init(self, seed: int) -> TextEncoder:
        """The same encoder with `fresh(seed)` as its module: the random-init control."""
        return replace(self, name=f"{self.name}, random init (seed {seed})",
                       module=self.fresh(seed))

    def copy(self) -> TextEncoder:
        """The same encoder with a deep copy of its module (to fine-tune)."""
        return replace(self, module=copy.deepcopy(self.module))


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module of a DDP (`module`) or `torch.compile` (`_orig_mod`) wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def ours(model: nn.Module, tokenizer: Tokenizer) -> TextEncoder:
    """A `BertMLM` (or a wrapper of one) and its tokenizer as a `TextEncoder`; `fresh`
    builds a `BertMLM` of the same config, vocabulary and `seq_len` with the model's own
    initialisation (BERT's truncated normal) under the seed."""
    from mlm_pipeline.train.model import BertMLM

    module = unwrap(model)
    cfg, vocab, seq_len = module.cfg, module.vocab_size, module.seq_len
    return TextEncoder(
        name=f"ours ({cfg.preset or cfg.norm + '-LN'})", module=module,
        hidden_size=cfg.hidden_size, seq_len=seq_len, cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id,
        tokenize=lambda texts: tokenizer.encode(list(texts)),
        decode=lambda ids: tokenizer.decode(ids),
        forward=lambda m, ids, mask: m.encode(ids, mask),
        fresh=lambda seed: _seeded(seed, lambda: BertMLM(cfg, vocab, seq_len)))


def hugging_face(model: nn.Module, tokenizer: Any) -> TextEncoder:
    """A `transformers` model as a `TextEncoder`.

    Args:
        model: a `PreTrainedModel` whose `base_model` returns `last_hidden_state`
            (`BertForMaskedLM`, `ModernBertForMaskedLM`, `BertModel`, ...).
        tokenizer: its `transformers` tokenizer (pieces by `tokenizer(texts,
            add_special_tokens=False)`, special ids from its `cls_token_id`, ...), or our
            `Tokenizer` when the model was trained on our vocabulary (the benchmark's
            peers).

    `fresh` builds `type(model)(model.config)` under the seed: the class's own
    initialisation.
    """
    config = model.config
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    if isinstance(tokenizer, Tokenizer):
        tokenize = lambda texts: tokenizer.encode(list(texts))  # noqa: E731
        cls_id, sep_id, pad_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
        seq_len = config.max_position_embeddings
    else:
        tokenize = lambda texts: tokenizer(list(texts), add_special_tokens=False)[  # noqa: E731
            "input_ids"]
        cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        seq_len = min(config.max_position_embeddings, tokenizer.model_max_length)

    def forward(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return m.base_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state

    return TextEncoder(
        name=type(model).__name__, module=model, hidden_size=config.hidden_size,
        seq_len=int(seq_len), cls_id=int(cls_id), sep_id=int(sep_id), pad_id=int(pad_id),
        tokenize=tokenize, decode=decode, forward=forward,
        fresh=lambda seed: _seeded(seed, lambda: type(model)(config)))


@dataclass(frozen=True)
class EncodedTexts:
    """What an encoder sees of a list of texts (`encoder_rows`).

    Attributes:
        rows: token rows, `[CLS] ... [SEP]` (a pair: `[CLS] a [SEP] b [SEP]`), each at most
            `seq_len` tokens.
        owner: for each row, the index of its text.
        seen: for each text, the piece ids its rows hold (a pair: the first text's, then
            the second's), in order.
        seen_pair_start: for a pair, where the second text's pieces start in `seen`;
            None for single texts.
        pieces: pieces of every text in full.
    """

    rows: list[list[int]]
    owner: list[int]
    seen: list[list[int]]
    seen_pair_start: list[int] | None
    pieces: int

    @property
    def pieces_seen_share(self) -> float:
        """Share of the texts' pieces the rows hold."""
        return sum(map(len, self.seen)) / max(1, self.pieces)


def encoder_rows(encoder: TextEncoder, texts: Sequence[str], pairs: Sequence[str] | None = None,
                 *, input: EncoderInput = "windows", seq_len: int | None = None,
                 max_windows: int = 8) -> EncodedTexts:
    """The rows an encoder is given for `texts` (module docstring).

    Args:
        encoder: gives the tokenizer and special ids.
        texts: the texts.
        pairs: their second texts (a pair task), or None.
        input: `windows`, `head_tail` or `head`.
        seq_len: tokens per row (>= 3 for single texts, >= 4 for pairs); None or larger
            than the encoder's: the encoder's `seq_len`.
        max_windows: windows per text at most (`windows`).

    Raises:
        ValueError: `seq_len` leaves no room for a piece.
    """
    length = min(seq_len or encoder.seq_len, encoder.seq_len)
    budget = length - (2 if pairs is None else 3)
    if budget < 1:
        raise ValueError(f"downstream: seq_len {length} leaves no room for a piece")
    cls, sep = encoder.cls_id, encoder.sep_id
    ids = encoder.tokenize(list(texts))
    if pairs is not None:
        second = encoder.tokenize(list(pairs))
        cut = [_longest_first(a, b, budget) for a, b in zip(ids, second, strict=True)]
        return EncodedTexts([[cls, *a, sep, *b, sep] for a, b in cut], list(range(len(cut))),
                            [[*a, *b] for a, b in cut], [len(a) for a, _ in cut],
                            sum(map(len, ids)) + sum(map(len, second)))
    rows: list[list[int]] = []
    owner: list[int] = []
    seen: list[list[int]] = []
    for i, pieces in enumerate(ids):
        if input == "windows":
            windows = [pieces[s:s + budget] for s in range(0, len(pieces), budget)]
            windows = windows[:max_windows] or [[]]
        elif input == "head_tail" and len(pieces) > budget:
            head = budget // 4
            windows = [pieces[:head] + pieces[len(pieces) - (budget - head):]]
        else:
            windows = [pieces[:budget]]
        rows += [[cls, *w, sep] for w in windows]
        owner += [i] * len(windows)
        seen.append([p for w in windows for p in w])
    return EncodedTexts(rows, owner, seen, None, sum(map(len, ids)))


def _longest_first(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Cut the longer of `a`, `b` by one piece from its end until both fit in `budget`."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()
    return a, b


def seen_texts(encoder: TextEncoder, encoded: EncodedTexts) -> list[str]:
    """The text of exactly the pieces the encoder's rows hold, per text (a pair: its two
    parts decoded apart, joined by a space): the "same input" of the TF-IDF baseline."""
    if encoded.seen_pair_start is None:
        return [encoder.decode(s) for s in encoded.seen]
    return [f"{encoder.decode(s[:k])} {encoder.decode(s[k:])}"
            for s, k in zip(encoded.seen, encoded.seen_pair_start)]


def full_texts(texts: Sequence[str], pairs: Sequence[str] | None) -> list[str]:
    """The whole text of each row (a pair: its two texts joined by a space): what the
    "whole text" TF-IDF baseline reads."""
    if pairs is None:
        return list(texts)
    return [f"{a} {b}" for a, b in zip(texts, pairs, strict=True)]


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with `pad_id` to the longest: int64 `input_ids` (R, L) and bool
    `attention_mask` (R, L), True at real tokens."""
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return input_ids, mask


def pooled_sums(encoder: TextEncoder, module: nn.Module, rows: list[list[int]],
                owner: list[int], n_texts: int, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per text, the sum of the final hidden states over every real token ([CLS] and [SEP]
    included) of its rows in this batch, float32 (n_texts, H), and how many tokens that
    is, float32 (n_texts,); differentiable. A text may own no row of the batch (count 0).

    Args:
        encoder: gives `forward` and `pad_id`.
        module: the module to run (the encoder's, a copy, a random init).
        rows: token rows; `owner[r]` in [0, n_texts) is row r's text.
        n_texts: texts.
        device: where `module` is.
    """
    input_ids, mask = (t.to(device) for t in pad_rows(rows, encoder.pad_id))
    hidden = encoder.forward(module, input_ids, mask).float()               # (R, L, H)
    weights = mask.unsqueeze(-1).float()
    index = torch.tensor(owner, device=hidden.device)
    sums = torch.zeros(n_texts, hidden.shape[-1], device=hidden.device).index_add(
        0, index, (hidden * weights).sum(1))
    counts = torch.zeros(n_texts, device=hidden.device).index_add(0, index, weights.sum((1, 2)))
    return sums, counts


def pooled_states(encoder: TextEncoder, module: nn.Module, rows: list[list[int]],
                  owner: list[int], n_texts: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """Mean of the final hidden states over every real token ([CLS] and [SEP] included) of
    every row of each text: (n_texts, H) float32, differentiable. Arguments as
    `pooled_sums`; each text must own at least one row."""
    sums, counts = pooled_sums(encoder, module, rows, owner, n_texts, device)
    return sums / counts.unsqueeze(-1)


def length_batches(encoded: EncodedTexts, rows_per_batch: int) -> list[list[int]]:
    """Row indices of `encoded` in batches of at most `rows_per_batch`, shortest rows first:
    rows of one batch have about the same length, so padding them to the longest costs
    little (on the review set's 128-token windows, 24 % more tokens than real ones in
    batches of whole texts, 2.3 % sorted). A text's rows may fall in several batches."""
    order = sorted(range(len(encoded.rows)), key=lambda r: len(encoded.rows[r]))
    return [order[i:i + rows_per_batch] for i in range(0, len(order), rows_per_batch)]


def text_batches(encoded: EncodedTexts, batch_size: int, order: Sequence[int] | None = None
                 ) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """Batches of `batch_size` texts (in `order`, default 0..n-1): each the text indices,
    their rows and each row's position in the batch."""
    by_text: dict[int, list[list[int]]] = {}
    for row, i in zip(encoded.rows, encoded.owner):
        by_text.setdefault(i, []).append(row)
    order = list(range(len(encoded.seen))) if order is None else list(order)
    out = []
    for start in range(0, len(order), batch_size):
        picked = order[start:start + batch_size]
        rows = [r for i in picked for r in by_text[i]]
        owner = [j for j, i in enumerate(picked) for _ in by_text[i]]
        out.append((picked, rows, owner))
    return out
