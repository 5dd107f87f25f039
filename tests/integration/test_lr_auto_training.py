"""`train.lr: auto` in training, and the one warning of a run that is not learning: its
held-out loss after the warm-up is still that of a uniform guess (ln V)."""

import json
import logging
import math

from mlm_pipeline.config import EvalConfig, MaskingConfig, TrainConfig
from mlm_pipeline.evaluate.periodic import PeriodicEvaluator
from mlm_pipeline.train import train

NOT_LEARNING = "is not learning"


def _run(tmp_path, name, model_cfg, shards, tokenizer, **train_kw):
    cfg = TrainConfig(**{"micro_batch_size": 8, "max_steps": 8, "warmup_steps": 2,
                         "log_every": 1, "seed": 5, "device": "cpu", "precision": "fp32",
                         **train_kw})
    evaluator = PeriodicEvaluator(EvalConfig(every_steps=2, periodic_rows=16, batch_size=8,
                                             probes=[]), MaskingConfig(), shards, tokenizer)
    m = train(cfg, model_cfg, MaskingConfig(), shards, tokenizer, tmp_path / name,
              evaluator=evaluator)
    lines = m.file(m.metrics_log).read_text().splitlines()
    return m, [json.loads(line) for line in lines]


def test_a_run_that_cannot_learn_warns_once(tmp_path, caplog, tiny_model_config,
                                            tiny_shard_manifest, tiny_tokenizer_manifest):
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.train.loop"):
        _, records = _run(tmp_path, "frozen", tiny_model_config, tiny_shard_manifest,
                          tiny_tokenizer_manifest, lr=1e-9)
    # The model barely moved: every point is still a uniform guess's loss, ln V.
    uniform = math.log(tiny_shard_manifest.vocab_size)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 3 and all(abs(loss - uniform) < 0.01 for loss in evals)
    warnings = [r for r in caplog.records if NOT_LEARNING in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "step 2:" in warnings[0].getMessage()


def test_a_learning_run_does_not_warn(tmp_path, caplog, tiny_model_config,
                                      tiny_shard_manifest, tiny_tokenizer_manifest):
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.train.loop"):
        _, records = _run(tmp_path, "learning", tiny_model_config, tiny_shard_manifest,
                          tiny_tokenizer_manifest, lr=1e-2, max_steps=6)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert evals == sorted(evals, reverse=True)  # falling at every point
    assert not [r for r in caplog.records if NOT_LEARNING in r.getMessage()]


def test_train_resolves_auto_from_the_model(tmp_path, tiny_model_config, tiny_shard_manifest,
                                            tiny_tokenizer_manifest):
    # A TrainConfig passed on its own (not through PipelineConfig) is resolved by train().
    cfg = TrainConfig(micro_batch_size=4, max_steps=2, lr="auto", log_every=1)
    post = train(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                 tiny_tokenizer_manifest, tmp_path / "post")
    assert post.config["train"]["lr"] == 5e-4 and post.config["train"]["warmup_ratio"] == 0.06
    records = [json.loads(line) for line in
               post.file(post.metrics_log).read_text().splitlines()]
    # warm-up round(0.06 * 2) = 0 steps: the decay from 5e-4 reaches 0 at step 2
    assert [r["train/lr"] for r in records] == [2.5e-4, 0.0]
