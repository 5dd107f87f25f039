"""`train_tokenizer` on tmp_path: outputs, caching, train-only data and size errors."""

from __future__ import annotations

import hashlib
import re

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import SPECIAL_TOKENS, TokenizerConfig
from mlm_pipeline.manifest import sha256_file, stage_dir
from mlm_pipeline.tokenizer.stage import (
    STAGE,
    Tokenizer,
    tokenizer_digest,
    train_tokenizer,
)


def _train_lines(corpus) -> list[str]:
    """Non-blank lines of the training documents, read independently of the module."""
    lines = []
    for entry in corpus.train:
        for text in pq.read_table(corpus.file(entry.path)).column("text").to_pylist():
            lines += [line for line in text.split("\n") if line.strip()]
    return lines


def test_manifest_describes_the_model(tiny_tokenizer_manifest, tiny_corpus_manifest):
    m = tiny_tokenizer_manifest
    assert m.vocab_size == 128 and m.model_type == "unigram"
    assert m.special_tokens == SPECIAL_TOKENS
    assert m.inputs == {"corpus": tiny_corpus_manifest.digest}
    assert m.training_sentences == len(_train_lines(tiny_corpus_manifest))
    for entry in (m.model, m.vocab):
        path = m.file(entry.path)
        assert path.parent == m.path.parent
        assert sha256_file(path) == entry.sha256 and path.stat().st_size == entry.bytes
    vocab_lines = m.file(m.vocab.path).read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 128
    assert [line.split("\t")[0] for line in vocab_lines[:5]] == list(SPECIAL_TOKENS)


def test_cached_rerun_returns_same_manifest(
    tiny_tokenizer_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
):
    model = tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path)
    before = model.stat().st_mtime_ns
    again = train_tokenizer(tiny_tokenizer_config, tiny_corpus_manifest, tiny_work_dir)
    assert again == tiny_tokenizer_manifest
    assert model.stat().st_mtime_ns == before


def test_trains_on_training_split_only(tmp_path, make_corpus_manifest, tiny_paragraphs):
    # Paragraph 9 goes to validation: give it a character that appears nowhere else.
    paragraphs = list(tiny_paragraphs[:10])
    paragraphs[9] = "жжж жжжж ж " * 20
    corpus = make_corpus_manifest(tmp_path / "corpus", paragraphs)
    m = train_tokenizer(
        TokenizerConfig(vocab_size=100, character_coverage=1.0), corpus, tmp_path / "work"
    )
    sp = spm.SentencePieceProcessor(model_file=str(m.file(m.model.path)))
    assert sp.piece_to_id("ж") == sp.unk_id() == 1
    assert sp.piece_to_id("é") >= 5  # a training character is in the vocabulary


def test_bpe_model_has_fixed_special_ids(tiny_corpus_manifest, tmp_path):
    m = train_tokenizer(
        TokenizerConfig(model_type="bpe", vocab_size=150), tiny_corpus_manifest, tmp_path
    )
    tok = Tokenizer.load(m)
    assert m.model_type == "bpe" and tok.vocab_size == m.vocab_size == 150
    assert [tok.id_to_piece(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert 4 not in tok.encode(["du [MASK] ici"])[0]


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_impossible_vocab_size_fails_before_any_shard(
    model_type, tiny_corpus_manifest, tmp_path
):
    cfg = TokenizerConfig(model_type=model_type, vocab_size=50000)
    with pytest.raises(ValueError) as info:
        train_tokenizer(cfg, tiny_corpus_manifest, tmp_path)
    msg = str(info.value)
    found = re.search(r"vocab_size=50000 .* at most (\d+) pieces from (\d+) training", msg)
    assert found, msg
    assert model_type in msg
    assert 128 < int(found.group(1)) < 50000
    assert int(found.group(2)) == len(_train_lines(tiny_corpus_manifest))
    assert not (tmp_path / "shards").exists()
    assert not any((tmp_path / "tokenizer").iterdir())  # no half-written stage dir


def test_bpe_reported_maximum_is_trainable(tiny_corpus_manifest, tmp_path):
    with pytest.raises(ValueError) as info:
        train_tokenizer(
            TokenizerConfig(model_type="bpe", vocab_size=50000), tiny_corpus_manifest, tmp_path
        )
    supported = int(re.search(r"at most (\d+) pieces", str(info.value)).group(1))
    m = train_tokenizer(
        TokenizerConfig(model_type="bpe", vocab_size=supported), tiny_corpus_manifest, tmp_path
    )
    assert m.vocab_size == supported


def test_too_small_vocab_names_the_minimum(tiny_corpus_manifest, tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=10 .* at least \d+ pieces"):
        train_tokenizer(TokenizerConfig(vocab_size=10), tiny_corpus_manifest, tmp_path)


def _sentences(paragraphs: list[str]) -> list[str]:
    """Documents of one sentence per line: enough lines to sample from."""
    return ["\n".join(x.strip() + "." for x in p.split(". ") if x.strip()) for p in paragraphs]


def test_sampled_training_is_deterministic(
    tmp_path, make_corpus_manifest, tiny_paragraphs, reservoir_sample
):
    corpus = make_corpus_manifest(tmp_path / "c", _sentences(tiny_paragraphs))
    lines = _train_lines(corpus)
    k = len(lines) // 3
    cfg = TokenizerConfig(vocab_size=100, input_sentence_size=k)
    first = train_tokenizer(cfg, corpus, tmp_path / "a")
    second = train_tokenizer(cfg, corpus, tmp_path / "b")
    # Two trainings of the same config and corpus give the same model, byte for byte.
    assert first.model.sha256 == second.model.sha256
    assert (first.training_sentences, first.sampled_from) == (k, len(lines))
    want = "".join(x + "\n" for x in reservoir_sample(lines, k, seed=1)).encode("utf-8")
    assert first.sample_digest == hashlib.sha256(want).hexdigest()


def test_unsampled_training_reads_every_line(tiny_tokenizer_manifest, tiny_corpus_manifest):
    n = len(_train_lines(tiny_corpus_manifest))
    assert tiny_tokenizer_manifest.sampled_from == tiny_tokenizer_manifest.training_sentences == n


def test_rerun_removes_a_killed_runs_temporary_files(tmp_path, tiny_corpus_manifest):
    cfg = TokenizerConfig(vocab_size=128)
    out_dir = stage_dir(tmp_path, STAGE, tokenizer_digest(cfg, tiny_corpus_manifest))
    stale = out_dir / ".tmp-killed"
    stale.mkdir(parents=True)
    (stale / "train.txt").write_text("left by SIGKILL\n")
    m = train_tokenizer(cfg, tiny_corpus_manifest, tmp_path)
    assert not stale.exists()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        [m.model.path, m.vocab.path, "manifest.json"])
