"""Scoring fill-mask probes against their expected answers, and their table rows.

A probe (`config.FillMaskProbe`) is a sentence with one `[MASK]` and the words accepted
there. `fill_mask` (evaluate.stage) gives the top-k pieces at each mask; a probe is a hit
at rank k when one of its first k pieces, without SentencePiece's word-start marker "▁"
and case-folded, equals one of its answers. `unreachable_answers` finds answers that can
never be hit because they are not one in-vocabulary piece: the guide's "chat"/"poil" sentences
on a vocabulary trained on software documentation, for instance.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

from mlm_pipeline.config import FillMaskProbe
from mlm_pipeline.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: SentencePiece's word-start marker (U+2581), which begins every piece that starts a word.
WORD_START = "\u2581"


def piece_word(piece: str) -> str:
    """The word a piece spells: without the word-start marker, NFC, case-folded."""
    return unicodedata.normalize("NFC", piece.removeprefix(WORD_START)).casefold()


def _answer_set(probe: FillMaskProbe) -> set[str]:
    return {unicodedata.normalize("NFC", a.strip()).casefold() for a in probe.answers}


def unreachable_answers(tokenizer: Tokenizer, probes: list[FillMaskProbe]
                        ) -> list[tuple[str, str, str]]:
    """The expected answers that are not a single in-vocabulary piece.

    A fill-mask probe predicts one piece per `[MASK]`, so an answer that the tokenizer
    splits into several pieces, or maps to `[UNK]`, can never be a hit.

    Returns:
        `(probe text, answer, the pieces it encodes to)` per such answer, in probe order
        (empty when every answer is one piece).
    """
    found = []
    for probe in probes:
        for answer in probe.answers:
            ids = tokenizer.encode([answer])[0]
            if len(ids) == 1 and ids[0] != tokenizer.unk_id:
                continue
            pieces = " ".join(tokenizer.id_to_piece(i) for i in ids)
            found.append((probe.text, answer, pieces or "nothing"))
    return found


def answer_problems(tokenizer: Tokenizer, probes: list[FillMaskProbe]) -> list[str]:
    """One message per expected answer that is not a single in-vocabulary piece
    (`unreachable_answers`), naming the probe, the answer and its pieces."""
    return [f"fill-mask probe {text!r}: expected answer {answer!r} is not one in-vocabulary "
            f"token (it encodes to {pieces}), so it can never be a hit"
            for text, answer, pieces in unreachable_answers(tokenizer, probes)]


#: The unreachable-answer sets already warned about in this process (the periodic and the
#: final evaluation of one run check the same probes: the warning is said once).
_WARNED: set[tuple[tuple[str, str, str], ...]] = set()


def warn_answer_problems(tokenizer: Tokenizer, probes: list[FillMaskProbe]) -> int:
    """Log one warning line summing up `unreachable_answers` (once per process for a
    given set; the details go to the debug log); returns how many answers there were."""
    found = tuple(unreachable_answers(tokenizer, probes))
    if found and found not in _WARNED:
        _WARNED.add(found)
        texts = {text for text, _, _ in found}
        logger.warning(
            "fill-mask probes: %d expected answer(s) of %d probe(s) are not one token of the "
            "vocabulary and can never be hit: %s (a larger vocabulary or probes from the "
            "corpus's domain fix it)", len(found), len(texts),
            ", ".join(f"{answer!r} ({pieces})" for _, answer, pieces in found))
        for message in answer_problems(tokenizer, probes):
            logger.debug("%s", message)
    return len(found)


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
                token = candidate["token"]
                rows.append({"step": step, "sentence": probe.text, "mask": mask, "rank": rank,
                             "token": token, "probability": candidate["probability"],
                             "expected": ", ".join(probe.answers),
                             "hit": piece_word(token) in answers})
    return rows
