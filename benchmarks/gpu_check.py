"""A GPU check in one command: the `gpu` tests, the base recipes' training step next to
Hugging Face's, and 300 tiny training steps, written to one JSON and one markdown table.

    python benchmarks/gpu_check.py --out gpu-check/ [--shards carry/]      # on the GPU
    python benchmarks/gpu_check.py --prepare-shards carry/                 # on a CPU machine
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check          # CPU, seconds

Needs only torch, transformers, sentencepiece, pyarrow, numpy and this checkout (plus
pydantic and pyyaml, which the library's configs use): no Prefect, MLflow or network. The
check fails if importing the library pulls in `prefect` or `mlflow`.

1. `gpu` tests: every `@pytest.mark.gpu` test (CUDA vs CPU masking, bf16 autocast, fused
   AdamW, the compiled static head), through pytest if installed, else as plain functions
   (`gpu_tests.py`).
2. Training step of `configs/bert-base.yaml` and `configs/modern-base.yaml` at seq_len 128
   (vocabulary 32,768, micro-batch `--batch`, default 256 rows): forward + backward + clip
   + fused AdamW, bf16 autocast, exact_k masking (30 %), compile off and on (on: the
   static head, as the training loop does), next to `BertForMaskedLM` and
   `ModernBertForMaskedLM` (same config through `mlm_pipeline.train.hf`, SDPA, bf16,
   ModernBERT with `sparse_prediction`, eager) on the same batch. Tokens/s is the median
   over `--steps` timed steps after `--warmup` untimed ones; MFU = tokens/s x our
   `flops_per_token(128, 0.3)` / the GPU's dense bf16 peak (`perf.GPU_PEAK_BF16_FLOPS`),
   one formula for every model (HF BERT's full-vocabulary head does more work than it is
   credited with); peak memory = `torch.cuda.max_memory_allocated` (GiB = 2**30 bytes).
3. Tiny training: the `tiny` config's model, masking and optimizer for 300 steps on the
   GPU through `mlm_pipeline.train.train`, on shards carried from a CPU machine
   (`--shards DIR`, made by `--prepare-shards DIR`: the tiny config's corpus, tokenizer
   and shards, 3.0 MiB for `tiny`) or, without it, shards built here from
   `tests/assets/tiny_fr.txt` (vocabulary 256); passes when the mean loss of the last 3
   logged intervals is at least 10 % below that of the first 3.

`--smoke` is the dry run with one timed step per model and no gpu tests (unless `--tests`
asks for them): the test suite runs it (`tests/integration/test_gpu_check.py`).

`--dry-run` runs the same code on the CPU at a toy size (hidden 64, 2 layers, vocabulary
512, seq_len 32, batch 4, 60 training steps) in about 20 s; compile there uses the `eager`
backend (graph capture without code generation) and the peak is the measured CPU matmul
rate. Typical time on one H200 (not yet measured): well under 8 minutes, most of it in
inductor compiles (about 1 minute per compiled model).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
# A stock PyTorch image lacks pydantic (the library's configs): say how to bring it along.
for _dep in ("pydantic", "yaml"):
    if importlib.util.find_spec(_dep) is None:
        sys.exit(f"gpu_check: `{_dep}` is not installed; on a machine with network run "
                 "`pip download pydantic pyyaml -d wheels/`, carry wheels/ (about 3 MB) and "
                 "`pip install --no-index --find-links wheels/ pydantic pyyaml`")

import torch
from gpu_tests import run_gpu_tests

from mlm_pipeline.config import (
    MaskingConfig,
    ModelConfig,
    ShardConfig,
    TokenizerConfig,
    TrainConfig,
)
from mlm_pipeline.config_files import load_config
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest, read_manifest
from mlm_pipeline.masking.keyed import exact_k, mask_tokens
from mlm_pipeline.train import hf
from mlm_pipeline.train.loop import accumulate_gradients
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.perf import (
    adamw_impl,
    gpu_peak_flops,
    measure_cpu_matmul_flops,
    peak_memory_mb,
)

logger = logging.getLogger("gpu_check")
SEQ_LEN, MLM_PROBABILITY, VOCAB = 128, 0.3, 32768
RECIPES = ("bert-base", "modern-base")
#: Toy shapes of `--dry-run` (hidden, layers, heads, FFN per preset; vocab; seq_len; batch).
DRY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab": 512, "seq_len": 32,
       "batch": 4}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(batch: int, seq_len: int, vocab: int, device: torch.device):
    """Packed-looking rows ([CLS] doc [SEP] doc [SEP]) masked with exact_k, 80/10/10."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq_len), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    ids[torch.arange(batch), torch.randint(2, seq_len - 2, (batch,), generator=g)] = 3
    inp, labels = mask_tokens(ids, vocab_size=vocab, row_index=torch.arange(batch), seed=0,
                              mlm_probability=MLM_PROBABILITY, selection="exact_k")
    return inp.to(device), labels.to(device)


def _time_steps(step, device: torch.device, warmup: int, steps: int) -> tuple[float, float]:
    """(median seconds per step over `steps` timed steps, seconds of the warm-up)."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm_s, times = time.perf_counter() - start, []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), warm_s


def bench_model(name: str, model_cfg: ModelConfig, side: str, compile_mode: str | None,
                args, device: torch.device, peak: float | None) -> dict:
    """Time the training step of our model (`side="ours"`) or its HF peer (`"hf"`)."""
    vocab, seq_len, batch = args.vocab, args.seq_len, args.batch
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    ours = BertMLM(model_cfg, vocab, seq_len)
    flops = ours.flops_per_token(seq_len, MLM_PROBABILITY)
    if side == "ours":
        model = ours.to(device)
        params = model.param_groups(0.01)
    else:
        config = hf.hf_bert_config(ours) if model_cfg.preset == "bert" else (
            hf.hf_modernbert_config(ours))
        if model_cfg.preset != "bert":
            config.sparse_prediction = True  # the head at masked positions only, as ours
        import transformers

        cls = getattr(transformers, hf.HF_CLASSES[model_cfg.preset])
        with torch.device(device):
            model = cls(config)
        params = model.parameters()
    fwd = torch.compile(model, backend=compile_mode) if compile_mode else model
    opt = torch.optim.AdamW(params, lr=1e-4, **adamw_impl(device))
    inp, labels = _batch(batch, seq_len, vocab, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    k = exact_k(seq_len, MLM_PROBABILITY) if compile_mode and side == "ours" else None

    def step() -> None:
        if side == "ours":
            accumulate_gradients(fwd, [(inp, labels)], autocast, masked_per_row=k)
        else:
            with autocast:
                loss = fwd(input_ids=inp, labels=labels).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sec, warm_s = _time_steps(step, device, args.warmup, args.steps)
    tps = batch * seq_len / sec
    mem = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
           else peak_memory_mb(device) / 2**10)
    row = {"recipe": name, "model": "ours" if side == "ours" else type(model).__name__,
           "compile": bool(compile_mode), "batch": batch, "seq_len": seq_len,
           "tokens_per_s": tps, "step_ms": sec * 1e3, "warmup_s": warm_s,
           "mfu_pct": 100 * tps * flops / peak if peak else None, "peak_mem_gib": mem,
           "flops_per_token": flops, "peak_flops": peak}
    return row


def bench_recipes(args, device: torch.device, peak: float | None) -> list[dict]:
    """Every (recipe, model, compile) row of part 2."""
    compile_mode = "eager" if args.dry_run else "inductor"
    rows = []
    for name in RECIPES:
        cfg = load_config(name).model
        if args.dry_run:
            ffn = 2 * DRY["hidden_size"] if cfg.preset == "modern" else 4 * DRY["hidden_size"]
            cfg = cfg.model_copy(update={k: DRY[k] for k in ("hidden_size", "num_layers",
                                                             "num_heads")}
                                 | {"intermediate_size": ffn})
        for side, mode in (("ours", None), ("ours", compile_mode), ("hf", None)):
            rows.append(bench_model(name, cfg, side, mode, args, device, peak))
            logger.info("%s", {k: v for k, v in rows[-1].items() if k != "flops_per_token"})
    return rows


def prepare_shards(dest: Path, config: str = "tiny") -> Path:
    """On a CPU machine (network for the default corpus): ingest, tokenizer and shards of
    `config`, copied to `dest/tokenizer` and `dest/shards` for `--shards dest`."""
    from mlm_pipeline.ingest.stage import ingest
    from mlm_pipeline.shards.stage import write_shards
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    cfg = load_config(config)
    work = Path(cfg.work_dir).expanduser().resolve()
    corpus = ingest(cfg.ingest, work)
    tok = train_tokenizer(cfg.tokenizer, corpus, work)
    shards = write_shards(cfg.shards, corpus, tok, work)
    for stage, manifest in (("tokenizer", tok), ("shards", shards)):
        shutil.rmtree(dest / stage, ignore_errors=True)
        shutil.copytree(manifest.output_dir, dest / stage)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest}: {size / 2**20:.1f} MiB to carry (limit 30 MB)")
    return dest


def _local_manifests(shards_dir: Path | None, tmp: Path, seq_len: int):
    """(ShardManifest, TokenizerManifest): carried ones rebased onto `shards_dir`, or
    built here from `tests/assets/tiny_fr.txt`."""
    if shards_dir is not None:
        tok = read_manifest(shards_dir / "tokenizer", TokenizerManifest)
        shards = read_manifest(shards_dir / "shards", ShardManifest)
        return (shards.model_copy(update={"output_dir": str((shards_dir / "shards").resolve())}),
                tok.model_copy(update={"output_dir": str((shards_dir / "tokenizer").resolve())}))
    from mlm_pipeline.config import IngestConfig
    from mlm_pipeline.ingest.stage import ingest
    from mlm_pipeline.shards.stage import write_shards
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    corpus = ingest(IngestConfig(sources=[str(ROOT / "tests" / "assets" / "tiny_fr.txt")],
                                 validation_fraction=0.1), tmp)
    tok = train_tokenizer(TokenizerConfig(vocab_size=256), corpus, tmp)
    return write_shards(ShardConfig(seq_len=seq_len), corpus, tok, tmp), tok


def train_tiny(args, device: torch.device, tmp: Path) -> dict:
    """Part 3: the tiny recipe's training on the carried (or local) shards."""
    from mlm_pipeline.train import train

    tiny = load_config("tiny")
    shards, tok = _local_manifests(args.shards, tmp, DRY["seq_len"] if args.dry_run else 128)
    model = tiny.model
    if args.dry_run:
        model = model.model_copy(update={"hidden_size": 64, "num_layers": 2, "num_heads": 2,
                                         "intermediate_size": 128})
    train_cfg = TrainConfig(**{**tiny.train.model_dump(), "max_steps": args.train_steps,
                               "device": device.type,
                               "log_every": max(1, args.train_steps // 30),
                               "micro_batch_size": 8 if args.dry_run else 16,
                               "compile": "off" if args.dry_run else "auto",
                               "checkpoint_every": None,
                               "max_time_s": None if args.dry_run else 600})
    masking = MaskingConfig(**tiny.masking.model_dump())
    start = time.perf_counter()
    m = train(train_cfg, model, masking, shards, tok, tmp / "train")
    wall = time.perf_counter() - start
    recs = [json.loads(x) for x in m.file(m.metrics_log).read_text().splitlines()]
    losses = [r["train/loss"] for r in recs]
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    return {"steps": m.steps, "wall_s": wall, "shards": str(args.shards or "tiny_fr.txt"),
            "first_loss": first, "last_loss": last, "loss_falls": last <= 0.9 * first,
            "tokens_per_s": recs[-1].get("train/tokens_per_s"),
            "mfu_pct": recs[-1].get("train/mfu_pct"), "losses": losses}


def write_report(report: dict, out: Path) -> None:
    """`gpu_check.json` and `gpu_check.md` in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# GPU check — {report['date']} — {report['device']}", "",
             (f"torch {report['torch']}, transformers {report['transformers']}; dry run: "
              f"{report['dry_run']}; peak {report['peak_tflops']} TFLOP/s (bf16)"), "",
             f"gpu tests ({report['tests_runner']}): {report['tests_summary']}", "",
             "| recipe | model | compile | tokens/s | step ms | MFU % | peak mem GiB | vs HF |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["bench"]:
        mfu = "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}"
        lines.append(f"| {r['recipe']} | {r['model']} | {'on' if r['compile'] else 'off'} | "
                     f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu} | "
                     f"{r['peak_mem_gib']:.2f} | {r.get('vs_hf', 1.0):.2f}x |")
    t = report["tiny_training"]
    lines += ["", (f"tiny training: {t['steps']} steps in {t['wall_s']:.0f} s on "
                   f"{t['shards']}; loss {t['first_loss']:.3f} -> {t['last_loss']:.3f} "
                   f"({'falls' if t['loss_falls'] else 'DOES NOT FALL'})"), "",
              f"result: {'PASS' if report['ok'] else 'FAIL'}"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--shards", type=Path, default=None, help="carried shards (see above)")
    ap.add_argument("--prepare-shards", type=Path, default=None, metavar="DIR")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy size, seconds")
    ap.add_argument("--smoke", action="store_true",
                    help="the dry run, one timed step per model, no gpu tests unless --tests")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compile) per model")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--tests", choices=["auto", "pytest", "plain", "none"], default=None,
                    help="how to run the gpu tests (default: auto; none with --smoke)")
    args = ap.parse_args(argv)
    args.dry_run = args.dry_run or args.smoke
    args.tests = args.tests or ("none" if args.smoke else "auto")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.prepare_shards is not None:
        prepare_shards(args.prepare_shards)
        return 0
    args.vocab, args.seq_len = VOCAB, SEQ_LEN
    if args.dry_run:
        args.vocab, args.seq_len, args.batch = DRY["vocab"], DRY["seq_len"], DRY["batch"]
        args.steps, args.warmup, args.train_steps = 2, 1, min(args.train_steps, 60)
        if args.smoke:
            args.steps = 1
        # Toy shapes on one thread: two intra-op threads spend more on synchronisation than
        # on these matmuls, badly so on a busy machine.
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = "CPU " + platform.processor() if args.dry_run else torch.cuda.get_device_name()
    peak = (measure_cpu_matmul_flops(torch.bfloat16, n=256) if args.dry_run
            else gpu_peak_flops(name))
    started = time.perf_counter()
    runner, tests = ("none", []) if args.tests == "none" else run_gpu_tests(args.out, args.tests)
    bench = bench_recipes(args, device, peak)
    for r in bench:  # tokens/s against the HF peer of the same recipe
        peer = next(x for x in bench if x["recipe"] == r["recipe"] and x["model"] != "ours")
        r["vs_hf"] = r["tokens_per_s"] / peer["tokens_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = train_tiny(args, device, Path(tmp))
    import transformers

    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "skipped")}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": name, "dry_run": args.dry_run,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "peak_tflops": None if peak is None else round(peak / 1e12, 3),
        "imports_prefect_or_mlflow": [n for n in ("mlflow", "prefect")
                                      if sys.modules.get(n) is not None],
        "tests_runner": runner, "tests": tests,
        "tests_summary": ", ".join(f"{v} {k}" for k, v in counts.items()),
        "bench": bench, "tiny_training": tiny, "wall_s": time.perf_counter() - started,
    }
    report["ok"] = (counts["failed"] == 0 and tiny["loss_falls"]
                    and not report["imports_prefect_or_mlflow"])
    write_report(report, args.out)
    print((args.out / "gpu_check.md").read_text())
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
