"""MLM masking throughput against Hugging Face `DataCollatorForLanguageModeling`.

    python benchmarks/bench_masking.py [--work DIR] [--batch-sizes 32,256] [--repeats 9]
        [--layout sentencepiece|bert]
    python benchmarks/bench_masking.py --smoke      # batch 4, one round of 2 calls, seconds

Both sides corrupt the same batches of token ids on the CPU with one thread
(`torch.set_num_threads(1)`), at mlm_probability 0.15 and 80/10/10:

- HF: `DataCollatorForLanguageModeling.torch_mask_tokens(ids.clone(), special_tokens_mask)`
  with a seeded `torch.Generator` and the special-tokens mask precomputed outside the
  timing (its `torch_call` would build it with a Python loop per row; the `clone` stays in,
  because the collator overwrites its input). HF's whole-word masking needs a fast
  tokenizer's offset mapping, so our whole-word modes are compared with its token mode.
- ours: `mlm_pipeline.masking.keyed.mask_tokens` (keyed randomness) with `bernoulli`, `exact_k`,
  and whole-word selection with both, each call with new global row ids (as in training,
  so that the masks differ from call to call like HF's).

Data: with `--work DIR`, rows of the newest shards under `DIR/shards/` (with the special
ids they were written with) and the word starts of a tokenizer under `DIR/tokenizer/` with
the same vocabulary; otherwise (said in the output) synthetic rows: Zipf-distributed ids
(exponent 1.1, V = 32000, fixed seed) packed as [CLS] doc [SEP] doc [SEP] ..., and word
starts drawn at random (share 0.6). `--layout bert` moves the synthetic rows' special
ids to BERT's ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103: not a prefix of the
vocabulary, so masking looks them up in tables).

Each figure is the median over `--repeats` rounds of `--calls` calls (after a warm-up);
the methods take turns inside each round so that background load hits them alike. The
tokens/s count every position of the batch (B * L), as HF's collator would see them.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DataCollatorForLanguageModeling

from mlm_pipeline.config import (
    NUM_SPECIAL,
    SENTENCEPIECE_SPECIAL_IDS,
    SPECIAL_TOKENS,
    SpecialIds,
)
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest, read_manifest
from mlm_pipeline.masking.keyed import mask_tokens

MLM_PROBABILITY = 0.15
SYNTHETIC_VOCAB = 32000
#: BERT's special ids (`--layout bert`), and the swap that moves ours (0-4) there.
BERT_SPECIAL_IDS = SpecialIds(pad_id=0, unk_id=100, cls_id=101, sep_id=102, mask_id=103,
                              all_special_ids=(0, 100, 101, 102, 103))
_TO_BERT = {1: 100, 2: 101, 3: 102, 4: 103}


def to_bert_layout(ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows and word starts with our special ids 1-4 swapped with ids 100-103."""
    perm = np.arange(len(starts))
    for ours, bert in _TO_BERT.items():
        perm[ours], perm[bert] = bert, ours
    return perm[ids], starts[perm]


class MinimalTokenizer:
    """What `DataCollatorForLanguageModeling.torch_mask_tokens` uses of a tokenizer."""

    mask_token = "[MASK]"
    pad_token = "[PAD]"
    is_fast = False

    def __init__(self, vocab_size: int,
                 special_ids: SpecialIds = SENTENCEPIECE_SPECIAL_IDS) -> None:
        self.vocab_size = vocab_size
        self.special_ids = special_ids

    def __len__(self) -> int:
        return self.vocab_size

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.special_ids.roles()[token]


def newest_manifest(work: Path, stage: str) -> list[Path]:
    """Manifests of `stage` under `work`, newest first."""
    found = list((work / stage).glob("*/manifest.json"))
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def load_data(work: str | None, rows_needed: int
              ) -> tuple[np.ndarray, np.ndarray, int, str, SpecialIds]:
    """(rows (N, L) int64, word_starts (V,) bool, vocab_size, description, special ids)."""
    if work is not None:
        from mlm_pipeline.shards.format import open_shard
        from mlm_pipeline.tokenizer import Tokenizer

        paths = newest_manifest(Path(work), "shards")
        if not paths:
            raise SystemExit(f"no shards/*/manifest.json under {work}")
        shards = read_manifest(paths[0], ShardManifest)
        parts, have = [], 0
        for entry in shards.train.shards:
            part = open_shard(shards.file(entry.path))
            parts.append(np.asarray(part, dtype=np.int64))
            have += len(part)
            if have >= rows_needed:
                break
        rows = np.concatenate(parts)
        if len(rows) < rows_needed:  # a small corpus: repeat its rows
            rows = np.resize(rows, (rows_needed, rows.shape[1]))
        word_starts, source = None, "synthetic word starts (no tokenizer of this vocabulary)"
        for path in newest_manifest(Path(work), "tokenizer"):
            tok = read_manifest(path, TokenizerManifest)
            if tok.vocab_size == shards.vocab_size:
                word_starts = Tokenizer.load(tok).word_starts()
                source = f"word starts of {path.parent}"
                break
        if word_starts is None:
            word_starts = synthetic_word_starts(shards.vocab_size)
        return (rows[:rows_needed], word_starts, shards.vocab_size,
                f"shards {paths[0].parent} (seq_len {shards.seq_len}), {source}",
                shards.special_ids)
    return (synthetic_rows(rows_needed, 128), synthetic_word_starts(SYNTHETIC_VOCAB),
            SYNTHETIC_VOCAB, "SYNTHETIC rows: Zipf ids (s = 1.1, V = 32000, seed 0), "
            "documents of 20-300 tokens, random word starts (share 0.6)",
            SENTENCEPIECE_SPECIAL_IDS)


def synthetic_rows(n_rows: int, seq_len: int) -> np.ndarray:
    """Packed rows of Zipf-distributed ordinary ids, [CLS] first, [SEP] after documents."""
    rng = np.random.default_rng(0)
    ranks = np.arange(1, SYNTHETIC_VOCAB - NUM_SPECIAL + 1)
    weights = ranks**-1.1
    ids = rng.choice(ranks, size=(n_rows, seq_len), p=weights / weights.sum()) - 1
    ids += NUM_SPECIAL
    for row in ids:
        pos = int(rng.integers(20, 300))
        while pos < seq_len:
            row[pos] = SPECIAL_TOKENS["[SEP]"]
            pos += int(rng.integers(20, 300))
    ids[:, 0] = SPECIAL_TOKENS["[CLS]"]
    return ids.astype(np.int64)


def synthetic_word_starts(vocab_size: int) -> np.ndarray:
    starts = np.random.default_rng(1).random(vocab_size) < 0.6
    starts[:NUM_SPECIAL] = True
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="pipeline work dir with shards/ (and tokenizer/)")
    parser.add_argument("--batch-sizes", default="32,256")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per round (default: about 2**20 tokens per round)")
    parser.add_argument("--layout", choices=["sentencepiece", "bert"], default="sentencepiece",
                        help="special ids of the synthetic rows (ours 0-4, or BERT's)")
    parser.add_argument("--smoke", action="store_true",
                        help="batch size 4, one round of 2 calls: the table in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.repeats, args.calls = "4", 1, 2

    torch.set_num_threads(1)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    pool = 8  # distinct batches cycled through
    rows, starts_np, vocab_size, source, special_ids = load_data(args.work,
                                                                 pool * max(batch_sizes))
    if args.layout == "bert" and args.work is None:
        rows, starts_np = to_bert_layout(rows, starts_np)
        special_ids, source = BERT_SPECIAL_IDS, source + ", BERT's special ids"
    seq_len = rows.shape[1]
    word_starts = torch.from_numpy(np.asarray(starts_np, dtype=bool))
    print(f"data: {source}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
          f"vocab_size {vocab_size}, seq_len {seq_len}, mlm_probability {MLM_PROBABILITY}")

    collator = DataCollatorForLanguageModeling(
        MinimalTokenizer(vocab_size, special_ids), mlm_probability=MLM_PROBABILITY,
        mask_replace_prob=0.8, random_replace_prob=0.1, return_tensors="pt",
    )
    collator.generator = torch.Generator().manual_seed(0)

    print(f"{'B':>5} {'method':<22} {'M tokens/s':>11} {'us/call':>9} {'vs HF':>7}")
    for batch in batch_sizes:
        batches = [torch.from_numpy(rows[i * batch:(i + 1) * batch].copy()) for i in range(pool)]
        specials = torch.tensor(special_ids.all_special_ids)
        special = [torch.isin(b, specials) for b in batches]
        calls = args.calls or max(4, (1 << 20) // (batch * seq_len))
        counter = [0]

        def ours(selection: str, whole_word: bool):
            def call(i: int) -> None:
                counter[0] += 1
                mask_tokens(batches[i], vocab_size=vocab_size, seed=0, epoch=0,
                            row_index=torch.arange(batch) + counter[0] * batch,
                            mlm_probability=MLM_PROBABILITY, selection=selection,
                            word_starts=word_starts if whole_word else None,
                            special_ids=special_ids)
            return call

        def hf(i: int) -> None:
            collator.torch_mask_tokens(batches[i].clone(), special_tokens_mask=special[i])

        methods = {
            "HF DataCollatorForLM": hf,
            "ours bernoulli": ours("bernoulli", False),
            "ours exact_k": ours("exact_k", False),
            "ours whole-word": ours("bernoulli", True),
            "ours whole-word exact_k": ours("exact_k", True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for name, fn in methods.items():  # warm-up
            for i in range(pool):
                fn(i)
        for _ in range(args.repeats):
            for name, fn in methods.items():
                start = time.perf_counter()
                for c in range(calls):
                    fn(c % pool)
                seconds[name].append((time.perf_counter() - start) / calls)
        per_call = {name: statistics.median(s) for name, s in seconds.items()}
        hf_s = per_call["HF DataCollatorForLM"]
        for name, s in per_call.items():
            print(f"{batch:>5} {name:<22} {batch * seq_len / s / 1e6:>11.1f} "
                  f"{s * 1e6:>9.0f} {hf_s / s:>6.2f}x")


if __name__ == "__main__":
    main()
