"""One training step, ours against Hugging Face `BertForMaskedLM` / `ModernBertForMaskedLM`,
and ours across attention layouts at seq_len 128, 512 and 1,024.

    python benchmarks/bench_train.py [--rounds 5] [--steps 3] [--pairs modern-fp32,...]
                                     [--fused] [--profile modern-bf16]
                                     [--attention 128,512,1024] [--docs debian|short|both]
    python benchmarks/bench_train.py --smoke     # every pair at a toy shape, one step, seconds
    python benchmarks/bench_train.py --pairs none --attention 128,512,1024   # layouts only

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

Attention layouts (`--attention`, after the pairs): our `modern` preset at the same shape,
fp32, batch 4,096 / L rows (32 at 128, 8 at 512, 4 at 1,024: the same tokens per step),
on rows packed from documents whose lengths are drawn from `--docs`: `debian` = log-normal
with median 273 tokens and sigma 1.2 (what the `tiny` config's `debian:fr` shards hold
under its 8,000-piece tokenizer: median 273, mean 568, p90 1,085), `short` = median 40,
sigma 0.8 (sentence- or post-sized documents), `both` = one table each. Variants:

- `global, no documents`: every layer global, no document ids: the mask-free step (SDPA's
  fastest path), the reference of every ratio;
- `documents, dense mask`: document ids through the dense (B, 1, L, L) boolean mask
  (`kernel="dense"`: the path document attention took before this kernel, and the cost
  it had);
- `documents`: document ids through the default kernel (`kernel="auto"`: block-diagonal
  batching on this CPU);
- `sliding window, no documents` and `sliding window + documents`: ModernBERT's layout (a
  global layer every 3rd, 128-token window; `global_every=3` with 4 layers: layers 0 and 3
  global), default kernel.

Each row prints tokens/s, the share of the measured matmul peak (FLOPs of the reference's
formula, `flops_per_token(L)` of the all-global model, so the shares compare wall time),
and the ratio of its step time to the reference's (< 1 = faster). The targets: documents
<= 1.05x the reference at 128 and below the dense mask at every length; the sliding window
below all-global at 1,024.

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
from mlm_pipeline.train.model import BertMLM, document_ids_from_sep
from mlm_pipeline.train.perf import measure_cpu_matmul_flops

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ_LEN, BATCH = 256, 4, 4, 1024, 16000, 128, 32
#: `--smoke`: the same pairs at a toy shape (hidden 32, 2 layers, vocab 512, seq_len 16,
#: batch 4), one round of one step, one thread, a 128 x 128 peak matmul.
SMOKE_SHAPE = {"HIDDEN": 32, "LAYERS": 2, "HEADS": 2, "FFN": 64, "VOCAB": 512, "SEQ_LEN": 16,
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
        self.tokens = BATCH * SEQ_LEN  # per step
        self.rates: list[float] = []
        self.i = 0

    def step(self) -> None:
        input_ids, labels = self.batches[self.i % len(self.batches)]
        self.i += 1
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16
               else contextlib.nullcontext())
        with ctx:
            loss = self.model(input_ids=input_ids, labels=labels).loss
        self.update(loss)

    def update(self, loss: torch.Tensor) -> None:
        """Backward and one optimizer step."""
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.rates.append(steps * self.tokens / (time.perf_counter() - start))


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


#: `--docs`: (median tokens, sigma) of the log-normal document lengths (module docstring).
DOC_LENGTHS = {"debian": (273.0, 1.2), "short": (40.0, 0.8)}
#: Tokens per step of the attention table (batch = this / L).
ATTENTION_TOKENS = 4096
#: The attention table's variants: (name, model config overrides, documents, kernel).
VARIANTS = (
    ("global, no documents", {"global_every": 1}, False, "auto"),
    ("documents, dense mask", {"global_every": 1}, True, "dense"),
    ("documents", {"global_every": 1}, True, "auto"),
    ("sliding window, no documents", {"global_every": 3}, False, "auto"),
    ("sliding window + documents", {"global_every": 3}, True, "auto"),
)


def packed_rows(batch: int, seq_len: int, docs: str, seed: int) -> torch.Tensor:
    """int64 (batch, seq_len) rows packed as the shards stage packs them: [CLS] then a
    stream of documents, each ordinary ids followed by [SEP], cut into rows; document
    lengths log-normal (`DOC_LENGTHS[docs]`), at least 1 token."""
    median, sigma = DOC_LENGTHS[docs]
    g = torch.Generator().manual_seed(seed)
    need = batch * (seq_len - 1)
    stream: list[torch.Tensor] = []
    total = 0
    while total < need:
        n = max(1, int(median * float(torch.exp(sigma * torch.randn((), generator=g)))))
        stream.append(torch.cat([torch.randint(NUM_SPECIAL, VOCAB, (n,), generator=g),
                                 torch.tensor([3])]))
        total += n + 1
    body = torch.cat(stream)[:need].view(batch, seq_len - 1)
    return torch.cat([torch.full((batch, 1), 2), body], dim=1)


class AttentionRunner(Runner):
    """A `Runner` of one attention variant: its rows carry document ids when asked."""

    def __init__(self, name: str, model: torch.nn.Module, batches: list, documents: bool,
                 tokens: int) -> None:
        super().__init__(name, model, batches, bf16=False, fused=True)
        self.documents, self.tokens = documents, tokens

    def step(self) -> None:
        input_ids, labels, document_ids = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.update(self.model(input_ids, labels=labels,
                               document_ids=document_ids if self.documents else None).loss)


def attention_table(seq_len: int, docs: str, rounds: int, steps: int, peak: float) -> None:
    """Time every `VARIANTS` entry at `seq_len` in alternating rounds; print the table."""
    batch = max(1, ATTENTION_TOKENS // seq_len)
    raw = [packed_rows(batch, seq_len, docs, seed) for seed in range(2)]
    batches = [(*mask_tokens(r, vocab_size=VOCAB, seed=s, mlm_probability=MLM_PROBABILITY),
                document_ids_from_sep(r)) for s, r in enumerate(raw)]
    runners = []
    for name, overrides, documents, kernel in VARIANTS:
        cfg = ModelConfig(preset="modern", hidden_size=HIDDEN, num_layers=LAYERS,
                          num_heads=HEADS, intermediate_size=FFN, **overrides)
        torch.manual_seed(0)
        model = BertMLM(cfg, vocab_size=VOCAB, seq_len=seq_len, attention_kernel=kernel)
        runners.append(AttentionRunner(name, model, batches, documents, batch * seq_len))
    reference_flops = runners[0].model.flops_per_token(seq_len, MLM_PROBABILITY)
    for r in runners:
        r.step()
        r.step()
    for _ in range(rounds):
        for r in runners:
            r.timed(steps)
    seps = sum(int((b[2][:, -1]).sum()) for b in batches) / (len(batches) * batch)
    medians = [statistics.median(r.rates) for r in runners]
    print(f"\nattention, seq_len {seq_len}, batch {batch}, {docs} documents "
          f"({seps:.1f} document boundaries a row; {rounds} rounds x {steps} steps, "
          f"median tokens/s)")
    for r, m in zip(runners, medians):
        spread = f"{min(r.rates):,.0f}..{max(r.rates):,.0f}"
        print(f"  {r.name:<30} {m:>9,.0f} tokens/s  ({spread})  "
              f"{m * reference_flops / peak:5.1%} of peak  step time "
              f"{medians[0] / m:.2f}x the reference")


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
    parser.add_argument("--attention", default="128,512,1024",
                        help="seq_lens of the attention table ('none': skip it)")
    parser.add_argument("--docs", choices=[*DOC_LENGTHS, "both"], default="both",
                        help="document lengths of the attention table's rows")
    parser.add_argument("--smoke", action="store_true",
                        help="every pair at a toy shape, one step, one thread: seconds")
    args = parser.parse_args()
    peak_n = 1024
    if args.smoke:
        globals().update(SMOKE_SHAPE)
        args.rounds, args.steps, args.threads, peak_n = 1, 1, 1, 128
        args.attention, args.docs = "64,256", "short"
        globals()["ATTENTION_TOKENS"] = 256
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
    for pair in [p for p in args.pairs.split(",") if p != "none"]:
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
    if args.attention != "none":
        for docs in (DOC_LENGTHS if args.docs == "both" else [args.docs]):
            for seq_len in (int(n) for n in args.attention.split(",")):
                attention_table(seq_len, docs, args.rounds, args.steps, peak["fp32"])


if __name__ == "__main__":
    main()
