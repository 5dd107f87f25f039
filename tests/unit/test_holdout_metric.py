"""`holdout/bits_per_char` of the holdout text read from files (`ingest.holdout`,
`evaluate.bpc.holdout_metrics`), checked against bits computed here from the model's own logits on
words that are one piece each."""

from __future__ import annotations

import math

from mlm_pipeline.config import EvalConfig, PipelineConfig
from mlm_pipeline.evaluate.bpc import holdout_metrics
from mlm_pipeline.ingest import read_holdout
from mlm_pipeline.tokenizer import Tokenizer
from tests.unit.test_bpc import _model, _single_piece_words, single_piece_bits


def test_holdout_bits_per_char_of_single_piece_words(tiny_tokenizer_manifest, tmp_path):
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    words = _single_piece_words(tok, 20)
    docs = [" ".join(words), " ".join(reversed(words))]
    (tmp_path / "bench.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    cfg = PipelineConfig.model_validate({"eval": {"holdout_sources": [str(tmp_path)]}})
    holdout = read_holdout(cfg)
    assert holdout.documents == tuple(docs)

    model = _model(tok.vocab_size)
    got = holdout_metrics(model, tok, holdout.documents, cfg.eval)

    # Independently, from the model's logits: the eval seed, 15 % of the words (the
    # share the bpc module documents), every chosen word's single piece masked.
    bits, chars, n = single_piece_bits(model, tok, docs, EvalConfig().seed, 0.15)
    assert 0 < n < 40
    assert got["holdout/words_masked"] == n
    assert got["holdout/chars"] == sum(len(w) + 1 for w in words) * 2
    assert math.isclose(got["holdout/bits_per_char"], bits / chars, rel_tol=1e-4)
