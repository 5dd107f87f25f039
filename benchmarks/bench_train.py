"""One training step, ours against Hugging Face `BertForMaskedLM` / `ModernBertForMaskedLM`.

    python benchmarks/bench_train.py [--rounds 5] [--steps 3] [--pairs modern-fp32,...]
                                     [--fused] [--profile modern-bf16]
    python benchmarks/bench_train.py --smoke     # every pair at a toy shape, one step, seconds

Shape (the same for every model): hidden 256, 4 layers, 4 heads, FFN 1024, vocab 16,000,
seq_len 128, batch 32, 2 CPU threads. A step is forward + backward + AdamW step (lr 1e-4,
weight decay 0.01, the same optimizer settings for both sides; `--fused` uses
`AdamW(fused=True)`, else torch's default, foreach). Masking (mlm_probability 0.15,
Bernoulli, 80/10/10) is done before timing for both sides: ours with
`mlm_pipeline.masking.keyed.mask_tokens`, Hugging Face's with a copy of
`DataCollatorForLanguageModeling.torch_mask_tokens`; no attention mask (packed rows).

Pairs:
- `modern-fp32`, `modern-bf16`: our `modern` preset (pre-LN, RoPE, GeGLU, no biases, no
  dropout) vs `ModernBertForMaskedLM` at the same architecture (global attention in every
  layer, rope theta 10,000, `sparse_prediction=True`, SDPA, no dropout); bf16 = CPU
  autocast `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward.
- `bert-fp32`: our `bert` preset (post-LN, learned positions, GELU, biases, dropout 0.1)
  vs `BertForMaskedLM` (SDPA, dropout 0.1).

Models of a pair are timed in alternating rounds (ours, HF, ours, HF, ...) and each side's
median over rounds is reported, so load from other processes hits both sides alike. FLOP/s
use one formula for every model, `BertMLM.flops_per_token(128, 0.15)` of ours at the
matching shape (Hugging Face BERT's full-vocabulary head does more work than it is
credited with: that is the point of comparing), as a fraction of the measured matmul peak
(`measure_cpu_matmul_flops`) at the dtype of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from mlm_pipeline.config import NUM_SPECIAL, ModelConfig
from mlm_pipeline.masking.keyed import mask_tokens
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.perf import measure_cpu_matmul_flops

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ_LEN, BATCH = 256, 4, 4, 1024, 16000, 128, 32
#: `--smoke`: the same pairs at a toy shape (hidden 32, 1 layer, vocab 512, seq_len 16,
#: batch 4), one round of one step, one thread, a 128 x 128 peak matmul.
SMOKE_SHAPE = {"HIDDEN": 32, "LAYERS": 1, "HEADS": 2, "FFN": 64, "VOCAB": 512, "SEQ_LEN": 16,
               "BATCH": 4}
MLM_PROBABILITY = 0.15
PAIRS = ("modern-fp32", "modern-bf16", "bert-fp32")


def rows(seed: int) -> torch.Tensor:
    """int64 (BATCH, SEQ_LEN) packed rows: [CLS] ordinary ids ... [SEP]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(NUM_SPECIAL, VOCAB, (BATCH, SEQ_LEN), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    return ids


def hf_mask(input_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`DataCollatorForLanguageModeling.torch_mask_tokens` (transformers 4.x/5.x) with the
    special-token ids [0, NUM_SPECIAL) and default 80/10/10."""
    g = torch.Generator().manual_seed(seed)
    labels = input_ids.clone()
    inputs = input_ids.clone()
    probability_matrix = torch.full(labels.shape, MLM_PROBABILITY)
    probability_matrix.masked_fill_(input_ids < NUM_SPECIAL, value=0.0)
    masked = torch.bernoulli(probability_matrix, generator=g).bool()
    labels[~masked] = -100
    replaced = torch.bernoulli(torch.full(labels.shape, 0.8), generator=g).bool() & masked
    inputs[replaced] = 4
    random = (torch.bernoulli(torch.full(labels.shape, 0.5), generator=g).bool()
              & masked & ~replaced)
    inputs[random] = torch.randint(VOCAB, labels.shape, generator=g)[random]
    return inputs, labels


def ours(preset: str) -> BertMLM:
    cfg = ModelConfig(preset=preset, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                      intermediate_size=FFN)
    return BertMLM(cfg, vocab_size=VOCAB, seq_len=SEQ_LEN)


def hf_modern():
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ_LEN,
        layer_types=["full_attention"] * LAYERS, global_rope_theta=10000.0,
        pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3,
        embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0,
        sparse_prediction=True, attn_implementation="sdpa",
    )
    return ModernBertForMaskedLM(cfg)


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ_LEN,
        pad_token_id=0, attn_implementation="sdpa",
    )
    return BertForMaskedLM(cfg)


class Runner:
    """A model, its optimizer, pre-masked batches and the step timer."""

    def __init__(self, name: str, model: torch.nn.Module, batches: list, bf16: bool,
                 fused: bool) -> None:
        self.name, self.model, self.batches = name, model.train(), batches
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                     fused=fused or None)
        self.bf16 = bf16
        self.rates: list[float] = []
        self.i = 0

    def step(self) -> None:
        input_ids, labels = self.batches[self.i % len(self.batches)]
        self.i += 1
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16
               else contextlib.nullcontext())
        with ctx:
            loss = self.model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.rates.append(steps * BATCH * SEQ_LEN / (time.perf_counter() - start))


def build_pair(pair: str, fused: bool) -> list[Runner]:
    preset, precision = pair.split("-")
    bf16 = precision == "bf16"
    raw = [rows(seed) for seed in range(4)]
    our_batches = [mask_tokens(r, vocab_size=VOCAB, seed=s, mlm_probability=MLM_PROBABILITY)
                   for s, r in enumerate(raw)]
    hf_batches = [hf_mask(r, s) for s, r in enumerate(raw)]
    torch.manual_seed(0)
    hf = hf_modern() if preset == "modern" else hf_bert()
    return [Runner(f"ours {preset}", ours(preset), our_batches, bf16, fused),
            Runner(f"HF {type(hf).__name__}", hf, hf_batches, bf16, fused)]


def profile(pair: str, fused: bool) -> None:
    """Print the top operators (self CPU time) of 3 steps of each model of `pair`."""
    for runner in build_pair(pair, fused):
        for _ in range(2):
            runner.step()
        with torch.profiler.profile() as prof:
            for _ in range(3):
                runner.step()
        print(f"\n{runner.name}, {pair}, 3 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    parser.add_argument("--profile", choices=PAIRS, help="profile this pair, exit")
    parser.add_argument("--smoke", action="store_true",
                        help="every pair at a toy shape, one step, one thread: seconds")
    args = parser.parse_args()
    peak_n = 1024
    if args.smoke:
        globals().update(SMOKE_SHAPE)
        args.rounds, args.steps, args.threads, peak_n = 1, 1, 1, 128
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.profile, args.fused)
        return

    peak = {"fp32": measure_cpu_matmul_flops(torch.float32, n=peak_n),
            "bf16": measure_cpu_matmul_flops(torch.bfloat16, n=peak_n)}
    flops_per_token = {p: ours(p).flops_per_token(SEQ_LEN, MLM_PROBABILITY)
                       for p in ("modern", "bert")}
    print(f"threads {torch.get_num_threads()}, AdamW fused={args.fused}; matmul peak "
          f"fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s")
    for pair in args.pairs.split(","):
        preset, precision = pair.split("-")
        runners = build_pair(pair, args.fused)
        for r in runners:  # warm-up: allocator, oneDNN primitive caches, optimizer state
            r.step()
            r.step()
        for _ in range(args.rounds):
            for r in runners:
                r.timed(args.steps)
        medians = [statistics.median(r.rates) for r in runners]
        print(f"\n{pair}  ({args.rounds} rounds x {args.steps} steps, median tokens/s)")
        for r, m in zip(runners, medians):
            frac = m * flops_per_token[preset] / peak[precision]
            spread = f"{min(r.rates):,.0f}..{max(r.rates):,.0f}"
            print(f"  {r.name:<28} {m:>9,.0f} tokens/s  ({spread})  "
                  f"{m * flops_per_token[preset] / 1e9:6.1f} GFLOP/s = {frac:5.1%} of peak")
        print(f"  ratio ours/HF {medians[0] / medians[1]:.2f}x")


if __name__ == "__main__":
    main()
