"""Five training steps, exact resume (mid log interval, masker state checked, checkpoints of
the previous layout), token-weighted gradient accumulation."""

import hashlib
import json
import shutil

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, PipelineConfig, TrainConfig
from mlm_pipeline.masking.maskers import build_masker
from mlm_pipeline.train import BertMLM, train
from mlm_pipeline.train.checkpoint import (
    list_checkpoints,
    load_model,
    load_model_state,
    seal_state,
)
from mlm_pipeline.train.data import ShardDataset
from mlm_pipeline.train.loop import accumulate_gradients
from mlm_pipeline.train.schedule import lr_multiplier


def _sections(model_cfg, masking=None, **train_kw):
    """The `train`, `model` and `masking` sections `train()` takes, in its order."""
    kw = {"micro_batch_size": 4, "max_steps": 5, "warmup_steps": 2, "log_every": 1, "lr": 1e-3,
          "seed": 11, **train_kw}
    return TrainConfig(**kw), model_cfg, masking or MaskingConfig()


def _records(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_five_steps(tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    m = train(*_sections(tiny_model_config), tiny_shard_manifest, tiny_tokenizer_manifest,
              tmp_path / "run")
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
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        assert (ckpt / name).is_file()
    state = json.loads((ckpt / "state.json").read_text())
    # every other file is recorded with its size and sha256 (checked on load)
    for name in ("model.safetensors", "optimizer.pt", "rng.pt"):
        data = (ckpt / name).read_bytes()
        assert state["files"][name] == {"bytes": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}
    assert state["train_state"] == {"step": 5, "tokens_seen": m.tokens_seen,
                                    "skipped_steps": 0, "empty_steps": 0,
                                    "skipped_in_a_row": 0}
    assert state["tokenizer_digest"] == tiny_tokenizer_manifest.digest
    assert state["config"] == m.config  # model, train and masking sections
    masker = build_masker(MaskingConfig(), tiny_shard_manifest.vocab_size)
    assert state["masker"] == masker.state_dict()
    assert state["meter"]["steps"] == 0  # the last step was logged: the interval is empty


def test_resume_is_exact(tmp_path, tiny_model_config, tiny_shard_manifest,
                         tiny_tokenizer_manifest):
    model_cfg = tiny_model_config.model_copy(update={"dropout": 0.1})  # RNG state matters too
    # Checkpoints at steps 3 and 6, neither a multiple of log_every: the meter's open
    # interval (steps 5-6 of the one logged at step 8) travels in the checkpoint.
    sections = _sections(model_cfg, max_steps=8, log_every=4, checkpoint_every=3,
                         keep_last_checkpoints=3)
    straight = train(*_sections(model_cfg, max_steps=8, log_every=4), tiny_shard_manifest,
                     tiny_tokenizer_manifest, tmp_path / "straight")
    first = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "resumed")
    ckpts = list_checkpoints(first.file("checkpoints"))
    assert [c.name for c in ckpts] == ["step-00000003", "step-00000006", "step-00000008"]
    meter = json.loads((ckpts[1] / "state.json").read_text())["meter"]
    assert meter["steps"] == 2 and meter["masked_sum"] > 0 and meter["loss_sum"] > 0
    # Simulate a crash after step 8 was logged but before its checkpoint was complete: the
    # rerun resumes from step 6 and logs step 8 once more, replacing the old record.
    shutil.rmtree(ckpts[-1])
    first.path.unlink()
    resumed = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest,
                    tmp_path / "resumed")

    assert resumed.steps == 8
    a = load_model_state(straight.file(straight.checkpoint_dir))
    b = load_model_state(resumed.file(resumed.checkpoint_dir))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert [r["step"] for r in _records(resumed)] == [4, 8]
    losses_a = [r["train/loss"] for r in _records(straight)]
    losses_b = [r["train/loss"] for r in _records(resumed)]
    assert losses_a == losses_b  # step 8's loss includes steps 5-6, trained before the resume


def test_resume_checks_the_masker_state(tmp_path, tiny_model_config, tiny_shard_manifest,
                                        tiny_tokenizer_manifest):
    sections = _sections(tiny_model_config, max_steps=4, checkpoint_every=2)
    first = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    ckpt = first.file(first.checkpoint_dir)
    shutil.rmtree(ckpt)  # leave step 2 to resume from
    step2 = list_checkpoints(first.file("checkpoints"))[-1]
    state_path = step2 / "state.json"
    saved = json.loads(state_path.read_text())
    assert saved["masker"]["mode"] == "dynamic" and saved["masker"]["selection"] == "bernoulli"

    # another masking than the checkpoint's is refused, before any step runs
    exact_k = MaskingConfig(selection="exact_k")
    with pytest.raises(ValueError, match="masking"):
        train(*_sections(tiny_model_config, exact_k, max_steps=4, checkpoint_every=2),
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    # ...and so is a checkpoint whose masker state was made by another masking algorithm
    # (sealed with its digest: an intact checkpoint of another masking, not a damaged one)
    stale = {**saved, "masker": {**saved["masker"], "algorithm": -1}}
    state_path.write_text(json.dumps(seal_state(stale)))
    with pytest.raises(ValueError, match="masking"):
        train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    # a checkpoint of this layout without masker state is refused, not resumed unchecked
    state_path.write_text(json.dumps(seal_state(
        {k: v for k, v in saved.items() if k != "masker"})))
    with pytest.raises(ValueError, match="masker"):
        train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    state_path.write_text(json.dumps(saved))
    assert train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest,
                 tmp_path / "run").steps == 4


def test_checkpoints_of_the_previous_layout_still_load(tmp_path, tiny_model_config,
                                                       tiny_shard_manifest,
                                                       tiny_tokenizer_manifest):
    """Before the Stateful parts, `state.json` held the whole pipeline config under
    `config`, `step` and `tokens_seen` at its top and no masker or meter state."""
    sections = _sections(tiny_model_config, max_steps=4, checkpoint_every=2)
    straight = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest,
                     tmp_path / "straight")
    first = train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    shutil.rmtree(first.file(first.checkpoint_dir))
    step2 = list_checkpoints(first.file("checkpoints"))[-1]
    new = json.loads((step2 / "state.json").read_text())
    pipeline = PipelineConfig(model=tiny_model_config, train=sections[0])
    old = {"step": 2, "tokens_seen": new["train_state"]["tokens_seen"],
           "cursor": new["cursor"], "config": pipeline.model_dump(mode="json"),
           **{k: new[k] for k in ("vocab_size", "seq_len", "tokenizer_digest", "shards_digest")}}
    (step2 / "state.json").write_text(json.dumps(old))

    # No digest to verify it against: refused unless the user trusts it.
    with pytest.raises(ValueError, match="trust_unverified_checkpoint=true"):
        load_model(step2)
    with pytest.raises(ValueError, match="--trust-unverified"):
        train(*sections, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    model = load_model(step2, trust_unverified=True)
    assert model.cfg == tiny_model_config
    trusted = _sections(tiny_model_config, max_steps=4, checkpoint_every=2,
                        trust_unverified_checkpoint=True)
    resumed = train(*trusted, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert resumed.steps == 4
    # log_every=1: no open interval was lost, so the resume is still exact
    assert _records(resumed) and [r["train/loss"] for r in _records(resumed)] == [
        r["train/loss"] for r in _records(straight)]


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
    with pytest.raises(ValueError, match=entry.path):
        train(*_sections(tiny_model_config, max_steps=1, warmup_steps=0), shards,
              tiny_tokenizer_manifest, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # verification off: the flipped bit is only a different token id, and training runs
    off = _sections(tiny_model_config, max_steps=1, warmup_steps=0, verify_shards=False)
    assert train(*off, shards, tiny_tokenizer_manifest, tmp_path / "run-off").steps == 1
