"""Learning at equal steps and equal wall clock, at one masking rate: ours against HF BERT
and ModernBERT, then the downstream protocol on each model.

    python benchmarks/bench_learning.py [--steps 1000] [--budget-s 300] [--seeds 0,1]
                                        [--mlm-probability 0.15] [--downstream full]
                                        [--threads 2] [--config tiny] [--work DIR]
                                        [--eval-rows 1000] [--models LIST] [--out FILE]
                                        [--set KEY=VALUE ...]

Smoke test: `--smoke` (seconds, offline: the test corpus `tests/assets/tiny_fr.txt`,
vocabulary 128, seq_len 32, a toy shape, 3 steps and a 0.25 s budget, one thread, a
labelled CSV of its sentences for the downstream protocol, in a temporary work directory
unless `--work`). Needs `transformers` (a base dependency).

What is compared, and what is held equal:

- **The masking rate.** Every model trains at `--mlm-probability` (default 0.15, BERT's and
  `run_mlm.py`'s): ours through `masking.mlm_probability`, the peers through
  `DataCollatorForLanguageModeling(mlm_probability=...)`, 80/10/10 and Bernoulli selection
  on both sides. (Before, ours trained at the `tiny` config's 30 % against the peers' 15 %:
  that compared recipes, not implementations.) Every model is evaluated at 15 %.
- **Equal steps** (`--steps N`): every model runs exactly N optimizer steps (warm-up the
  config's share of N, LR decay spanning N), with `train.max_time_s` as the only time
  limit: equal compute per architecture, whatever the machine's load.
- **Equal wall clock** (`--budget-s S`): each model first runs a few calibration steps; its
  step count is then `budget * measured steps/s`, so every model ends its LR decay when its
  time is up; `--budget-s` is also a hard stop. The time counts the training loop only.
  Speeds, hence these figures, need a quiet machine.
  Both by default (1,000 steps and 300 s); either alone when only it is given.
- **Seeds** (`--seeds`, default 0,1): `train.seed` and `masking.seed` (initialisation, data
  order, masks) per model and budget; the tables give mean +- sd over them.
- **Downstream** (`--downstream full`, the default; `probe`; `none`): on each model of the
  first seed and the first budget, the same code for ours and the peers
  (`mlm_pipeline.evaluate`: `ours(...)` / `hugging_face(...)`): the linear probe beside a
  random-init encoder of the same architecture, TF-IDF (whole text and the same input) and
  the majority class, and fine-tuning pretrained vs from scratch (learning rate and epoch
  chosen on dev, 3 seeds, the paired difference with its 95 % interval), on the config's
  `linear_probe.tasks` (the French review set by default; fetched once, then cached).

Data: the real French corpus of `configs/tiny.yaml`, run through our ingest, tokenizer and
shard stages (`ingest`, `train_tokenizer`, `write_shards`, cached by digest under the
config's `work_dir` or `--work`); every model trains on the same training rows of 128
tokens and is evaluated on the same validation rows.

Models, one shape (hidden 256, 4 layers, 4 heads, FFN 1024, vocab of the tokenizer,
seq_len 128), micro-batch, peak lr, warm-up share, decay, grad clip and AdamW settings of
the config, `--threads` torch threads. The config is loaded once per model with
`model.preset` set to the model's recipe (`bert` for `ours-bert` and `hf-bert`, `modern`
for the other two), so `--set train.lr=auto` resolves per model
(`mlm_pipeline.config.lr_auto`); each model's peak lr and warm-up are printed and written.

- `ours-bert`, `ours-modern`: our `train()` with `model.preset` `bert` / `modern`.
- `hf-bert`: `BertForMaskedLM` (SDPA, dropout 0.1, like our `bert` preset);
  `hf-modernbert`: `ModernBertForMaskedLM` at our `modern` architecture (global attention
  in every layer, rope theta 10,000, no dropout, `sparse_prediction=True`; the same
  settings as `bench_train.py`), trained by a plain loop: AdamW (no decay on biases and
  norms), the same `lr_multiplier` schedule, clipping, bf16 autocast when ours uses it.

Evaluation: one path for all four, `mlm_pipeline.evaluate.stage.masked_lm_metrics` (fp32),
on the first `--eval-rows` validation rows masked by `KeyedMasking` (Bernoulli selection)
with the config's `eval.seed` at 0.15 (80/10/10): the same positions and the same
corrupted inputs for every model. Hugging Face models are wrapped to return logits at the
masked positions. Reported per model and budget: masked-token accuracy and loss (mean +- sd
over the seeds), steps, tokens seen, tokens/s, plus the most-frequent-token baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from mlm_pipeline.config import (
    NUM_SPECIAL,
    SPECIAL_TOKENS,
    MaskingConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
)
from mlm_pipeline.config_files import load_config
from mlm_pipeline.evaluate.stage import masked_lm_metrics, most_frequent_token
from mlm_pipeline.evaluate.stats import mean_sd
from mlm_pipeline.ingest.stage import ingest
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest
from mlm_pipeline.masking.maskers import KeyedMasking
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer.stage import train_tokenizer
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import load_model
from mlm_pipeline.train.data import RowCursor, ShardDataset
from mlm_pipeline.train.perf import adamw_impl, resolve_precision
from mlm_pipeline.train.schedule import lr_multiplier

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)
MODELS = ("ours-bert", "ours-modern", "hf-bert", "hf-modernbert")
#: The `model.preset` whose recipe each model follows (post-LN `bert`, pre-LN `modern`).
RECIPE = {"ours-bert": "bert", "ours-modern": "modern", "hf-bert": "bert",
          "hf-modernbert": "modern"}
#: Masking rate of every model's training unless `--mlm-probability` says otherwise (the
#: `run_mlm.py` and BERT rate), and of the evaluation (always).
MLM_PROBABILITY = 0.15
EVAL_MLM_PROBABILITY = 0.15
CALIBRATION_STEPS = 8  # the first half warms up (allocator, caches); the second is timed
ROOT = Path(__file__).resolve().parents[1]
#: `--smoke`: the test corpus, a small vocabulary and rows, and a toy shape.
SMOKE_OVERRIDES = [f"ingest.sources=[{ROOT / 'tests' / 'assets' / 'tiny_fr.txt'}]",
                   "ingest.validation_fraction=0.1", "tokenizer.vocab_size=128",
                   "shards.seq_len=32", "eval.batch_size=16"]
SMOKE_SHAPE = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


class Result(NamedTuple):
    """One trained model: where it is and what its training did."""

    model: torch.nn.Module
    steps: int
    tokens_seen: int
    train_s: float
    stopped_early: bool
    final_loss: float
    """Training loss of the last logged interval (ours) or step (Hugging Face)."""


# ----------------------------------------------------------------------------- data
def prepare_data(cfg: PipelineConfig) -> tuple[TokenizerManifest, ShardManifest]:
    """Our ingest, tokenizer and shard stages on the config's corpus (cached by digest)."""
    corpus = ingest(cfg.ingest, cfg.work_dir)
    tok = train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir)
    shards = write_shards(cfg.shards, corpus, tok, cfg.work_dir)
    return tok, shards


def schedule(cfg: PipelineConfig, steps: int) -> dict[str, Any]:
    """`lr_multiplier` keywords for a run of `steps` steps, warm-up the config's share."""
    tc = cfg.train
    warmup = max(1, round(steps * tc.warmup / tc.max_steps))
    return dict(warmup_steps=min(warmup, steps), max_steps=steps, decay=tc.decay,
                min_lr_ratio=tc.min_lr_ratio, decay_fraction=tc.decay_fraction)


# ----------------------------------------------------------------------------- ours
def ours_config(cfg: PipelineConfig, preset: str, steps: int, budget_s: float, threads: int,
                precision: str) -> PipelineConfig:
    """The config with our `preset` at the benchmark shape and a `steps`-step schedule."""
    sched = schedule(cfg, steps)
    train_cfg = TrainConfig(**{
        **cfg.train.model_dump(),
        "max_steps": steps, "warmup_steps": sched["warmup_steps"], "max_time_s": budget_s,
        "num_threads": threads, "precision": precision, "device": "cpu",
        "checkpoint_every": None, "log_every": max(1, min(cfg.train.log_every, steps // 2)),
    })
    model_cfg = ModelConfig(preset=preset, **SHAPE)
    return cfg.model_copy(update={"train": train_cfg, "model": model_cfg})


def run_ours(cfg: PipelineConfig, preset: str, tok: TokenizerManifest, shards: ShardManifest,
             budget_s: float, threads: int, precision: str, work: Path,
             steps: int | None = None) -> Result:
    """Calibrate, then train with our `train()` for `budget_s` seconds; or, with `steps`,
    train exactly `steps` steps (no calibration; `train.max_time_s` the only time limit)."""
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * shards.seq_len
    if steps is not None:
        return _train_ours(ours_config(cfg, preset, steps, cfg.train.max_time_s, threads,
                                       precision), tok, shards, tokens_per_step,
                           Path(tempfile.mkdtemp(dir=work, prefix=f"ours-{preset}-")))
    calib = ours_config(cfg, preset, CALIBRATION_STEPS, budget_s, threads, precision)
    calib = calib.model_copy(update={"train": calib.train.model_copy(
        update={"log_every": CALIBRATION_STEPS // 2})})
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        m = train(calib.train, calib.model, calib.masking,
                  shards, tok, Path(tmp) / "calibration")
        lines = m.file(m.metrics_log).read_text().splitlines()
        tokens_per_s = json.loads(lines[-1])["train/tokens_per_s"]
    steps = max(2, int(budget_s * tokens_per_s / tokens_per_step))
    run_cfg = ours_config(cfg, preset, steps, budget_s, threads, precision)
    return _train_ours(run_cfg, tok, shards, tokens_per_step,
                       Path(tempfile.mkdtemp(dir=work, prefix=f"ours-{preset}-")))


def _train_ours(run_cfg: PipelineConfig, tok: TokenizerManifest, shards: ShardManifest,
                tokens_per_step: int, out: Path) -> Result:
    """One run of our `train()` into `out`; its loop seconds from the logged intervals."""
    m = train(run_cfg.train, run_cfg.model, run_cfg.masking, shards, tok, out)
    # Loop time from the logged intervals (steps * tokens per step / tokens/s), leaving
    # out model construction and the final checkpoint, like the Hugging Face loop's clock.
    loop_s, last_step, loss = 0.0, 0, math.nan
    for line in m.file(m.metrics_log).read_text().splitlines():
        record = json.loads(line)
        loop_s += (record["step"] - last_step) * tokens_per_step / record["train/tokens_per_s"]
        last_step, loss = record["step"], record.get("train/loss", loss)
    return Result(load_model(m.file(m.checkpoint_dir)), m.steps, m.tokens_seen, loop_s,
                  m.stopped_early, loss)


# ----------------------------------------------------------------------------- Hugging Face
def hf_tokenizer(tok: TokenizerManifest):
    """A `PreTrainedTokenizerFast` over our SentencePiece vocabulary (same ids), which
    `DataCollatorForLanguageModeling` asks for [MASK], [PAD], special ids and the size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    vocab = []
    for line in tok.file(tok.vocab.path).read_text(encoding="utf-8").splitlines():
        piece, score = line.rsplit("\t", 1)
        vocab.append((piece, float(score)))
    names = {i: name for name, i in SPECIAL_TOKENS.items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer(models.Unigram(vocab, unk_id=SPECIAL_TOKENS["[UNK]"])),
        pad_token=names[0], unk_token=names[1], cls_token=names[2], sep_token=names[3],
        mask_token=names[4],
    )


def hf_model(kind: str, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """`BertForMaskedLM` or `ModernBertForMaskedLM` at the benchmark shape."""
    common = dict(vocab_size=vocab_size, hidden_size=SHAPE["hidden_size"],
                  num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
                  intermediate_size=SHAPE["intermediate_size"], max_position_embeddings=seq_len,
                  pad_token_id=0, attn_implementation="sdpa")
    if kind == "hf-bert":
        from transformers import BertConfig, BertForMaskedLM

        return BertForMaskedLM(BertConfig(**common))
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(ModernBertConfig(
        **common, layer_types=["full_attention"] * SHAPE["num_layers"],
        global_rope_theta=10000.0, bos_token_id=2, cls_token_id=2, eos_token_id=3,
        sep_token_id=3, embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0,
        sparse_prediction=True,
    ))


def hf_train(kind: str, cfg: PipelineConfig, dataset: ShardDataset, collator, steps: int,
             max_time_s: float, precision: str
             ) -> tuple[torch.nn.Module, int, float, list[float], float]:
    """A plain loop: collator masking, AdamW, our LR schedule, clipping.

    Returns:
        (model, steps done, training seconds, per-step seconds, last step's loss).
    """
    tc = cfg.train
    torch.manual_seed(tc.seed)
    model = hf_model(kind, len(collator.tokenizer), dataset.seq_len).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr, betas=tc.betas, eps=tc.eps, **adamw_impl(torch.device("cpu")))
    sched_kw = schedule(cfg, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, **sched_kw))
    cursor = RowCursor(len(dataset), tc.micro_batch_size, tc.seed)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    clip = tc.grad_clip if tc.grad_clip is not None else float("inf")
    step_times: list[float] = []
    start = time.perf_counter()
    step, last = 0, math.nan
    while step < steps and time.perf_counter() - start < max_time_s:
        t0 = time.perf_counter()
        rows, _ = cursor.next_batch()
        ids = dataset.get(rows)
        # run_mlm.py's rows: lists of ids with a precomputed special_tokens_mask.
        examples = [{"input_ids": r, "attention_mask": [1] * len(r),
                     "special_tokens_mask": [int(i < NUM_SPECIAL) for i in r]}
                    for r in ids.tolist()]
        batch = collator(examples)
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        step_times.append(time.perf_counter() - t0)
        last = loss.item()
        if not math.isfinite(last):
            raise RuntimeError(f"{kind}: loss became {last} at step {step}")
    return model, step, time.perf_counter() - start, step_times, last


def run_hf(kind: str, cfg: PipelineConfig, tok: TokenizerManifest, shards: ShardManifest,
           budget_s: float, precision: str, steps: int | None = None) -> Result:
    """Calibrate, then train a Hugging Face model for `budget_s` seconds; or, with `steps`,
    exactly `steps` steps (no calibration; `train.max_time_s` the only time limit)."""
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(
        tokenizer=hf_tokenizer(tok), mlm_probability=cfg.masking.eval_probability,
        seed=cfg.train.seed)
    dataset = ShardDataset(shards, "train")
    if steps is None:
        _, _, _, times, _ = hf_train(kind, cfg, dataset, collator, CALIBRATION_STEPS, budget_s,
                                     precision)
        step_s = float(np.mean(times[CALIBRATION_STEPS // 2:]))
        steps = max(2, int(budget_s / step_s))
    else:
        budget_s = cfg.train.max_time_s
    model, done, seconds, _, loss = hf_train(kind, cfg, dataset, collator, steps, budget_s,
                                             precision)
    tokens = done * cfg.train.micro_batch_size * shards.seq_len
    return Result(HFLogitsAtLabels(model), done, tokens, seconds, done < steps, loss)


class HFLogitsAtLabels(torch.nn.Module):
    """A Hugging Face MLM seen through `BertMLM`'s interface for `masked_lm_metrics`:
    `forward(input_ids, labels=...)` returns an object whose `logits` are (N, V) at the
    positions where `labels != -100`, in row-major order."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None):
        """(B, L) int64 ids -> logits (N, V) at labelled positions, or (B, L, V).

        Raises:
            ValueError: when `document_ids` is given (not supported by these models here).
        """
        if document_ids is not None:
            raise ValueError("document attention is not wired for Hugging Face models")
        logits = self.model(input_ids=input_ids,
                            attention_mask=torch.ones_like(input_ids)).logits
        return _Logits(logits if labels is None else logits[labels != -100])


class _Logits(NamedTuple):
    logits: torch.Tensor


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the comparison; prints tables and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="equal wall clock: seconds of training per model (default 300 "
                             "when --steps is not given either)")
    parser.add_argument("--steps", type=int, default=None,
                        help="equal steps: exactly N optimizer steps per model (default 1000 "
                             "when --budget-s is not given either)")
    parser.add_argument("--seeds", default="0,1",
                        help="training seeds (init, data order, masks) per model and budget")
    parser.add_argument("--mlm-probability", type=float, default=MLM_PROBABILITY,
                        help="training masking rate of every model, ours and the peers")
    parser.add_argument("--downstream", default="full", choices=["none", "probe", "full"],
                        help="after training, the downstream protocol on each model (first "
                             "seed, equal steps): the linear probe and its controls, and "
                             "with `full` fine-tuning pretrained vs scratch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--work", default=None, help="work_dir (default: the config's)")
    parser.add_argument("--eval-rows", type=int, default=1000)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None,
                        help="JSON results (default: WORK/bench_learning/bench_learning.json)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable), as `mlm-pipeline run --set`")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds, offline: test corpus, toy shape (see above)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    if args.steps is None and args.budget_s is None:
        args.steps, args.budget_s = 1000, 300.0
    if not args.smoke:
        return run(args, parser)
    SHAPE.update(SMOKE_SHAPE)
    args.threads, args.eval_rows = 1, 32
    if args.budget_s is not None:
        args.budget_s = 0.25
    if args.steps is not None:
        args.steps = min(args.steps, 3)
    with tempfile.TemporaryDirectory(prefix="bench-learning-smoke-") as tmp:
        args.work = args.work or tmp
        task = smoke_task(Path(tmp))
        return run(args, parser, SMOKE_OVERRIDES + SMOKE_DOWNSTREAM + [
            f"linear_probe.data_path={task}"])


#: `--smoke`'s downstream protocol: one rate, two seeds, one epoch, one random init.
SMOKE_DOWNSTREAM = ["finetune.lr=[1e-3]", "finetune.seeds=2", "finetune.epochs=1",
                    "linear_probe.random_init_seeds=1", "finetune.seq_len=32"]


def smoke_task(tmp: Path) -> Path:
    """A labelled CSV in the review set's format, of the test corpus's sentences (40 rows):
    `--smoke` runs offline."""
    text = (ROOT / "tests" / "assets" / "tiny_fr.txt").read_text(encoding="utf-8")
    sentences = [s.strip() for s in text.replace("\n", " ").split(".") if len(s.strip()) > 10]
    path = tmp / "smoke-reviews.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        for i in range(40):
            good = i % 2 == 0
            writer.writerow([f"{sentences[i % len(sentences)]}. "
                             f"{'Magnifique' if good else 'Décevant'} ({i})", "1" if good else "-1"])
    return path


def run(args: argparse.Namespace, parser: argparse.ArgumentParser,
        extra_overrides: list[str] | None = None) -> int:
    """The comparison of `main` with its parsed `args` (and config overrides)."""
    torch.set_num_threads(args.threads)
    overrides = (([f"work_dir={args.work}"] if args.work else []) + (extra_overrides or [])
                 + [f"masking.mlm_probability={args.mlm_probability}"] + args.set)
    cfg = load_config(args.config, overrides)
    work = Path(cfg.work_dir).expanduser().resolve() / "bench_learning"
    work.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(args.precision, torch.device("cpu"))
    seeds = [int(x) for x in args.seeds.split(",") if x]
    models = args.models.split(",")
    for name in models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    t0 = time.perf_counter()
    tok, shards = prepare_data(cfg)
    modes = [m for m, on in (("steps", args.steps is not None),
                             ("time", args.budget_s is not None)) if on]
    print(f"data: {shards.train.rows:,} train rows, {shards.validation.rows:,} validation "
          f"rows of {shards.seq_len} tokens, vocab {shards.vocab_size:,} "
          f"({time.perf_counter() - t0:.0f} s); precision {precision}, {args.threads} threads; "
          f"every model trained at {args.mlm_probability:g} masking, evaluated at "
          f"{EVAL_MLM_PROBABILITY:g}; seeds {seeds}; "
          + "; ".join(f"{args.steps} steps per model" if m == "steps"
                      else f"budget {args.budget_s:g} s per model" for m in modes), flush=True)

    validation = ShardDataset(shards, "validation")
    eval_masking = KeyedMasking(
        MaskingConfig(mlm_probability=EVAL_MLM_PROBABILITY, mask_replace_prob=0.8,
                      random_replace_prob=0.1, selection="bernoulli"),
        shards.vocab_size, seed=cfg.eval.seed)
    eval_kw = dict(masking=eval_masking, batch_size=cfg.eval.batch_size,
                   max_rows=args.eval_rows, baseline_token=most_frequent_token(shards))
    report: dict[str, Any] = {"mlm_probability": args.mlm_probability,
                              "eval_mlm_probability": EVAL_MLM_PROBABILITY, "seeds": seeds,
                              "threads": args.threads, "overrides": args.set,
                              "precision": precision, "steps": args.steps,
                              "budget_s": args.budget_s, "modes": {}, "downstream": {}}
    for mode in modes:
        results: dict[str, dict[str, Any]] = {}
        for name in models:
            per_seed = []
            for seed in seeds:
                # The model's recipe decides `train.lr: auto` (config validation resolves it).
                model_cfg = load_config(args.config, overrides + [
                    f"model.preset={RECIPE[name]}", f"train.seed={seed}", f"masking.seed={seed}"])
                r = train_one(name, model_cfg, tok, shards, args, precision, work, mode)
                metrics = masked_lm_metrics(r.model, validation, **eval_kw)
                per_seed.append(result_row(r, metrics, model_cfg, seed))
                print(f"{mode} {name} seed {seed}: accuracy {metrics['eval/mlm_accuracy']:.4f}, "
                      f"loss {metrics['eval/loss']:.4f}, {r.steps} steps (peak lr "
                      f"{model_cfg.train.lr:g}, warm-up {per_seed[-1]['warmup_steps']}), "
                      f"{r.tokens_seen:,} tokens in {r.train_s:.0f} s", flush=True)
                if (args.downstream != "none" and mode == modes[0] and seed == seeds[0]):
                    report["downstream"][name] = downstream(name, r, model_cfg, tok,
                                                            args.downstream)
                del r
            results[name] = {"seeds": per_seed, **summarize(per_seed)}
        report["modes"][mode] = results
        print_mode(mode, results, args)
    if report["downstream"]:
        print_downstream(report["downstream"])
    out = Path(args.out) if args.out else work / "bench_learning.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {out}")
    return 0


def train_one(name: str, cfg: PipelineConfig, tok: TokenizerManifest, shards: ShardManifest,
              args: argparse.Namespace, precision: str, work: Path, mode: str) -> Result:
    """One model trained for the mode's budget: `--steps` steps or `--budget-s` seconds."""
    steps = args.steps if mode == "steps" else None
    budget = args.budget_s if mode == "time" else cfg.train.max_time_s
    if name.startswith("ours-"):
        return run_ours(cfg, RECIPE[name], tok, shards, budget, args.threads, precision,
                        work, steps)
    return run_hf(name, cfg, tok, shards, budget, precision, steps)


def result_row(r: Result, metrics: dict[str, float], cfg: PipelineConfig, seed: int
               ) -> dict[str, Any]:
    """What the JSON keeps of one trained model."""
    return {"seed": seed, "eval/mlm_accuracy": metrics["eval/mlm_accuracy"],
            "eval/loss": metrics["eval/loss"], "eval/perplexity": metrics["eval/perplexity"],
            "eval/baseline_accuracy": metrics["eval/baseline_accuracy"],
            "eval/masked_tokens": metrics["eval/masked_tokens"], "train/loss": r.final_loss,
            "steps": r.steps, "tokens_seen": r.tokens_seen, "train_s": r.train_s,
            "tokens_per_s": r.tokens_seen / max(r.train_s, 1e-9),
            "stopped_early": r.stopped_early,
            "parameters": sum(p.numel() for p in r.model.parameters()),
            "lr": cfg.train.lr, "warmup_steps": schedule(cfg, r.steps)["warmup_steps"]}


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean and sd over the seeds of accuracy and loss, mean steps and tokens/s."""
    out: dict[str, float] = {}
    for key in ("eval/mlm_accuracy", "eval/loss"):
        out[f"{key}_mean"], out[f"{key}_sd"] = mean_sd([r[key] for r in rows])
    for key in ("steps", "tokens_per_s"):
        out[f"{key}_mean"] = float(np.mean([r[key] for r in rows]))
    return out


def print_mode(mode: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    what = (f"equal steps ({args.steps})" if mode == "steps"
            else f"equal wall clock ({args.budget_s:g} s)")
    print(f"\n{what}, trained at {args.mlm_probability:g} masking, evaluated at "
          f"{EVAL_MLM_PROBABILITY:g} (mean +- sd over seeds {args.seeds}):")
    print("| model | mlm accuracy | loss | steps | tokens seen | tokens/s | params |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in results.items():
        first = m["seeds"][0]
        print(f"| {name} | {m['eval/mlm_accuracy_mean']:.4f} +- {m['eval/mlm_accuracy_sd']:.4f} "
              f"| {m['eval/loss_mean']:.4f} +- {m['eval/loss_sd']:.4f} | "
              f"{m['steps_mean']:,.0f} | {first['tokens_seen']:,} | {m['tokens_per_s_mean']:,.0f} "
              f"| {first['parameters']:,} |")
    first = next(iter(results.values()))["seeds"][0]
    print(f"most-frequent-token baseline accuracy {first['eval/baseline_accuracy']:.4f} on "
          f"{int(first['eval/masked_tokens']):,} masked tokens")


def downstream(name: str, r: Result, cfg: PipelineConfig, tok: TokenizerManifest,
               what: str) -> dict[str, float]:
    """The downstream protocol (`mlm_pipeline.evaluate`) on one trained model: the linear
    probe beside its controls, and with `full` fine-tuning pretrained vs from scratch, on
    the config's tasks (`linear_probe`, `finetune`); the same code for ours and the peers."""
    from mlm_pipeline.evaluate import hugging_face, ours, run_finetune, run_probe
    from mlm_pipeline.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tok)
    encoder = (ours(r.model, tokenizer) if name.startswith("ours-")
               else hugging_face(r.model.model, tokenizer))
    result = run_probe(cfg.linear_probe, encoder)
    if what == "full":
        result.update(run_finetune(cfg.finetune, cfg.linear_probe, encoder))
    for tag, reason in result.tags.items():
        if tag.startswith("unavailable."):
            print(f"{name}: {tag}: {reason}", flush=True)
    return result.metrics


def print_downstream(results: dict[str, dict[str, float]]) -> None:
    print("\ndownstream (first task; first seed, equal steps): test accuracy")
    print("| model | probe | probe, random init | fine-tuned | from scratch | "
          "pretrained - scratch [95 %] | TF-IDF whole / same input | majority |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def f(m: dict[str, float], key: str, sd: bool = False) -> str:
        if key not in m:
            return "-"
        return f"{m[key]:.4f}" + (f" +- {m[key + '_sd']:.4f}" if sd and key + "_sd" in m else "")

    for name, m in results.items():
        interval = (f" [{m['finetune/diff_ci95_low']:+.4f}, {m['finetune/diff_ci95_high']:+.4f}]"
                    if "finetune/diff_ci95_low" in m else "")
        diff = f"{m['finetune/diff']:+.4f}{interval}" if "finetune/diff" in m else "-"
        print(f"| {name} | {f(m, 'probe/accuracy')} | {f(m, 'probe/accuracy_random_init', True)} "
              f"| {f(m, 'finetune/accuracy', True)} | {f(m, 'finetune/scratch_accuracy', True)} "
              f"| {diff} | {f(m, 'probe/tfidf_accuracy')} / "
              f"{f(m, 'probe/tfidf_accuracy_same_input')} | {f(m, 'probe/majority_accuracy')} |")


if __name__ == "__main__":
    sys.exit(main())
