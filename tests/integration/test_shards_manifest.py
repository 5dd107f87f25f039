"""Precomputed copies in the shard manifest (`masked_copies`, `masking`), `split_shards` on
new and old manifests, and copies made with exact-k and whole-word selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlm_pipeline.config import MaskingConfig, ShardConfig
from mlm_pipeline.masking.keyed import MASKING_ALGORITHM, mask_tokens
from mlm_pipeline.shards.format import (
    masked_copies,
    open_masked_shard,
    open_shard,
    split_shards,
)
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer

SEQ_LEN, DUPE, SEED, NUM_SPECIAL = 32, 2, 5, 5
SHARD_CFG = ShardConfig(seq_len=SEQ_LEN, rows_per_shard=40, encode_batch_size=8)


def _write(tmp_path_factory, corpus, tokenizer, masking):
    if masking is not None:
        masking = masking.model_copy(update={"seed": SEED})
    return write_shards(SHARD_CFG, corpus, tokenizer, tmp_path_factory.mktemp("m"), masking)


@pytest.fixture(scope="module")
def exact_words(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest):
    masking = MaskingConfig(mode="precomputed", dupe_factor=DUPE, selection="exact_k",
                            whole_word=True)
    return masking, _write(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest,
                           masking)


def test_manifest_records_copies_and_masking(exact_words):
    masking, m = exact_words
    assert m.train.masked_copies == DUPE and m.validation.masked_copies == 0
    assert m.masking == {**masking.masks_record(), "seed": SEED,
                         "algorithm": MASKING_ALGORITHM}
    assert m.masking["selection"] == "exact_k" and m.masking["whole_word"] is True
    # the keys maskers.build_masker compares stay where they were
    assert m.config["masking"] == masking.masks_record()
    assert m.config["masking_seed"] == SEED
    n = len([e for e in m.train.shards if "copy" not in e.path])
    assert len(m.train.shards) == n * (DUPE + 1) and n > 1


def test_dynamic_manifest_has_no_copies(tiny_shard_manifest):
    assert tiny_shard_manifest.train.masked_copies == 0 and tiny_shard_manifest.masking is None
    assert masked_copies(tiny_shard_manifest) == 0
    assert split_shards(tiny_shard_manifest, "train") == tiny_shard_manifest.train.shards
    assert split_shards(tiny_shard_manifest, "train", copy=0) == []


def test_split_shards_uses_the_field_and_reads_old_manifests(exact_words):
    _, m = exact_words
    names = [e.path for e in m.train.shards]
    n = len(names) // (DUPE + 1)
    base = [f"train-{i:05d}.arrow" for i in range(n)]
    want = {None: base, **{c: [f"train-copy{c}-{i:05d}.arrow" for i in range(n)]
                           for c in range(DUPE)}}
    # a manifest written before `masked_copies` existed: the field is 0, names tell
    old = m.model_copy(update={"train": m.train.model_copy(update={"masked_copies": 0}),
                               "masking": None})
    for manifest in (m, old):
        assert masked_copies(manifest) == DUPE
        for copy, expected in want.items():
            assert [e.path for e in split_shards(manifest, "train", copy)] == expected
        assert split_shards(manifest, "train", DUPE) == []
        assert split_shards(manifest, "validation") == m.validation.shards
    # the field, not the names, decides: a manifest whose copies were renamed
    renamed = m.model_copy(update={"train": m.train.model_copy(update={"shards": [
        e.model_copy(update={"path": f"part-{i:05d}.arrow"}) for i, e in enumerate(m.train.shards)
    ]})})
    assert masked_copies(renamed) == DUPE
    assert [e.path for e in split_shards(renamed, "train", 1)] == [
        f"part-{i:05d}.arrow" for i in range(2 * n, 3 * n)]
    broken = m.model_copy(update={"train": m.train.model_copy(
        update={"shards": m.train.shards[:-1]})})
    with pytest.raises(ValueError, match="do not split"):
        split_shards(broken, "train")


def _rows(m, entries) -> np.ndarray:
    return np.concatenate([open_shard(m.file(e.path)) for e in entries]).astype(np.int64)


def _copy(m, c) -> tuple[np.ndarray, np.ndarray]:
    parts = [open_masked_shard(m.file(e.path)) for e in split_shards(m, "train", c)]
    return (np.concatenate([p[0] for p in parts]).astype(np.int64),
            np.concatenate([p[1] for p in parts]).astype(np.int64))


def test_exact_k_whole_word_copies_follow_the_config(exact_words, tiny_tokenizer_manifest):
    masking, m = exact_words
    starts = Tokenizer.load(tiny_tokenizer_manifest).word_starts()
    original = _rows(m, split_shards(m, "train"))
    special = original < NUM_SPECIAL
    for c in range(DUPE):
        ids, labels = _copy(m, c)
        selected = labels != -100
        np.testing.assert_array_equal(labels[selected], original[selected])
        assert not (selected & special).any()
        # exact_k: at most k = floor(0.15 * n + 0.5) tokens per row (n maskable tokens)
        k = np.floor(0.15 * (~special).sum(1) + 0.5)
        assert (selected.sum(1) <= k).all() and selected.sum() > 0
        # whole words: a selected continuation piece's predecessor is selected too
        cont = ~starts[original] & ~special
        cont[:, 0] = False
        cont[:, 1:] &= ~special[:, :-1]
        assert not (selected[:, 1:] & cont[:, 1:] & ~selected[:, :-1]).any()
        # and a selected word start takes its continuation pieces with it
        assert not (selected[:, :-1] & cont[:, 1:] & ~selected[:, 1:]).any()
        want_ids, want_labels = mask_tokens(
            torch.from_numpy(original), vocab_size=m.vocab_size,
            row_index=torch.arange(len(original)), seed=SEED, epoch=c,
            selection="exact_k", word_starts=torch.from_numpy(starts),
        )
        np.testing.assert_array_equal(ids, want_ids.numpy())
        np.testing.assert_array_equal(labels, want_labels.numpy())


def test_exact_k_copies_select_exactly_k(tmp_path_factory, tiny_corpus_manifest,
                                         tiny_tokenizer_manifest):
    masking = MaskingConfig(mode="precomputed", dupe_factor=1, selection="exact_k")
    m = _write(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest, masking)
    original = _rows(m, split_shards(m, "train"))
    _, labels = _copy(m, 0)
    n = (original >= NUM_SPECIAL).sum(1)
    np.testing.assert_array_equal((labels != -100).sum(1), np.floor(0.15 * n + 0.5))


def test_shards_follow_the_tokenizer_model_bytes(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest
):
    # A tokenizer retrained under the same digest (its model file replaced) must not reuse
    # shards that another model encoded: the model's sha256 is part of their identity.
    from mlm_pipeline.manifest import sha256_file
    from mlm_pipeline.shards.stage import shards_digest

    tok = tiny_tokenizer_manifest
    assert tiny_shard_manifest.inputs["tokenizer_model"] == sha256_file(tok.file(tok.model.path))
    other = tok.model_copy(update={"model": tok.model.model_copy(update={"sha256": "0" * 64})})
    assert other.digest == tok.digest
    assert shards_digest(tiny_shard_config, tiny_corpus_manifest, other) != shards_digest(
        tiny_shard_config, tiny_corpus_manifest, tok)
    assert shards_digest(tiny_shard_config, tiny_corpus_manifest, tok) == tiny_shard_manifest.digest
