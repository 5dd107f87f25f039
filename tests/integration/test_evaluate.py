"""Held-out metrics: token-weighted, independent of the eval batch size, fixed positions."""

import math

import pytest
import torch
import torch.nn.functional as F

from mlm_pipeline.config import MaskingConfig
from mlm_pipeline.evaluate.stage import masked_lm_metrics, most_frequent_token
from mlm_pipeline.masking import KeyedMasking
from mlm_pipeline.masking.keyed import mask_tokens
from mlm_pipeline.train import BertMLM
from mlm_pipeline.train.data import ShardDataset


@pytest.fixture(scope="module")
def model_and_data(tiny_model_config, tiny_shard_manifest):
    torch.manual_seed(3)
    model = BertMLM(tiny_model_config, tiny_shard_manifest.vocab_size,
                    tiny_shard_manifest.seq_len).eval()
    return model, ShardDataset(tiny_shard_manifest, "validation"), tiny_shard_manifest


def _metrics(model, data, manifest, batch_size):
    return masked_lm_metrics(
        model, data, masking=KeyedMasking(MaskingConfig(), manifest.vocab_size, seed=99),
        batch_size=batch_size, baseline_token=most_frequent_token(manifest),
    )


def test_same_metrics_for_batch_sizes_1_7_32(model_and_data):
    model, data, manifest = model_and_data
    results = [_metrics(model, data, manifest, bs) for bs in (1, 7, 32)]
    for other in results[1:]:
        assert other["eval/masked_tokens"] == results[0]["eval/masked_tokens"]
        for key in results[0]:
            assert other[key] == pytest.approx(results[0][key], rel=1e-5), key


def test_metrics_match_a_full_head_reference(model_and_data):
    """Recompute every number row by row with the model's full (B, L, V) logits."""
    model, data, manifest = model_and_data
    got = _metrics(model, data, manifest, 16)
    loss_sum, correct, masked, counts = 0.0, 0, 0, torch.zeros(manifest.vocab_size)
    train = ShardDataset(manifest, "train")
    for i in range(len(train)):
        counts += torch.bincount(train.get([i])[0], minlength=manifest.vocab_size)
    counts[:5] = -1
    top = int(counts.argmax())
    hits = top5 = 0
    with torch.no_grad():
        for i in range(len(data)):
            index = torch.tensor([i])
            inp, labels = mask_tokens(data.get([i]), vocab_size=manifest.vocab_size,
                                      row_index=index, seed=99, epoch=0)
            logits = model(inp).logits[0, :, : manifest.vocab_size]
            sel = labels[0] != -100
            loss_sum += F.cross_entropy(logits[sel], labels[0][sel], reduction="sum").item()
            correct += (logits[sel].argmax(-1) == labels[0][sel]).sum().item()
            # Rank of the target: how many ids score strictly higher (ties: none here).
            target_logit = logits[sel].gather(1, labels[0][sel][:, None])
            top5 += ((logits[sel] > target_logit).sum(-1) < 5).sum().item()
            hits += (labels[0][sel] == top).sum().item()
            masked += int(sel.sum())
    assert got["eval/masked_tokens"] == masked
    assert got["eval/loss"] == pytest.approx(loss_sum / masked, rel=1e-5)
    assert got["eval/mlm_accuracy"] == pytest.approx(correct / masked)
    assert got["eval/top5_accuracy"] == pytest.approx(top5 / masked)
    assert got["eval/perplexity"] == pytest.approx(math.exp(loss_sum / masked), rel=1e-5)
    assert got["eval/baseline_accuracy"] == pytest.approx(hits / masked)


def test_the_final_evaluation_masks_at_15_percent_whatever_training_used(
        tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """Trained at 30 %: `eval/*` are at 15 % with the eval seed (the rate recorded), and the
    30 % figures stand beside them under their own names."""
    from mlm_pipeline.config import EvalConfig, TrainConfig
    from mlm_pipeline.evaluate import evaluate
    from mlm_pipeline.masking.maskers import keyed_masking
    from mlm_pipeline.tokenizer import Tokenizer
    from mlm_pipeline.train import train
    from mlm_pipeline.train.checkpoint import load_model

    trained = train(TrainConfig(micro_batch_size=4, max_steps=2, warmup_steps=0,
                                precision="fp32"), tiny_model_config,
                    MaskingConfig(mlm_probability=0.3), tiny_shard_manifest,
                    tiny_tokenizer_manifest, tmp_path / "run")
    cfg = EvalConfig(batch_size=8, probes=[], seed=7)
    m = evaluate(cfg, trained, tiny_shard_manifest, tiny_tokenizer_manifest,
                 tmp_path / "work")
    model = load_model(trained.file(trained.checkpoint_dir))
    data = ShardDataset(tiny_shard_manifest, "validation")
    tok = Tokenizer.load(tiny_tokenizer_manifest)
    for rate, loss, acc in ((0.15, "eval/loss", "eval/mlm_accuracy"),
                            (0.3, "eval/loss_at_train_rate", "eval/mlm_accuracy_at_train_rate")):
        ref = masked_lm_metrics(model, data, masking=keyed_masking(
            MaskingConfig(mlm_probability=rate), tok, seed=7), batch_size=3,
            document_attention=trained.config["train"]["document_attention"])
        assert m.metrics[loss] == pytest.approx(ref["eval/loss"], rel=1e-5), rate
        assert m.metrics[acc] == pytest.approx(ref["eval/mlm_accuracy"]), rate
    assert m.metrics["eval/mlm_probability"] == 0.15
    assert m.config["masking"]["mlm_probability"] == 0.15
    assert m.config["train_masking"]["mlm_probability"] == 0.3
    same_rate = evaluate(cfg.model_copy(update={"mlm_probability": None}), trained,
                         tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "work")
    assert same_rate.metrics["eval/mlm_probability"] == 0.3
    assert "eval/loss_at_train_rate" not in same_rate.metrics
    assert same_rate.metrics["eval/loss"] == pytest.approx(m.metrics["eval/loss_at_train_rate"])
