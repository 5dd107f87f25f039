"""Peak learning rate and warm-up of a model preset, swept at equal steps: what `lr: auto`
should be, from data.

    python benchmarks/sweep_lr.py [--config tiny] [--preset bert] [--steps 1000]
                                  [--lrs 1e-4,3e-4,5e-4,1e-3] [--warmups 0.06]
                                  [--seeds 0,1] [--threads 2] [--work DIR] [--out FILE]
                                  [--set KEY=VALUE ...]

Smoke test: `--smoke` (seconds, offline: `bench_learning.py`'s smoke data and toy shape, two
learning rates, one seed, 3 steps).

Every run is our `train()` (the pipeline's training stage, through `bench_learning.run_ours`
with `--steps`: exactly N optimizer steps, the config's schedule and masking) on the
config's data (ingest, tokenizer, shards: cached by digest under `--work`), with
`model.preset` set to `--preset`, `train.lr` to each rate, `train.warmup_ratio` to each
warm-up share and `train.seed` and `masking.seed` to each seed (initialisation, data order
and masks). Each trained model is evaluated as the pipeline's final evaluation does
(`evaluate.stage.eval_masking`: the config's masking selection at `eval.mlm_probability`,
15 %, keyed by `eval.seed`) on every validation row. Printed and written as JSON: each run's
masked accuracy, loss and final training loss, and per (lr, warm-up) the mean and sd over
the seeds, beside the most-frequent-token baseline. Learning figures do not depend on the
machine's load; times do (not reported).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_learning  # noqa: E402  (the benchmark's data, shapes and training of ours)

from mlm_pipeline.config_files import load_config  # noqa: E402
from mlm_pipeline.evaluate.stage import (  # noqa: E402
    eval_masking,
    masked_lm_metrics,
    most_frequent_token,
)
from mlm_pipeline.evaluate.stats import mean_sd  # noqa: E402
from mlm_pipeline.tokenizer import Tokenizer  # noqa: E402
from mlm_pipeline.train.data import ShardDataset  # noqa: E402
from mlm_pipeline.train.perf import resolve_precision  # noqa: E402


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; prints a table and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--preset", default="bert", choices=["bert", "modern"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lrs", type=floats, default=floats("1e-4,3e-4,5e-4,1e-3"))
    parser.add_argument("--warmups", type=floats, default=floats("0.06"),
                        help="train.warmup_ratio values (share of --steps)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--work", default=None, help="work_dir (default: the config's)")
    parser.add_argument("--out", default=None,
                        help="JSON results (default: WORK/sweep_lr/sweep_lr.json)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    extra: list[str] = []
    if args.smoke:
        bench_learning.SHAPE.update(bench_learning.SMOKE_SHAPE)
        args.steps, args.threads, args.lrs, seeds = 3, 1, [1e-4, 1e-3], [0]
        extra = bench_learning.SMOKE_OVERRIDES
        if not args.work:
            with tempfile.TemporaryDirectory(prefix="sweep-lr-smoke-") as tmp:
                args.work = tmp
                return sweep(args, seeds, extra)
    return sweep(args, seeds, extra)


def sweep(args: argparse.Namespace, seeds: list[int], extra: list[str]) -> int:
    """The sweep of `main` with its parsed arguments."""
    torch.set_num_threads(args.threads)
    base = ([f"work_dir={args.work}"] if args.work else []) + extra + args.set + [
        f"model.preset={args.preset}"]
    cfg = load_config(args.config, base)
    work = Path(cfg.work_dir).expanduser().resolve() / "sweep_lr"
    work.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(args.precision, torch.device("cpu"))
    tok, shards = bench_learning.prepare_data(cfg)
    validation = ShardDataset(shards, "validation")
    masking = eval_masking(cfg.eval, cfg.masking, shards, Tokenizer.load(tok))
    baseline = most_frequent_token(shards)
    print(f"{args.preset} on {args.config}: {shards.train.rows:,} train rows, "
          f"{shards.validation.rows:,} validation rows of {shards.seq_len}; {args.steps} "
          f"steps per run, precision {precision}, {args.threads} threads; eval at "
          f"{masking.mlm_probability:g} masking, training at "
          f"{cfg.masking.eval_probability:g}", flush=True)
    runs = []
    # Seeds outermost: a sweep stopped early still holds every rate at the first seeds.
    for seed in seeds:
        for warmup in args.warmups:
            for lr in args.lrs:
                run_cfg = load_config(args.config, base + [
                    f"train.lr={lr}", f"train.warmup_ratio={warmup}", "train.warmup_steps=null",
                    f"train.seed={seed}", f"masking.seed={seed}"])
                start = time.perf_counter()
                r = bench_learning.run_ours(run_cfg, args.preset, tok, shards, 0.0,
                                            args.threads, precision, work, args.steps)
                m = masked_lm_metrics(r.model, validation, masking=masking,
                                      batch_size=cfg.eval.batch_size, baseline_token=baseline)
                runs.append({"lr": lr, "warmup_ratio": warmup, "seed": seed, "steps": r.steps,
                             "eval/mlm_accuracy": m["eval/mlm_accuracy"],
                             "eval/loss": m["eval/loss"],
                             "eval/baseline_accuracy": m["eval/baseline_accuracy"],
                             "train/loss": r.final_loss, "wall_s": time.perf_counter() - start})
                print(f"lr {lr:g}, warm-up {warmup:g}, seed {seed}: accuracy "
                      f"{m['eval/mlm_accuracy']:.4f}, loss {m['eval/loss']:.4f} (train loss "
                      f"{r.final_loss:.4f}), {r.steps} steps", flush=True)
                del r
    print(f"\n| lr | warm-up | eval masked accuracy (mean +- sd over {len(seeds)} seeds) "
          "| eval loss | per seed |")
    print("|---:|---:|---:|---:|---|")
    table = []
    for warmup in args.warmups:
        for lr in args.lrs:
            group = [r for r in runs if r["lr"] == lr and r["warmup_ratio"] == warmup]
            acc = mean_sd([r["eval/mlm_accuracy"] for r in group])
            loss = mean_sd([r["eval/loss"] for r in group])
            table.append({"lr": lr, "warmup_ratio": warmup, "accuracy_mean": acc[0],
                          "accuracy_sd": acc[1], "loss_mean": loss[0], "loss_sd": loss[1]})
            per_seed = ", ".join(f"{r['eval/mlm_accuracy']:.4f}" for r in group)
            print(f"| {lr:g} | {warmup:g} | {acc[0]:.4f} +- {acc[1]:.4f} | "
                  f"{loss[0]:.3f} +- {loss[1]:.3f} | {per_seed} |")
    best = max(table, key=lambda row: row["accuracy_mean"])
    print(f"most-frequent-token baseline accuracy {runs[0]['eval/baseline_accuracy']:.4f}; "
          f"best: lr {best['lr']:g}, warm-up {best['warmup_ratio']:g}")
    out = Path(args.out) if args.out else work / "sweep_lr.json"
    out.write_text(json.dumps({"config": args.config, "preset": args.preset,
                               "steps": args.steps, "seeds": seeds, "overrides": args.set,
                               "precision": precision, "runs": runs, "table": table,
                               "best": best}, indent=2, default=_json) + "\n")
    print(f"results: {out}")
    return 0


def _json(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


if __name__ == "__main__":
    sys.exit(main())
