"""Bits per character: a masked-LM score that does not depend on the tokenizer.

`eval/loss` is nats per masked piece of one vocabulary: two models with other tokenizers
are not comparable on it. `bits_per_char` scores a model on plain text instead, so the
registry can compare a champion and a challenger that tokenize differently
(`app.rescore.BpcComparison`).

Definition (the same text and the same words for every model):

- Text: the documents given (the ingest stage's validation split), in order, split into
  words at whitespace (`str.split`); words are taken in order until their characters
  (each word's length plus one, see below) would pass `max_chars`.
- Chosen words: word `j` of document `i` is chosen when the first 8 bytes of
  `sha256(f"{seed}:{i}:{j}")`, read as a big-endian integer divided by 2**64, are below
  `rate`: a rule of the text's positions alone, so every model scores the same words.
- Per model: each word is encoded on its own by the model's tokenizer (SentencePiece adds
  its word-boundary marker "\u2581" to the first piece: the word's leading space); a
  document is `[CLS]` + its words' pieces + `[SEP]`, cut into windows of whole words of at
  most `seq_len - 2` pieces. In each window every piece of every chosen word is replaced
  by `[MASK]` and the model runs once; a chosen word's bits are the sum over its pieces of
  `-log2 p(piece)` under the model's softmax over its whole vocabulary at that position.
- `bits_per_char` = total bits of the chosen words / their total characters, where a
  word counts `len(word) + 1` characters: the word and the one space before it (the
  "\u2581" its first piece carries). Lower is better.

This is the whole-word variant of the masked-LM pseudo-log-likelihood (Salazar et al.
2020, "Masked Language Model Scoring", ACL), and an approximation of it in two ways: the
pieces of a word are predicted jointly in one forward (their product of conditionals,
not the chain rule), and the chosen words of a window are masked together (about 15 % of
the context hidden, as in training), not one at a time. Both models get the same
approximation on the same words; windows fall at other word boundaries when the
tokenizers cut words into other numbers of pieces, which changes the context of words
near a window edge only.

The holdout score (`holdout_metrics`) is this on the fixed holdout text
(`eval.holdout_sources`): it does not move with the corpus, so every model version's number
compares with every other's on the same digest; it is written beside the evaluation
(`holdout.json`), so the registry scores a champion on exactly the same text
(`app.decide.on_holdout`). torch and the tokenizer only: no MLflow.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline.config import EvalConfig
from mlm_pipeline.ingest.holdout import Holdout, text_digest, text_words
from mlm_pipeline.tokenizer import Tokenizer

#: The metric's name where it is logged or compared.
METRIC = "eval/bits_per_char"
#: The share of words chosen for scoring.
DEFAULT_RATE = 0.15


@dataclass(frozen=True)
class BpcResult:
    """A model's score on a text.

    Attributes:
        bits: total `-log2 p` of the chosen words' pieces (bits).
        chars: total characters of the chosen words (each `len(word) + 1`).
        words: chosen words scored.
        pieces: their pieces (this model's tokenizer).
    """

    bits: float
    chars: int
    words: int
    pieces: int

    @property
    def bits_per_char(self) -> float:
        """`bits / chars` (nan when no word was chosen)."""
        return self.bits / self.chars if self.chars else float("nan")


def word_is_chosen(seed: int, doc: int, word: int, rate: float) -> bool:
    """Whether word `word` of document `doc` is scored (see the module docstring)."""
    h = hashlib.sha256(f"{seed}:{doc}:{word}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < rate


@torch.no_grad()
def bits_per_char(model: torch.nn.Module, tokenizer: Tokenizer, documents: Iterable[str],
                  *, seed: int, max_chars: int, rate: float = DEFAULT_RATE,
                  batch_size: int = 16, device: str | torch.device = "cpu") -> BpcResult:
    """Score `model` (a `BertMLM`, `seq_len` and `vocab_size` attributes) on the chosen
    words of `documents` (see the module docstring), in fp32.

    Args:
        model: the masked LM; its vocabulary is `tokenizer`'s.
        tokenizer: the tokenizer it was trained with.
        documents: the held-out texts.
        seed: key of the word choice (the same for every model compared).
        max_chars: character budget of the text (words' `len + 1`).
        rate: share of words chosen, in (0, 1].
        batch_size: windows per forward (the result does not depend on it).
        device: where the model runs.

    Raises:
        ValueError: `rate` or `max_chars` out of range, the tokenizer's vocabulary is
            not the model's, or a word has more pieces than a window holds.
    """
    if not 0 < rate <= 1 or max_chars < 1:
        raise ValueError(f"bits_per_char: rate {rate} must be in (0, 1] and max_chars "
                         f"{max_chars} >= 1")
    if tokenizer.vocab_size != model.vocab_size:
        raise ValueError(f"bits_per_char: tokenizer {tokenizer.path} has "
                         f"{tokenizer.vocab_size} pieces, the model {model.vocab_size}")
    room = model.seq_len - 2
    windows: list[tuple[list[int], list[tuple[int, int, int]]]] = []  # ids, (start, end, chars)
    for i, words in enumerate(text_words(documents, max_chars)):
        ids: list[int] = []
        spans: list[tuple[int, int, int]] = []
        for j, (w, pieces) in enumerate(zip(words, tokenizer.encode(words), strict=True)):
            if len(pieces) > room:
                raise ValueError(f"bits_per_char: word {j} of document {i} ({w[:40]!r}) has "
                                 f"{len(pieces)} pieces, more than a window's {room}")
            if len(ids) + len(pieces) > room:
                windows.append((ids, spans))
                ids, spans = [], []
            if word_is_chosen(seed, i, j, rate):
                spans.append((len(ids) + 1, len(ids) + 1 + len(pieces), len(w) + 1))
            ids.extend(pieces)
        if ids:
            windows.append((ids, spans))
    bits, chars, nwords, npieces = 0.0, 0, 0, 0
    scored = [w for w in windows if w[1]]
    for b in range(0, len(scored), batch_size):
        batch = scored[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch) + 2
        input_ids = torch.full((len(batch), width), tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        targets = input_ids.clone()
        for r, (ids, spans) in enumerate(batch):
            row = torch.tensor([tokenizer.cls_id, *ids, tokenizer.sep_id])
            input_ids[r, :len(row)] = row
            targets[r, :len(row)] = row
            attention[r, :len(row)] = 1
            for start, end, _ in spans:
                input_ids[r, start:end] = tokenizer.mask_id
        logits = model(input_ids.to(device), attention.to(device)).logits.float()
        logp = torch.log_softmax(logits, dim=-1).cpu()
        for r, (_, spans) in enumerate(batch):
            for start, end, n in spans:
                pos = torch.arange(start, end)
                bits += -logp[r, pos, targets[r, pos]].double().sum().item() / math.log(2)
                chars += n
                nwords += 1
                npieces += end - start
    return BpcResult(bits=bits, chars=chars, words=nwords, pieces=npieces)


#: The metric the registry decides on when a holdout is set (lower is better).
HOLDOUT_METRIC = "holdout/bits_per_char"
#: The file of the scored text in the evaluation's directory.
HOLDOUT_FILE = "holdout.json"


def holdout_metrics(model: torch.nn.Module, tokenizer: Tokenizer, documents: list[str] |
                    tuple[str, ...], cfg: EvalConfig,
                    device: str | torch.device = "cpu") -> dict[str, float]:
    """Score `model` on the holdout documents.

    Args:
        model: the masked LM (a `BertMLM`), its vocabulary `tokenizer`'s.
        tokenizer: its tokenizer.
        documents: the scored holdout text (`Holdout.documents`).
        cfg: the `eval` section (`seed` chooses the words, `bpc_max_chars` caps the text,
            `batch_size` windows per forward).
        device: where the model runs (fp32).

    Returns:
        `holdout/bits_per_char` (bits per character of the chosen words),
        `holdout/chars` (characters of the scored text, each word `len + 1`) and
        `holdout/words_masked` (words chosen and scored).

    Raises:
        ValueError: the text has no chosen word, or a word has more pieces than a window.
    """
    result = bits_per_char(model, tokenizer, documents, seed=cfg.seed, rate=DEFAULT_RATE,
                           max_chars=cfg.bpc_max_chars, batch_size=cfg.batch_size,
                           device=device)
    if not result.words:
        raise ValueError(f"{HOLDOUT_METRIC}: no word of the holdout text was chosen (seed "
                         f"{cfg.seed}); add text to eval.holdout_sources")
    return {HOLDOUT_METRIC: result.bits_per_char,
            "holdout/chars": float(sum(len(w) + 1 for d in documents for w in d.split())),
            "holdout/words_masked": float(result.words)}


def write_holdout_text(holdout: Holdout, out_dir: str | Path) -> dict[str, Any]:
    """Write `holdout.json` (digest, sources, documents) into `out_dir`; returns the
    evaluation manifest's record of it: `digest`, `sources`, `file`."""
    path = Path(out_dir) / HOLDOUT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"digest": holdout.digest, "sources": list(holdout.sources),
                               "documents": list(holdout.documents)}, ensure_ascii=False),
                   encoding="utf-8")
    tmp.replace(path)
    return {"digest": holdout.digest, "sources": list(holdout.sources), "file": HOLDOUT_FILE}


def read_holdout_text(out_dir: str | Path, digest: str) -> list[str]:
    """The scored documents `write_holdout_text` wrote into `out_dir`.

    Raises:
        FileNotFoundError: there is no `holdout.json`.
        ValueError: its documents do not have `digest` (the file changed).
    """
    path = Path(out_dir) / HOLDOUT_FILE
    documents = json.loads(path.read_text(encoding="utf-8"))["documents"]
    if (got := text_digest(documents)) != digest:
        raise ValueError(f"{path}: the holdout text has digest {got}, the evaluation "
                         f"recorded {digest}")
    return documents
