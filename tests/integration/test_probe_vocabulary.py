"""The default corpus can answer its domain probes (needs the Debian apt archive: slow).

A fill-mask probe has an accuracy only if its expected answer is a token the model can
predict: a single word-start piece (`▁paquet`) of the vocabulary. The guide's sentences fail
that on the default corpus (`banque`, `chat`, `poil`, `pelage`, `fourrure` are split or
`[UNK]` in the 8k vocabulary trained on software documentation), so the default probes add
held-out sentences from the corpus's own domain. This test rebuilds exactly what the `tiny`
config trains (ingest of `debian:fr`, unigram 8000) and checks, for each domain probe, that
every answer is one word-start piece of that vocabulary, that it stays one piece when the
tokenizer encodes the completed sentence, that it is a frequent word of the training text,
and that the completed sentence does not occur in the ingested text (train or validation).
The two stages run once per session (`debian_tiny_data`, shared with other slow tests). The
`full` tier: CI runs it in one slice of the landings, every one with CI_FULL=1.
"""

from __future__ import annotations

import re
from collections import Counter

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import EvalConfig, FillMaskProbe
from mlm_pipeline.config.evaluation import DOMAIN_PROBES, GUIDE_PROBES
from mlm_pipeline.config_files import load_config

pytestmark = [pytest.mark.slow, pytest.mark.full]

MIN_COUNT = 200  # occurrences in the training text for "a frequent word of the domain"


def probes_under_test() -> list[FillMaskProbe]:
    """Every default probe that is not one of the guide's (the domain probes: each answer
    occurred at least 200 times in the tiny run's training text when they were written,
    debian:fr of Debian 12: `noyau` 229 ... `document` 4,052)."""
    guide = {p.text for p in GUIDE_PROBES}
    probes = [p for p in EvalConfig().probes if p.text not in guide]
    assert {p.text for p in DOMAIN_PROBES} <= {p.text for p in probes}
    return probes


def squash(text: str) -> str:
    """Lower case, whitespace runs as one space (so line breaks do not hide a match)."""
    return re.sub(r"\s+", " ", text).lower()


@pytest.fixture(scope="module")
def tiny_vocabulary(debian_tiny_data):
    """(SentencePiece processor, squashed ingested text, training-text word counts) of
    the `tiny` config's ingest and tokenizer stages, run for real."""
    assert load_config("tiny").ingest.sources == ["debian:fr"]  # the default corpus is checked
    _, corpus, tok = debian_tiny_data
    assert tok.config["vocab_size"] == 8000 and corpus.config["sources"] == ["debian:fr"]
    sp = spm.SentencePieceProcessor(model_file=str(tok.file(tok.model.path)))

    def texts(entries):
        return [t for e in entries
                for t in pq.read_table(corpus.file(e.path), columns=["text"])["text"].to_pylist()]

    train = texts(corpus.train)
    counts = Counter(re.findall(r"\w+", "\n".join(train).lower()))
    return sp, squash("\n".join(train + texts(corpus.validation))), counts


@pytest.mark.parametrize("probe", probes_under_test(), ids=lambda p: p.answers[0])
def test_domain_probe_is_answerable_and_held_out(tiny_vocabulary, probe):
    sp, text, counts = tiny_vocabulary
    assert probe.text.count("[MASK]") == 1 and probe.answers
    before, after = probe.text.split("[MASK]")
    for answer in probe.answers:
        piece = "\u2581" + answer
        assert sp.piece_to_id(piece) != sp.unk_id(), f"{piece!r} is not in the vocabulary"
        completed = before + answer + after
        assert piece in sp.encode(completed, out_type=str), (
            f"{answer!r} is split when encoding {completed!r}")
        assert counts[answer] >= MIN_COUNT, (answer, counts[answer])
        assert squash(completed) not in text, f"{completed!r} occurs in the corpus"
