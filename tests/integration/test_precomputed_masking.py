"""Precomputed masking: `write_shards` with `masking.mode=precomputed`, and training on it.

The copies are checked against `mask_tokens` applied in the test to the unmasked rows, and
against the BERT masking invariants computed here from the rows themselves.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from mlm_pipeline.config import MaskingConfig, ShardConfig, TrainConfig
from mlm_pipeline.manifest import compute_digest
from mlm_pipeline.masking.keyed import MASKING_ALGORITHM, mask_tokens
from mlm_pipeline.masking.maskers import build_masker
from mlm_pipeline.shards.format import open_masked_shard, open_shard
from mlm_pipeline.shards.stage import shards_digest, write_shards
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import list_checkpoints, load_model_state
from mlm_pipeline.train.data import PrecomputedShardDataset

SEQ_LEN, DUPE, SEED, VOCAB = 64, 5, 11, 128
MASK, NUM_SPECIAL = 4, 5
SHARD_CFG = ShardConfig(seq_len=SEQ_LEN, rows_per_shard=16, encode_batch_size=4)
MASKING = MaskingConfig(mode="precomputed", dupe_factor=DUPE, seed=SEED)


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest):
    work = tmp_path_factory.mktemp("precomputed")
    return write_shards(SHARD_CFG, tiny_corpus_manifest, tiny_tokenizer_manifest, work,
                        MASKING)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory, tiny_corpus_manifest, tiny_tokenizer_manifest):
    work = tmp_path_factory.mktemp("dynamic")
    return write_shards(SHARD_CFG, tiny_corpus_manifest, tiny_tokenizer_manifest, work)


def _rows(m, names) -> np.ndarray:
    return np.concatenate([open_shard(m.file(n)) for n in names]).astype(np.int64)


def _unmasked_names(m, split="train"):
    return [e.path for e in getattr(m, split).shards if "copy" not in e.path]


def _copy(m, c) -> tuple[np.ndarray, np.ndarray]:
    n = len(_unmasked_names(m))
    parts = [open_masked_shard(m.file(f"train-copy{c}-{i:05d}.arrow")) for i in range(n)]
    return (np.concatenate([p[0] for p in parts]).astype(np.int64),
            np.concatenate([p[1] for p in parts]).astype(np.int64))


def test_layout_names_schema_and_unmasked_rows(precomputed, dynamic):
    m = precomputed
    base = _unmasked_names(m)
    assert base == [f"train-{i:05d}.arrow" for i in range(len(base))] and len(base) > 1
    copies = [f"train-copy{c}-{i:05d}.arrow" for c in range(DUPE) for i in range(len(base))]
    assert [e.path for e in m.train.shards] == base + copies
    # rows per copy, and every copy shard has the rows of its unmasked shard
    assert m.train.rows == dynamic.train.rows
    rows_of = {e.path: e.rows for e in m.train.shards}
    for c in range(DUPE):
        for i, name in enumerate(base):
            assert rows_of[f"train-copy{c}-{i:05d}.arrow"] == rows_of[name]
    path = m.file(copies[0])
    with pa.memory_map(str(path)) as source:
        schema = ipc.open_file(source).schema
    assert schema.names == ["input_ids", "labels"]
    assert schema.field("input_ids").type == pa.list_(pa.uint16(), SEQ_LEN)
    assert schema.field("labels").type == pa.list_(pa.int32(), SEQ_LEN)
    # unmasked train rows and the validation split are those of dynamic mode
    np.testing.assert_array_equal(_rows(m, base), _rows(dynamic, _unmasked_names(dynamic)))
    assert [e.path for e in m.validation.shards] == [e.path for e in dynamic.validation.shards]
    for a, b in zip(m.validation.shards, dynamic.validation.shards):
        assert a.sha256 == b.sha256
    assert m.config["masking"] == MASKING.masks_record()
    assert m.config["masking_seed"] == SEED
    assert m.digest != dynamic.digest


def test_copies_equal_mask_tokens_of_the_unmasked_rows(precomputed):
    original = torch.from_numpy(_rows(precomputed, _unmasked_names(precomputed)))
    rows = torch.arange(len(original))
    for c in range(DUPE):
        want_ids, want_labels = mask_tokens(
            original, vocab_size=VOCAB, row_index=rows, seed=SEED, epoch=c,
            mlm_probability=0.15, mask_replace_prob=0.8, random_replace_prob=0.1,
        )
        ids, labels = _copy(precomputed, c)
        np.testing.assert_array_equal(ids, want_ids.numpy(), err_msg=f"copy {c}")
        np.testing.assert_array_equal(labels, want_labels.numpy(), err_msg=f"copy {c}")


def test_copies_obey_the_masking_invariants(precomputed):
    original = _rows(precomputed, _unmasked_names(precomputed))
    special = original < NUM_SPECIAL
    selected_total = maskable_total = n_mask = n_random = n_same = 0
    for c in range(DUPE):
        ids, labels = _copy(precomputed, c)
        selected = labels != -100
        assert not (selected & special).any(), "a special token was selected"
        np.testing.assert_array_equal(labels[selected], original[selected])
        np.testing.assert_array_equal(ids[~selected], original[~selected])
        replaced = ids[selected]
        assert ((replaced == MASK) | (replaced >= NUM_SPECIAL)).all()
        assert (replaced < VOCAB).all()
        selected_total += int(selected.sum())
        maskable_total += int((~special).sum())
        n_mask += int((replaced == MASK).sum())
        same = replaced == original[selected]
        n_same += int(same.sum())
        n_random += int(((replaced != MASK) & ~same).sum())
    assert selected_total >= 2000
    # binomial standard deviations: selection ~0.002, shares <= ~0.008; tolerances >= 4 sd
    assert abs(selected_total / maskable_total - 0.15) < 0.015
    p_same_random = 0.1 / (VOCAB - NUM_SPECIAL)  # a random id may equal the original
    assert abs(n_mask / selected_total - 0.8) < 0.035
    assert abs(n_random / selected_total - (0.1 - p_same_random)) < 0.025
    assert abs(n_same / selected_total - (0.1 + p_same_random)) < 0.025


def test_each_row_gets_dupe_factor_distinct_maskings(precomputed):
    copies = [_copy(precomputed, c) for c in range(DUPE)]
    for r in range(precomputed.train.rows):
        seen = {(ids[r].tobytes(), labels[r].tobytes()) for ids, labels in copies}
        assert len(seen) == DUPE, f"row {r}"


def test_digest_depends_on_masking_only_when_precomputed(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_shard_manifest
):
    args = (tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest)
    old = shards_digest(*args)
    assert old == tiny_shard_manifest.digest
    assert shards_digest(*args, MaskingConfig(dupe_factor=3, seed=99)) == old
    pre = shards_digest(*args, MASKING)
    assert pre != old
    assert shards_digest(*args, MASKING.model_copy(update={"seed": SEED + 1})) != pre
    assert shards_digest(*args, MASKING.model_copy(update={"dupe_factor": 2})) != pre


def test_digest_unchanged_by_the_seed_moving_into_the_masking_config(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest
):
    """Before the move, `shards_digest(cfg, corpus, tok, masking, seed)` hashed the masking
    config without a seed field and the training seed beside it: the same value now."""
    masking_then = {k: v for k, v in MASKING.model_dump(mode="json").items() if k != "seed"}
    shard_cfg = tiny_shard_config.model_dump(
        mode="json", exclude={"num_threads", "encode_batch_size", "encode_batch_bytes"})
    then = compute_digest(
        "shards",
        {"shards": shard_cfg, "masking": masking_then, "seed": SEED,
         "masking_algorithm": MASKING_ALGORITHM},
        {"corpus": tiny_corpus_manifest.digest, "tokenizer": tiny_tokenizer_manifest.digest,
         "tokenizer_model": tiny_tokenizer_manifest.model.sha256},
    )
    assert shards_digest(tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest,
                         MASKING) == then


def test_digest_ignores_scheduling_settings(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest
):
    inputs = (tiny_corpus_manifest, tiny_tokenizer_manifest)
    base = shards_digest(tiny_shard_config, *inputs)
    for update in ({"num_threads": 3}, {"encode_batch_size": 7},
                   {"encode_batch_bytes": 100}):
        assert shards_digest(tiny_shard_config.model_copy(update=update), *inputs) == base
        assert shards_digest(tiny_shard_config.model_copy(update=update), *inputs,
                             MASKING) == shards_digest(tiny_shard_config, *inputs, MASKING)
    for update in ({"seq_len": 32}, {"rows_per_shard": 65}):
        assert shards_digest(tiny_shard_config.model_copy(update=update), *inputs) != base


def test_cached_rerun_does_not_rewrite(precomputed, tiny_corpus_manifest,
                                       tiny_tokenizer_manifest):
    files = [precomputed.file(e.path) for e in precomputed.train.shards]
    before = [f.stat().st_mtime_ns for f in files]
    work = precomputed.file("").parent.parent
    again = write_shards(SHARD_CFG, tiny_corpus_manifest, tiny_tokenizer_manifest, work,
                         MASKING)
    assert again == precomputed
    assert [f.stat().st_mtime_ns for f in files] == before


def test_dataset_cycles_copies_by_epoch(precomputed):
    ds = PrecomputedShardDataset(precomputed)
    assert len(ds) == precomputed.train.rows and ds.dupe_factor == DUPE
    idx = np.array([len(ds) - 1, 0, 17, 33])  # crosses shard boundaries, unsorted
    for epoch in (0, 3, DUPE + 1):
        ids, labels = ds.get(idx, epoch)
        want_ids, want_labels = _copy(precomputed, epoch % DUPE)
        np.testing.assert_array_equal(ids.numpy(), want_ids[idx])
        np.testing.assert_array_equal(labels.numpy(), want_labels[idx])
    with pytest.raises(IndexError):
        ds.get([len(ds)], 0)


def _sections(model_cfg, masking=MASKING, **train_kw):
    """The `train`, `model` and `masking` sections `train()` takes, in its order."""
    kw = {"micro_batch_size": 16, "max_steps": 5, "warmup_steps": 2, "log_every": 1,
          "lr": 1e-3, "seed": SEED, **train_kw}
    return TrainConfig(**kw), model_cfg, masking


def _losses(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines]


def test_masker_mismatch_is_an_error(precomputed, dynamic):
    with pytest.raises(ValueError, match="no precomputed masked copies"):
        one = MaskingConfig(mode="precomputed", dupe_factor=1)
        fake = dynamic.model_copy(update={"config": {
            **dynamic.config, "masking": one.masks_record(),
            "masking_seed": 0, "masking_algorithm": MASKING_ALGORITHM}})
        build_masker(one, VOCAB, fake, copies=PrecomputedShardDataset(fake))
    copies = PrecomputedShardDataset(precomputed)
    with pytest.raises(ValueError, match="were written with"):
        build_masker(MASKING.model_copy(update={"seed": SEED + 1}), VOCAB, precomputed,
                     copies=copies)
    with pytest.raises(ValueError, match="were written with"):
        build_masker(MASKING.model_copy(update={"dupe_factor": 2}), VOCAB, precomputed,
                     copies=copies)
    with pytest.raises(ValueError, match="were written with"):
        build_masker(MASKING, VOCAB, dynamic, copies=copies)
    # copies made by an earlier version of the hash are refused
    stale = precomputed.model_copy(update={"config": {
        **precomputed.config, "masking_algorithm": MASKING_ALGORITHM - 1}})
    with pytest.raises(ValueError, match="were written with"):
        build_masker(MASKING, VOCAB, stale, copies=copies)


def test_training_five_steps_and_exact_resume(tmp_path, tiny_model_config, precomputed,
                                              tiny_tokenizer_manifest):
    m = train(*_sections(tiny_model_config), precomputed, tiny_tokenizer_manifest,
              tmp_path / "five")
    assert m.steps == 5 and len(_losses(m)) == 5
    assert all(np.isfinite(_losses(m)))

    # 16-row batches: 4 per epoch, so 6 steps read copies 0 and 1
    model_cfg = tiny_model_config.model_copy(update={"dropout": 0.1})
    straight = train(*_sections(model_cfg, max_steps=6), precomputed,
                     tiny_tokenizer_manifest, tmp_path / "straight")
    sections = _sections(model_cfg, max_steps=6, checkpoint_every=3)
    first = train(*sections, precomputed, tiny_tokenizer_manifest, tmp_path / "resumed")
    ckpts = list_checkpoints(first.file("checkpoints"))
    assert [c.name for c in ckpts] == ["step-00000003", "step-00000006"]
    shutil.rmtree(ckpts[-1])
    first.path.unlink()
    resumed = train(*sections, precomputed, tiny_tokenizer_manifest, tmp_path / "resumed")
    assert resumed.steps == 6 and resumed.final_metrics["train/epoch"] == 1.0
    a = load_model_state(straight.file(straight.checkpoint_dir))
    b = load_model_state(resumed.file(resumed.checkpoint_dir))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert _losses(straight) == _losses(resumed)


def test_precomputed_training_equals_dynamic_while_copies_last(
    tmp_path, tiny_model_config, precomputed, dynamic, tiny_tokenizer_manifest
):
    # dupe_factor > epochs trained: each copy is the dynamic mask of its epoch, so the two
    # modes train identically (same rows, same masks, same initialization)
    pre = train(*_sections(tiny_model_config, max_steps=6), precomputed,
                tiny_tokenizer_manifest, tmp_path / "pre")
    dyn_masking = MASKING.model_copy(update={"mode": "dynamic"})
    dyn = train(*_sections(tiny_model_config, masking=dyn_masking, max_steps=6), dynamic,
                tiny_tokenizer_manifest, tmp_path / "dyn")
    assert _losses(pre) == _losses(dyn)
