"""Scoring fill-mask probes against their expected answers, and their table rows.

A probe (`config.FillMaskProbe`) is a sentence with one `[MASK]` and the words accepted
there. `fill_mask` (evaluate.stage) gives the top-k pieces at each mask; a probe is a hit
at rank k when one of its first k pieces, without SentencePiece's word-start marker "▁"
and case-folded, equals one of its answers. `answer_problems` finds answers that can never
be hit because they are not one in-vocabulary piece: the guide's "chat"/"poil" sentences
on a vocabulary trained on software documentation, for instance.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

from mlm_pipeline.config import UNK_ID, FillMaskProbe
from mlm_pipeline.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: SentencePiece's word-start marker (U+2581), which begins every piece that starts a word.
WORD_START = "\u2581"


def piece_word(piece: str) -> str:
    """The word a piece spells: without the word-start marker, NFC, case-folded."""
    return unicodedata.normalize("NFC", piece.removeprefix(WORD_START)).casefold()


def _answer_set(probe: FillMaskProbe) -> set[str]:
    return {unicodedata.normalize("NFC", a.strip()).casefold() for a in probe.answers}


def answer_problems(tokenizer: Tokenizer, probes: list[FillMaskProbe]) -> list[str]:
    """One message per expected answer that is not a single in-vocabulary piece.

    A fill-mask probe predicts one piece per `[MASK]`, so an answer that the tokenizer
    splits into several pieces, or maps to `[UNK]`, can never be a hit.

    Returns:
        Messages naming the probe, the answer and the pieces it encodes to (empty when
        every answer is one piece).
    """
    problems = []
    for probe in probes:
        for answer in probe.answers:
            ids = tokenizer.encode([answer])[0]
            if len(ids) == 1 and ids[0] != UNK_ID:
                continue
            pieces = " ".join(tokenizer.id_to_piece(i) for i in ids)
            problems.append(
                f"fill-mask probe {probe.text!r}: expected answer {answer!r} is not one "
                f"in-vocabulary token (it encodes to {pieces or 'nothing'}), so the probe "
                "can never be answered; choose a probe whose answer the corpus holds, or a "
                "larger vocabulary"
            )
    return problems


def warn_answer_problems(tokenizer: Tokenizer, probes: list[FillMaskProbe]) -> int:
    """Log each of `answer_problems` as a warning; returns how many there were."""
    problems = answer_problems(tokenizer, probes)
    for message in problems:
        logger.warning("%s", message)
    return len(problems)


def probe_metrics(results: list[dict[str, Any]], probes: list[FillMaskProbe],
                  top_k: int) -> dict[str, float]:
    """Accuracy of the probes that have answers, at their first mask.

    Args:
        results: `fill_mask` results, one per probe in the same order (a result with an
            `error` counts as a miss).
        probes: the probes (their `answers`).
        top_k: candidates per mask in `results`.

    Returns:
        `eval/probe_accuracy` (top-1 hit rate) and `eval/probe_top{k}_accuracy` over the
        probes that have answers; empty when none has.
    """
    answered = [(r, _answer_set(p)) for r, p in zip(results, probes, strict=True) if p.answers]
    if not answered:
        return {}
    top1 = topk = 0
    for result, answers in answered:
        if "error" in result or not result["predictions"]:
            continue
        words = [piece_word(c["token"]) for c in result["predictions"][0]]
        top1 += bool(words) and words[0] in answers
        topk += any(w in answers for w in words)
    return {"eval/probe_accuracy": top1 / len(answered),
            f"eval/probe_top{top_k}_accuracy": topk / len(answered)}


def table_rows(results: list[dict[str, Any]], probes: list[FillMaskProbe],
               step: int) -> list[dict[str, Any]]:
    """Rows of the fill-mask table (`mlflow.log_table`): one per step, sentence, mask and
    rank, with the token, its probability in (0, 1], the expected answers and whether the
    token is one of them. Probes that could not run give no row."""
    rows = []
    for result, probe in zip(results, probes, strict=True):
        if "error" in result:
            continue
        answers = _answer_set(probe)
        for mask, candidates in enumerate(result["predictions"]):
            for rank, candidate in enumerate(candidates, 1):
                rows.append({
                    "step": step, "sentence": probe.text, "mask": mask, "rank": rank,
                    "token": candidate["token"], "probability": candidate["probability"],
                    "expected": ", ".join(probe.answers),
                    "hit": piece_word(candidate["token"]) in answers,
                })
    return rows
