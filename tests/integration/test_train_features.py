"""Training options wired through the loop and evaluation: wsd schedule, peak memory,
document attention, whole-word and exact-k masking, torch.compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mlm_pipeline.config import (
    SEP_ID,
    EvalConfig,
    MaskingConfig,
    PipelineConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate, masked_lm_metrics
from mlm_pipeline.masking import KeyedMasking
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import load_model, load_model_state
from mlm_pipeline.train.data import ShardDataset

EVAL = EvalConfig(batch_size=8, seed=7, probes=[])


def _cfg(tmp_path, model_cfg, masking=MaskingConfig(), **train_kw):
    kw = dict(micro_batch_size=4, max_steps=4, warmup_steps=1, log_every=1, lr=1e-3, seed=3)
    kw.update(train_kw)
    return PipelineConfig(work_dir=str(tmp_path), model=model_cfg, masking=masking,
                          train=TrainConfig(**kw), eval=EVAL)


def _records(manifest):
    lines = manifest.file(manifest.metrics_log).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_wsd_schedule_and_memory_are_logged(tmp_path, tiny_model_config, tiny_shard_manifest,
                                            tiny_tokenizer_manifest):
    cfg = _cfg(tmp_path, tiny_model_config, max_steps=6, warmup_steps=2, decay="wsd",
               decay_fraction=0.5, min_lr_ratio=0.0)
    m = train(cfg.train, cfg.model, cfg.masking,
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    records = _records(m)
    # LR logged after step s is for step s + 1: warm-up 2 steps, stable until step 3 (6 - 3),
    # then linear to 0 at step 6: factors 1, 1, 1, 2/3, 1/3, 0 after steps 1..6.
    want = [1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]
    assert [r["train/lr"] for r in records] == pytest.approx([1e-3 * w for w in want])
    for r in records:
        assert r["train/memory_mb"] > 10  # the interpreter and torch alone take more


def _has_inner_document_boundary(dataset: ShardDataset) -> bool:
    ids = dataset.get(torch.arange(len(dataset)).numpy())
    return bool((ids[:, :-1] == SEP_ID).any())  # a [SEP] followed by more tokens of the row


def test_document_attention_trains_and_changes_evaluation(
    tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    assert _has_inner_document_boundary(ShardDataset(tiny_shard_manifest, "train"))
    assert _has_inner_document_boundary(ShardDataset(tiny_shard_manifest, "validation"))
    on = _cfg(tmp_path, tiny_model_config, document_attention=True, precision="fp32")
    off = _cfg(tmp_path, tiny_model_config, document_attention=False, precision="fp32")
    m_on = train(on.train, on.model, on.masking,
                 tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "on")
    m_off = train(off.train, off.model, off.masking,
                  tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "off")
    losses_on = [r["train/loss"] for r in _records(m_on)]
    losses_off = [r["train/loss"] for r in _records(m_off)]
    assert len(losses_on) == 4 and all(torch.isfinite(torch.tensor(losses_on)))
    # Same seed, same init, same masks: only the attention pattern differs.
    assert losses_on[0] != losses_off[0]

    # Evaluation takes the setting from the run it evaluates (its manifest's config).
    e_on = evaluate(EVAL, m_on, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "w")
    e_off = evaluate(EVAL, m_off, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "w")
    assert e_on.digest != e_off.digest
    assert e_on.metrics["eval/masked_tokens"] == e_off.metrics["eval/masked_tokens"]
    assert torch.isfinite(torch.tensor(e_on.metrics["eval/loss"]))
    model_on = load_model(m_on.file(m_on.checkpoint_dir), "cpu")
    validation = ShardDataset(tiny_shard_manifest, "validation")
    keyed = KeyedMasking(MaskingConfig(), tiny_shard_manifest.vocab_size, seed=EVAL.seed)
    with_docs, without = (
        masked_lm_metrics(model_on, validation, masking=keyed, batch_size=8,
                          document_attention=flag)
        for flag in (True, False)
    )
    assert e_on.metrics["eval/loss"] == pytest.approx(with_docs["eval/loss"], rel=1e-6)
    assert with_docs["eval/loss"] != without["eval/loss"]


@pytest.mark.parametrize(
    "masking",
    [MaskingConfig(whole_word=True), MaskingConfig(selection="exact_k")],
    ids=["whole_word", "exact_k"],
)
def test_training_and_evaluation_use_the_masking_options(
    tmp_path, masking, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    cfg = _cfg(tmp_path, tiny_model_config, masking=masking, max_steps=2, precision="fp32")
    m = train(cfg.train, cfg.model, cfg.masking,
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")
    assert m.steps == 2
    e = evaluate(cfg.eval, m, tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "w")
    word_starts = torch.from_numpy(Tokenizer.load(tiny_tokenizer_manifest).word_starts())
    vocab = tiny_shard_manifest.vocab_size
    model = load_model(m.file(m.checkpoint_dir), "cpu")
    validation = ShardDataset(tiny_shard_manifest, "validation")
    documents = cfg.train.document_attention  # on by default: evaluation follows the run
    want = masked_lm_metrics(
        model, validation, batch_size=8,
        masking=KeyedMasking(masking, vocab, word_starts, seed=EVAL.seed),
        document_attention=documents,
    )
    plain = masked_lm_metrics(model, validation, batch_size=8,
                              masking=KeyedMasking(MaskingConfig(), vocab, seed=EVAL.seed),
                              document_attention=documents)
    for key in ("eval/loss", "eval/mlm_accuracy", "eval/masked_tokens"):
        assert e.metrics[key] == pytest.approx(want[key], rel=1e-6), key
    # ...and the option changed which positions were evaluated
    assert e.metrics["eval/loss"] != pytest.approx(plain["eval/loss"], rel=1e-6)


def test_compile_without_a_cxx_compiler_names_the_setting(
    tmp_path, monkeypatch, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest
):
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / clang++ / c++ to be found
    monkeypatch.delenv("CXX", raising=False)
    cfg = _cfg(tmp_path, tiny_model_config, compile="on", device="cpu")
    with pytest.raises(RuntimeError, match="train.compile"):
        train(cfg.train, cfg.model, cfg.masking,
              tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / "run")


@pytest.mark.slow
@pytest.mark.full  # inductor builds C++: one slice of the landings in CI
def test_compiled_training_matches_eager(tmp_path, tiny_model_config, tiny_shard_manifest,
                                         tiny_tokenizer_manifest):
    """torch.compile on CPU (inductor builds C++; about a minute on 2 cores)."""
    runs = {}
    for mode in ("off", "on"):
        cfg = _cfg(tmp_path, tiny_model_config, max_steps=3, compile=mode, device="cpu",
                   precision="fp32")
        runs[mode] = train(cfg.train, cfg.model, cfg.masking,
                           tiny_shard_manifest, tiny_tokenizer_manifest, tmp_path / mode)
    eager = [r["train/loss"] for r in _records(runs["off"])]
    compiled = [r["train/loss"] for r in _records(runs["on"])]
    assert compiled == pytest.approx(eager, rel=1e-4)
    # The checkpoint holds the plain module's keys, loadable without torch.compile.
    a = load_model_state(runs["off"].file(runs["off"].checkpoint_dir))
    b = load_model_state(runs["on"].file(runs["on"].checkpoint_dir))
    assert set(a) == set(b) and not any("_orig_mod" in k for k in b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.full
def test_a_failing_inductor_build_names_the_setting(tmp_path, tiny_shard_manifest,
                                                    tiny_tokenizer_manifest):
    """A C++ compiler that exists but fails: the first step's build error is reported as
    a `train.compile` problem. Runs in a child process, since inductor reads `CXX` once."""
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho 'fake compiler failure' >&2\nexit 1\n")
    fake.chmod(0o755)
    child = textwrap.dedent(f"""
        from mlm_pipeline.config import ModelConfig, PipelineConfig, TrainConfig
        from mlm_pipeline.manifest import ShardManifest, TokenizerManifest, read_manifest
        from mlm_pipeline.train import train
        shards = read_manifest({str(tiny_shard_manifest.path)!r}, ShardManifest)
        tok = read_manifest({str(tiny_tokenizer_manifest.path)!r}, TokenizerManifest)
        cfg = PipelineConfig(
            model=ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
            train=TrainConfig(micro_batch_size=4, max_steps=1, warmup_steps=0, compile="on",
                              device="cpu", precision="fp32"))
        try:
            train(cfg.train, cfg.model, cfg.masking, shards, tok, {str(tmp_path / "run")!r})
        except RuntimeError as exc:
            print("ERROR", exc)
    """)
    env = {**os.environ, "CXX": str(fake), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                          text=True, timeout=600)
    assert "ERROR train.compile=on" in done.stdout, done.stdout + done.stderr
    assert "set train.compile: off" in done.stdout
