"""Five training steps, exact resume, token-weighted gradient accumulation."""

import json
import shutil

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, PipelineConfig, TrainConfig
from mlm_pipeline.masking.maskers import build_masker
from mlm_pipeline.train import BertMLM, train
from mlm_pipeline.train.checkpoint import list_checkpoints, load_model_state
from mlm_pipeline.train.data import ShardDataset
from mlm_pipeline.train.loop import accumulate_gradients, lr_multiplier


def _cfg(tmp_path, model_cfg, **train_kw):
    kw = dict(micro_batch_size=4, max_steps=5, warmup_steps=2, log_every=1, lr=1e-3, seed=11)
    kw.update(train_kw)
    return PipelineConfig(work_dir=str(tmp_path), model=model_cfg, train=TrainConfig(**kw))


def _records(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_five_steps(tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    cfg = _cfg(tmp_path, tiny_model_config)
    m = train(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert m.steps == 5 and not m.stopped_early
    assert m.tokens_seen == 5 * 4 * tiny_shard_manifest.seq_len
    records = _records(m)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert torch.isfinite(torch.tensor(r["train/loss"]))
        assert r["train/tokens_per_s"] > 0
        assert r["train/grad_norm"] > 0
        # the LR logged after step s is the one the schedule gives for the next step
        want = 1e-3 * lr_multiplier(r["step"], warmup_steps=2, max_steps=5, decay="linear",
                                    min_lr_ratio=0.0)
        assert r["train/lr"] == pytest.approx(want)
    ckpt = m.file(m.checkpoint_dir)
    for name in ("model.pt", "optimizer.pt", "rng.pt", "state.json"):
        assert (ckpt / name).is_file()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 5 and state["tokenizer_digest"] == tiny_tokenizer_manifest.digest


def test_resume_is_exact(tmp_path, tiny_model_config, tiny_shard_manifest,
                         tiny_tokenizer_manifest):
    model_cfg = tiny_model_config.model_copy(update={"dropout": 0.1})  # RNG state matters too
    straight = train(_cfg(tmp_path, model_cfg, max_steps=6), tiny_shard_manifest,
                     tiny_tokenizer_manifest, tmp_path / "straight")

    cfg = _cfg(tmp_path, model_cfg, max_steps=6, checkpoint_every=3)
    first = train(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "resumed")
    ckpts = list_checkpoints(first.file("checkpoints"))
    assert [c.name for c in ckpts] == ["step-00000003", "step-00000006"]
    # Simulate a crash after step 6 was logged but before its checkpoint was complete: the
    # rerun resumes from step 3 and logs steps 4-6 once more, replacing the old records.
    shutil.rmtree(ckpts[-1])
    first.path.unlink()
    resumed = train(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "resumed")

    assert resumed.steps == 6
    a = load_model_state(straight.file(straight.checkpoint_dir))
    b = load_model_state(resumed.file(resumed.checkpoint_dir))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    losses_a = [r["train/loss"] for r in _records(straight)]
    losses_b = [r["train/loss"] for r in _records(resumed)]
    assert losses_a == losses_b


def test_accumulation_equals_one_large_batch(tiny_model_config, tiny_shard_manifest):
    dataset = ShardDataset(tiny_shard_manifest, "train")
    masker = build_masker(MaskingConfig(seed=5), tiny_shard_manifest.vocab_size)
    rows = torch.arange(12)
    input_ids, labels = masker(dataset.get(rows.numpy()), rows, 0)

    def grads(micro):
        torch.manual_seed(0)
        model = BertMLM(tiny_model_config, tiny_shard_manifest.vocab_size,
                        tiny_shard_manifest.seq_len)
        loss_sum, n = accumulate_gradients(model, micro)
        return loss_sum / n, {k: p.grad.clone() for k, p in model.named_parameters()}

    loss_one, g_one = grads([(input_ids, labels)])
    # uneven split: micro-batches hold different numbers of masked tokens
    loss_acc, g_acc = grads([(input_ids[:3], labels[:3]), (input_ids[3:], labels[3:])])
    torch.testing.assert_close(loss_acc, loss_one, rtol=1e-5, atol=1e-6)
    for key in g_one:
        torch.testing.assert_close(g_acc[key], g_one[key], rtol=1e-4, atol=1e-6, msg=key)


def test_corrupted_shard_stops_training_before_step_one(tmp_path, tiny_model_config,
                                                        tiny_shard_manifest,
                                                        tiny_tokenizer_manifest):
    copy_dir = tmp_path / "shards"
    shutil.copytree(tiny_shard_manifest.output_dir, copy_dir)
    shards = tiny_shard_manifest.model_copy(update={"output_dir": str(copy_dir)})
    entry = shards.train.shards[0]
    data = bytearray(shards.file(entry.path).read_bytes())
    data[-len(data) // 3] ^= 0x01  # inside the token ids, not the Arrow metadata
    shards.file(entry.path).write_bytes(bytes(data))
    cfg = _cfg(tmp_path, tiny_model_config, max_steps=1, warmup_steps=0)
    with pytest.raises(ValueError, match=entry.path):
        train(cfg, shards, tiny_tokenizer_manifest, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # verification off: the flipped bit is only a different token id, and training runs
    off = _cfg(tmp_path, tiny_model_config, max_steps=1, warmup_steps=0, verify_shards=False)
    assert train(off, shards, tiny_tokenizer_manifest, tmp_path / "run-off").steps == 1
