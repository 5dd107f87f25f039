"""The model's score on the fixed holdout text (`eval.holdout_sources`).

At the final evaluation the model is scored on the holdout text (`ingest.holdout`) in
`holdout/bits_per_char`: the whole-word masked pseudo-log-likelihood of `evaluate.bpc`,
words chosen with `eval.seed` at `bpc.DEFAULT_RATE`, in fp32 on the run's device. The
metric does not depend on the tokenizer and the text does not move with the corpus, so
every model version's number is comparable with every other's on the same digest. The
text is written beside the evaluation (`holdout.json`: digest, sources, documents), so
the registry scores a champion on exactly the same text (`app.decide.on_holdout`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline.config import EvalConfig
from mlm_pipeline.evaluate.bpc import DEFAULT_RATE, bits_per_char
from mlm_pipeline.ingest.holdout import Holdout, text_digest
from mlm_pipeline.tokenizer import Tokenizer

#: The metric the registry decides on when a holdout is set (lower is better).
METRIC = "holdout/bits_per_char"
#: The file of the scored text in the evaluation's directory.
TEXT_FILE = "holdout.json"


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
        raise ValueError(f"{METRIC}: no word of the holdout text was chosen (seed "
                         f"{cfg.seed}); add text to eval.holdout_sources")
    return {METRIC: result.bits_per_char,
            "holdout/chars": float(sum(len(w) + 1 for d in documents for w in d.split())),
            "holdout/words_masked": float(result.words)}


def write_holdout_text(holdout: Holdout, out_dir: str | Path) -> dict[str, Any]:
    """Write `holdout.json` (digest, sources, documents) into `out_dir`; returns the
    evaluation manifest's record of it: `digest`, `sources`, `file`."""
    path = Path(out_dir) / TEXT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"digest": holdout.digest, "sources": list(holdout.sources),
                               "documents": list(holdout.documents)}, ensure_ascii=False),
                   encoding="utf-8")
    tmp.replace(path)
    return {"digest": holdout.digest, "sources": list(holdout.sources), "file": TEXT_FILE}


def read_holdout_text(out_dir: str | Path, digest: str) -> list[str]:
    """The scored documents `write_holdout_text` wrote into `out_dir`.

    Raises:
        FileNotFoundError: there is no `holdout.json`.
        ValueError: its documents do not have `digest` (the file changed).
    """
    path = Path(out_dir) / TEXT_FILE
    documents = json.loads(path.read_text(encoding="utf-8"))["documents"]
    if (got := text_digest(documents)) != digest:
        raise ValueError(f"{path}: the holdout text has digest {got}, the evaluation "
                         f"recorded {digest}")
    return documents
