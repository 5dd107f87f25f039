"""Held-out masked accuracy at 15 % before and after removing training text from the
validation split: how much of the figure was memorised boilerplate.

    python benchmarks/bench_validation.py [--config tiny] [--steps 1000] [--threads 2]
                                          [--variants none,lines] [--work DIR] [--out FILE]
                                          [--set KEY=VALUE ...]

Smoke test: `--smoke` (seconds, offline: `bench_learning.py`'s smoke data and toy shape,
3 steps).

For each variant of `ingest.validation_dedup` (`none`: the split by document hash alone;
`lines`: validation lines found in training removed, `mlm_pipeline.ingest.overlap`), the
config's data stages are run (cached by digest under `--work`) and the manifest's
validation<->training word 13-gram overlap is read. The training split does not depend on
the variant (only validation lines are removed); when the variants' tokenizers and training
shards are byte-identical, which the script checks by sha256, one model (the config's recipe,
our `train()` for `--steps` steps, `bench_learning.run_ours`) is trained and evaluated on
each variant's validation rows; otherwise one model per variant. Evaluation is the
pipeline's final one (`evaluate.stage.eval_masking`: the config's selection at
`eval.mlm_probability`, 15 %, keyed by `eval.seed`) on every validation row, beside the
most-frequent-token baseline of the same positions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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
from mlm_pipeline.ingest.stage import ingest  # noqa: E402
from mlm_pipeline.tokenizer import Tokenizer  # noqa: E402
from mlm_pipeline.train.data import ShardDataset  # noqa: E402
from mlm_pipeline.train.perf import resolve_precision  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; prints a table and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--variants", default="none,lines",
                        help="ingest.validation_dedup values, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--work", default=None, help="work_dir (default: the config's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    extra: list[str] = []
    if args.smoke:
        bench_learning.SHAPE.update(bench_learning.SMOKE_SHAPE)
        args.steps, args.threads = 3, 1
        extra = bench_learning.SMOKE_OVERRIDES
        if not args.work:
            with tempfile.TemporaryDirectory(prefix="bench-validation-smoke-") as tmp:
                args.work = tmp
                return compare(args, extra)
    return compare(args, extra)


def compare(args: argparse.Namespace, extra: list[str]) -> int:
    """The comparison of `main` with its parsed arguments."""
    torch.set_num_threads(args.threads)
    precision = resolve_precision(args.precision, torch.device("cpu"))
    base = ([f"work_dir={args.work}"] if args.work else []) + extra + args.set
    data = {}
    for variant in args.variants.split(","):
        cfg = load_config(args.config, base + [f"ingest.validation_dedup={variant}"])
        corpus = ingest(cfg.ingest, cfg.work_dir)
        tok, shards = bench_learning.prepare_data(cfg)
        data[variant] = (cfg, corpus, tok, shards)
    work = Path(next(iter(data.values()))[0].work_dir).expanduser().resolve() / "bench_validation"
    work.mkdir(parents=True, exist_ok=True)
    same = len({train_identity(tok, shards) for _, _, tok, shards in data.values()}) == 1
    print(f"{args.config}, {args.steps} steps, precision {precision}: the variants' training "
          f"data are {'byte-identical: one model' if same else 'different: one model each'}",
          flush=True)
    models = {}
    for variant, (cfg, _, tok, shards) in data.items():
        if same and models:
            models[variant] = next(iter(models.values()))
            continue
        models[variant] = bench_learning.run_ours(
            cfg, cfg.model.preset or "modern", tok, shards, 0.0, args.threads, precision,
            work, args.steps).model
    rows = []
    for variant, (cfg, corpus, tok, shards) in data.items():
        masking = eval_masking(cfg.eval, cfg.masking, shards, Tokenizer.load(tok))
        m = masked_lm_metrics(models[variant], ShardDataset(shards, "validation"),
                              masking=masking, batch_size=cfg.eval.batch_size,
                              baseline_token=most_frequent_token(shards))
        o = corpus.validation_overlap
        rows.append({"validation_dedup": variant, "rate": masking.mlm_probability,
                     "validation_documents": corpus.documents_validation,
                     "validation_rows": shards.validation.rows,
                     "overlap_share": o.share if o else None,
                     "mostly_in_train": o.validation_documents_mostly_in_train if o else None,
                     **{k: m[k] for k in ("eval/mlm_accuracy", "eval/loss", "eval/top5_accuracy",
                                          "eval/baseline_accuracy", "eval/masked_tokens")}})
    print(f"\n| ingest.validation_dedup | validation docs / rows | 13-gram windows in train "
          f"| docs mostly training text | masked accuracy at {rows[0]['rate']:g} | loss | "
          "top-5 | baseline | masked tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = "-" if r["overlap_share"] is None else f"{100 * r['overlap_share']:.1f} %"
        print(f"| {r['validation_dedup']} | {r['validation_documents']} / "
              f"{r['validation_rows']} | {share} | {r['mostly_in_train']} | "
              f"{r['eval/mlm_accuracy']:.4f} | {r['eval/loss']:.4f} | "
              f"{r['eval/top5_accuracy']:.4f} | {r['eval/baseline_accuracy']:.4f} | "
              f"{int(r['eval/masked_tokens']):,} |")
    out = Path(args.out) if args.out else work / "bench_validation.json"
    out.write_text(json.dumps({"config": args.config, "steps": args.steps, "one_model": same,
                               "overrides": args.set, "rows": rows}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


def train_identity(tok, shards) -> tuple[str, ...]:
    """What a model trained on these data depends on: the tokenizer model's and the
    training shards' sha256."""
    return (tok.model.sha256, *(s.sha256 for s in shards.train.shards))


if __name__ == "__main__":
    sys.exit(main())
