"""Checkpoint size and save time of the base recipes, through the real `Checkpointer`.

    python benchmarks/bench_checkpoint.py [--recipes bert-base,modern-base] [--dir DIR]
    python benchmarks/bench_checkpoint.py --smoke     # the tiny recipe at a toy size, seconds

Each recipe's model is instantiated on the CPU (fp32 weights, the recipe's init), AdamW is
given its state by one step on zero gradients (exp_avg and exp_avg_sq: two more fp32 copies
of the weights, as in any checkpoint after step 1), and the run's Stateful parts (model,
optimizer, LR schedule, RNG, train state, data cursor, masker, meter) are saved once by
`Checkpointer.save`: safetensors weights, `torch.save` of the optimizer, every file
fsynced and hashed (sha256), `state.json` last, an atomic rename. Prints the size of each
file (MiB = 2**20 bytes) and the wall time of the save (s), which includes the sha256 pass.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mlm_pipeline.config_files import load_config
from mlm_pipeline.masking.maskers import DynamicMasker, KeyedMasking
from mlm_pipeline.train.checkpoint import Checkpointer, RngState
from mlm_pipeline.train.data import RowCursor
from mlm_pipeline.train.loop import TrainState
from mlm_pipeline.train.meter import Meter
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.perf import adamw_impl
from mlm_pipeline.train.schedule import build_lr_scheduler


#: `--smoke`: the `tiny` recipe shrunk to a toy model (same code path, seconds).
SMOKE_OVERRIDES = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
                   "model.intermediate_size=64", "tokenizer.vocab_size=128"]


def save_once(name: str, root: Path, overrides: list[str] | None = None) -> dict:
    """Instantiate recipe `name` (with dotted `overrides`) on the CPU and save it once;
    return sizes and time."""
    cfg = load_config(name, overrides or [])
    torch.manual_seed(0)
    start = time.perf_counter()
    model = BertMLM(cfg.model, cfg.tokenizer.vocab_size, cfg.shards.seq_len)
    init_s = time.perf_counter() - start
    cpu = torch.device("cpu")
    opt = torch.optim.AdamW(model.param_groups(cfg.train.weight_decay), lr=cfg.train.lr,
                            betas=cfg.train.betas, eps=cfg.train.eps, **adamw_impl(cpu))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    parts = {
        "model": model, "optimizer": opt, "lr_scheduler": build_lr_scheduler(opt, cfg.train),
        "rng": RngState(), "train_state": TrainState(step=1),
        "cursor": RowCursor(100_000, cfg.train.micro_batch_size, cfg.train.seed),
        "masker": DynamicMasker(KeyedMasking(cfg.masking, cfg.tokenizer.vocab_size)),
        "meter": Meter(cpu, 4096 * cfg.shards.seq_len, 1.0, None),
    }
    ckpt = Checkpointer(root / name, parts, {"recipe": name})
    start = time.perf_counter()
    out = ckpt.save(1)
    save_s = time.perf_counter() - start
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    return {"recipe": name, "parameters": model.num_parameters(), "init_s": init_s,
            "save_s": save_s, "files": files, "total_bytes": sum(files.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="bert-base,modern-base")
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary dir)")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny recipe at a toy size (hidden 32, vocab 128): seconds")
    args = ap.parse_args()
    recipes = "tiny" if args.smoke else args.recipes
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in recipes.split(","):
            r = save_once(name, Path(tmp), SMOKE_OVERRIDES if args.smoke else None)
            sizes = ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in r["files"].items())
            print(f"{name}: {r['parameters']:,} parameters, init {r['init_s']:.1f} s; "
                  f"checkpoint {r['total_bytes'] / 2**20:,.1f} MiB ({sizes} MiB), "
                  f"save {r['save_s']:.2f} s")


if __name__ == "__main__":
    main()
