"""Scheduled retraining, measured: what continuing from the champion saves, and what the
registry decides.

    python benchmarks/bench_retrain.py [--steps 200] [--threads 1] [--eval-rows 256]
                                       [--work DIR] [--out FILE] [--set KEY=VALUE ...]
    python benchmarks/bench_retrain.py --report-only --work DIR   (the table again)

Smoke test: `--smoke` (offline: the test corpus `tests/assets/tiny_fr.txt` split in two,
vocabulary 128, seq_len 16, a toy shape, 6 steps; the runs go through the same CLI entry
point in this process instead of fresh ones, which saves an interpreter start-up per run).

Corpora: v1 = a fixed ~70 % of the documents of the `tiny` config's corpus (`debian:fr`,
the JSONL files `mlm-pipeline fetch-corpus fr` caches; a document is in v1 when the
sha256 of its id is below 70 % of the range), v2 = all of them (v1 + the new ~30 %), each
written under `<work>/corpus/`. Every run goes through `mlm-pipeline run tiny --set ...`
in a fresh process (`--threads` torch threads, `OMP_NUM_THREADS` too), with one work
directory, one fresh SQLite MLflow store (`<work>/mlflow.db`), one registered model, one
local Prefect API for all runs, and the same shape and step count (`--steps`):

1. `v1-scratch`: v1 from random weights -> version 1, decision `first`, champion.
2. `v2-continue`: v2 warm-started from `models:/<name>@champion` with its tokenizer
   (`train.init_from`, `tokenizer.from_init=true`: what `retrain: continue` of the
   scheduled-retrain deployment resolves to; `mlm-pipeline run` has no `--retrain` flag)
   -> the champion is re-scored on v2's validation rows -> `promoted` or `kept`.
3. `v2-scratch`: v2 from random weights with the champion's tokenizer, the control. The
   CLI reuses a tokenizer only through a warm start, so the random weights come from a
   parent run `v1-init` (v1, one step at lr 1e-9, not registered): the seed's random
   initialization with v1's tokenizer. Runs 2 and 3 then share the shards digest: the
   same validation rows and masks.
4. `v2-other-tokenizer`: v2 from random weights with its own tokenizer (vocabulary 6,000
   instead of 8,000) -> compared with the champion in `eval/bits_per_char`.

The evaluation runs every `--steps`/5 steps on the first `--eval-rows` validation rows
(`eval.periodic_rows` = `eval.max_rows`), so every point of the curve and the final
`eval/loss` are on the same rows and masks. The table is read back from MLflow (the
model versions' tags `decision`, `compared_*`, the runs' tags `digest.*`, `mlm.init_*`
and the `eval/*` histories), not from this script's variables. The warm-start saving
compares runs 2 and 3 at the same steps and gives the first step at which run 3's curve
reaches run 2's final loss (when it does within `--steps`).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench-retrain"
#: The share of documents in v1, in percent.
V1_PERCENT = 70
#: `--smoke`: the test corpus, a small vocabulary and rows, and a toy shape.
SMOKE_SET = ["ingest.validation_fraction=0.15", "tokenizer.vocab_size=128", "shards.seq_len=16",
             "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
             "model.intermediate_size=64", "train.micro_batch_size=4", "train.log_every=2",
             "eval.batch_size=16"]
#: The other tokenizer of run 4 (`--smoke`, full run).
OTHER_TOKENIZER = {True: "tokenizer.vocab_size=100", False: "tokenizer.vocab_size=6000"}


# ----------------------------------------------------------------------------- corpora
def _in_v1(key: str) -> bool:
    """Whether a document (by its id or text) belongs to v1: a fixed ~70 % by sha256."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < V1_PERCENT


def write_corpora(work: Path, smoke: bool) -> tuple[Path, Path, dict[str, int]]:
    """Write corpus v1 (a fixed ~70 % of the documents) and v2 (all of them).

    Args:
        work: the benchmark's work directory; the corpora go to `corpus/v1`, `corpus/v2`.
        smoke: the test corpus (paragraphs of `tests/assets/tiny_fr.txt`) instead of the
            cached `debian:fr` JSONL files (fetched when missing).

    Returns:
        (v1 directory, v2 directory, document counts `{"v1": n1, "v2": n2}`).

    Raises:
        ValueError: a JSONL line of the corpus is not an object with `id` and `text`.
    """
    v1, v2 = work / "corpus" / "v1", work / "corpus" / "v2"
    v1.mkdir(parents=True, exist_ok=True)
    v2.mkdir(parents=True, exist_ok=True)
    counts = {"v1": 0, "v2": 0}
    if smoke:
        text = (ROOT / "tests" / "assets" / "tiny_fr.txt").read_text(encoding="utf-8")
        docs = [p.strip() for p in text.split("\n\n") if p.strip()]
        old = [d for d in docs if _in_v1(d)]
        (v1 / "tiny_fr.txt").write_text("\n\n".join(old) + "\n", encoding="utf-8")
        (v2 / "tiny_fr.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        return v1, v2, {"v1": len(old), "v2": len(docs)}
    from mlm_pipeline.ingest.corpora import default_cache_dir, fetch_debian_corpus

    for path in fetch_debian_corpus("fr", default_cache_dir()):
        lines = path.read_text(encoding="utf-8").splitlines()
        old = []
        for number, line in enumerate(lines, 1):
            record = json.loads(line)
            if not isinstance(record, dict) or "id" not in record or "text" not in record:
                raise ValueError(f"{path}:{number}: not a JSON object with `id` and `text`")
            if _in_v1(str(record["id"])):
                old.append(line)
        (v1 / path.name).write_text("\n".join(old) + "\n", encoding="utf-8")
        (v2 / path.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts["v1"] += len(old)
        counts["v2"] += len(lines)
    return v1, v2, counts


# ----------------------------------------------------------------------------- runs
def run_cli(name: str, overrides: list[str], work: Path, in_process: bool) -> str:
    """`mlm-pipeline run tiny --fresh --set ...` as run `name`; returns its MLflow run id
    (from `--summary-json`: a pointer only, every figure is read from MLflow).

    Raises:
        RuntimeError: the run failed (the end of its output is in the message).
    """
    summary = work / "summaries" / f"{name}.json"
    argv = ["run", "tiny", "--fresh", "--summary-json", str(summary),
            "--set", f"tracking.run_name={name}", *(a for o in overrides for a in ("--set", o))]
    start = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] run {name} ...", flush=True)
    if in_process:
        from mlm_pipeline_flows.console import main as cli_main

        code = cli_main(argv)
        tail = f"(its output is above; tracebacks in {work / 'work' / 'logs'})"
    else:
        proc = subprocess.run([sys.executable, "-m", "mlm_pipeline_flows.console", *argv],
                              capture_output=True, text=True, check=False)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    if code != 0:
        raise RuntimeError(f"run {name} failed (exit {code}):\n{tail}")
    print(f"  done in {time.monotonic() - start:.0f} s", flush=True)
    return json.loads(summary.read_text(encoding="utf-8"))["mlflow_run_id"]


def scenario(work: Path, steps: int, threads: int, eval_rows: int, smoke: bool,
             extra: list[str], in_process: bool) -> dict[str, str]:
    """Run the five CLI runs of the scenario (module docstring) in order.

    Returns:
        Run name -> MLflow run id.

    Raises:
        RuntimeError: a run failed (`run_cli`).
    """
    v1, v2, counts = write_corpora(work, smoke)
    print(f"corpus v1: {counts['v1']} documents, v2: {counts['v2']} documents "
          f"(v1 + {counts['v2'] - counts['v1']} new)", flush=True)
    every = max(1, steps // 5)
    base = [f"work_dir={work / 'work'}", f"tracking.tracking_uri=sqlite:///{work / 'mlflow.db'}",
            f"tracking.experiment_name={MODEL_NAME}",
            f"tracking.registered_model_name={MODEL_NAME}",
            f"train.max_steps={steps}", f"train.num_threads={threads}",
            f"tokenizer.num_threads={threads}", f"shards.num_threads={threads}",
            f"eval.every_steps={every}", f"eval.max_rows={eval_rows}",
            f"eval.periodic_rows={eval_rows}",
            "eval.probes=[]", "linear_probe.enabled=false",
            *(SMOKE_SET if smoke else []), *extra]
    champion = f"train.init_from=models:/{MODEL_NAME}@champion"
    ids = {"v1-scratch": run_cli("v1-scratch", [*base, f"ingest.sources=[{v1}]"], work,
                                 in_process)}
    ids["v2-continue"] = run_cli("v2-continue", [*base, f"ingest.sources=[{v2}]", champion,
                                                 "tokenizer.from_init=true"], work, in_process)
    ids["v1-init"] = run_cli("v1-init", [*base, f"ingest.sources=[{v1}]", "train.max_steps=1",
                                         "train.lr=1e-9", "eval.every_steps=null",
                                         "tracking.log_model=false"], work, in_process)
    ids["v2-scratch"] = run_cli("v2-scratch", [
        *base, f"ingest.sources=[{v2}]", f"train.init_from={ids['v1-init']}",
        "tokenizer.from_init=true"], work, in_process)
    ids["v2-other-tokenizer"] = run_cli("v2-other-tokenizer", [
        *base, f"ingest.sources=[{v2}]", OTHER_TOKENIZER[smoke]], work, in_process)
    return ids


# ----------------------------------------------------------------------------- report
def _short(value: str | None) -> str:
    return (value or "-")[:12]


def _num(value: str | float | None) -> str:
    return "-" if value is None else f"{float(value):.4f}"


def registry_rows(uri: str) -> list[dict[str, Any]]:
    """One row per registered version of the benchmark's model, read from MLflow: version,
    run name, parent, digests, steps, champion's and challenger's scores on the same data,
    metric, decision and whether it holds `champion` now."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    versions = sorted(client.search_model_versions(f"name = '{MODEL_NAME}'"),
                      key=lambda v: int(v.version))
    version_of = {v.run_id: int(v.version) for v in versions}
    champion = int(client.get_model_version_by_alias(MODEL_NAME, "champion").version)
    rows = []
    for v in versions:
        run = client.get_run(v.run_id)
        tags, vt = run.data.tags, v.tags
        parent = "-"
        if "mlm.init_checkpoint" in tags:
            parent_id = next((p for p in Path(tags["mlm.init_checkpoint"]).parts
                              if len(p) == 32), "")
            parent_name = (client.get_run(parent_id).info.run_name if parent_id else "?")
            at = f"step {tags.get('mlm.init_step', '?')}"
            parent = (f"version {version_of[parent_id]} ({parent_name}, {at})"
                      if parent_id in version_of else f"{parent_name} ({at}, not registered)")
        history = client.get_metric_history(v.run_id, "eval/loss")
        metric = vt.get("compared_metric")
        bpc = metric == "eval/bits_per_char"
        rows.append({
            "version": int(v.version), "run": run.info.run_name, "parent": parent,
            "corpus": _short(tags.get("digest.corpus")),
            "tokenizer": _short(tags.get("digest.tokenizer")),
            "shards": _short(tags.get("digest.shards")),
            "steps": max((m.step for m in history), default=0),
            "champion_version": vt.get("compared_champion_version", "-"),
            "champion_score": _num(vt.get("compared_champion_bits_per_char" if bpc
                                          else "compared_champion_eval_loss")),
            "challenger_score": _num(vt.get("compared_bits_per_char" if bpc
                                            else "compared_eval_loss")),
            "rescored": vt.get("compared_champion_rescored", "-"),
            "metric": metric or "-", "decision": vt.get("decision", "-"),
            "champion_now": int(v.version) == champion})
    return rows


def curve(uri: str, run_id: str) -> dict[int, tuple[float, float]]:
    """Step -> (`eval/loss`, `eval/mlm_accuracy`) of a run, from its MLflow histories."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "eval/loss")}
    acc = {m.step: m.value for m in client.get_metric_history(run_id, "eval/mlm_accuracy")}
    return {s: (loss[s], acc.get(s, float("nan"))) for s in sorted(loss)}


def saving_lines(warm: dict[int, tuple[float, float]], cold: dict[int, tuple[float, float]],
                 parent: dict[int, tuple[float, float]]) -> list[str]:
    """The warm-start saving as Markdown: both validation curves (step -> (`eval/loss`,
    accuracy)) at their common steps and the first step at which the from-scratch curve
    reaches the warm start's final loss (linearly interpolated between the two points
    around it); `parent` (the champion's own curve, on v1) gives its step count."""
    steps = sorted(set(warm) & set(cold))
    lines = ["| step | continue eval/loss | scratch eval/loss | scratch - continue | "
             "continue accuracy | scratch accuracy |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {s} | {warm[s][0]:.4f} | {cold[s][0]:.4f} | {cold[s][0] - warm[s][0]:+.4f} "
              f"| {warm[s][1]:.4f} | {cold[s][1]:.4f} |" for s in steps]
    last = steps[-1]
    target = warm[last][0]
    reached = None
    previous = (0, None)
    for s in sorted(cold):
        if cold[s][0] <= target:
            p_step, p_loss = previous
            reached = s if p_loss is None else p_step + (s - p_step) * (
                (p_loss - target) / (p_loss - cold[s][0]))
            break
        previous = (s, cold[s][0])
    head = (f"Warm-start saving at step {last}: eval/loss {target:.4f} (continue) vs "
            f"{cold[last][0]:.4f} (scratch), {cold[last][0] - target:.4f} nats lower; "
            f"mlm accuracy {warm[last][1]:.4f} vs {cold[last][1]:.4f}.")
    if reached is None:
        tail = (f"From scratch does not reach {target:.4f} within {last} steps (its curve "
                "does not allow a step count): the warm start is worth more than "
                f"{last} steps of training on v2.")
    else:
        tail = (f"From scratch reaches {target:.4f} at about step {reached:.0f} of {last} "
                f"(interpolated on its validation curve): the warm start saves about "
                f"{last - reached:.0f} of {last} steps.")
    before = (f"The warm start's parent trained {max(parent)} steps on v1 before: "
              f"{max(parent) + last} steps in all against {last}.")
    return lines + ["", head + " " + tail + " " + before]


def run_ids(uri: str) -> dict[str, str]:
    """Run name -> MLflow run id of the benchmark's experiment (the newest run of a name).

    Raises:
        ValueError: the store holds no benchmark experiment.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(MODEL_NAME)
    if experiment is None:
        raise ValueError(f"{uri}: no experiment {MODEL_NAME!r} (not a bench_retrain store)")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return {r.info.run_name: r.info.run_id for r in runs}


def report(uri: str) -> str:
    """The benchmark's Markdown, read from the MLflow store at `uri`: the registry table
    and the warm-start saving.

    Raises:
        ValueError: the store is not a benchmark's (`run_ids`).
        KeyError: a run of the scenario is missing from it.
    """
    ids = run_ids(uri)
    rows = registry_rows(uri)
    out = ["| version | run | parent | corpus | tokenizer | shards | steps | champion "
           "(version): score | challenger: score | metric | decision |",
           "|---:|---|---|---|---|---|---:|---|---:|---|---|"]
    for r in rows:
        champ = ("-" if r["champion_version"] == "-" else
                 f"version {r['champion_version']}: {r['champion_score']}"
                 + (" (re-scored)" if r["rescored"] == "true" else ""))
        out.append(f"| {r['version']}{' (champion)' if r['champion_now'] else ''} | {r['run']} "
                   f"| {r['parent']} | {r['corpus']} | {r['tokenizer']} | {r['shards']} "
                   f"| {r['steps']} | {champ} | {r['challenger_score']} | {r['metric']} "
                   f"| {r['decision']} |")
    same = {r["run"]: r["shards"] for r in rows}
    out += ["", "Not registered: v1-init, the random initialization that v2-scratch starts "
            "from (v1, one step at lr 1e-9: v1's tokenizer, the seed's weights).",
            "", f"Runs v2-continue and v2-scratch evaluated on the same shards "
            f"({same.get('v2-continue')} / {same.get('v2-scratch')}): "
            f"{'yes' if same.get('v2-continue') == same.get('v2-scratch') else 'NO'}.", ""]
    out += saving_lines(curve(uri, ids["v2-continue"]), curve(uri, ids["v2-scratch"]),
                        curve(uri, ids["v1-scratch"]))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the scenario, print (and write) the report; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new "
                        "temporary one, kept); must not hold an MLflow store yet")
    parser.add_argument("--eval-rows", type=int, default=256, help="validation rows of "
                        "every evaluation (the curve's points and the final one alike)")
    parser.add_argument("--out", default=None, help="also write the report as Markdown")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted override for every run")
    parser.add_argument("--smoke", action="store_true", help="offline, toy shapes, 6 steps")
    parser.add_argument("--report-only", action="store_true", help="run nothing: print "
                        "the report of the MLflow store of a finished --work directory")
    args = parser.parse_args(argv)
    if args.report_only:
        if not args.work or not (Path(args.work) / "mlflow.db").is_file():
            parser.error("--report-only: give the --work directory of a finished run")
        return _emit(report(f"sqlite:///{Path(args.work).resolve() / 'mlflow.db'}"), args.out)
    steps = 6 if args.smoke else args.steps
    if steps < 2:
        parser.error("--steps: at least 2")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-retrain-")).resolve()
    if (work / "mlflow.db").exists():
        parser.error(f"--work {work}: holds an MLflow store already; give a fresh directory")
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update({"OMP_NUM_THREADS": str(args.threads),
                       "MKL_NUM_THREADS": str(args.threads),
                       "MLFLOW_DISABLE_TELEMETRY": "true",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    if args.smoke:  # no MFU peak measurement: seconds saved, MFU is not reported here
        os.environ["MLM_PIPELINE_PEAK_TFLOPS"] = "1"
    from mlm_pipeline_flows.console import LocalPrefectApi
    from mlm_pipeline_flows.prefect_private import startup_timeout_s

    if not os.environ.get("PREFECT_API_URL"):  # one Prefect API for every run
        api = LocalPrefectApi()
        api.start(startup_timeout_s())
        os.environ["PREFECT_API_URL"] = api.url
        # Registered before prefect is imported (`--smoke` runs the flows in this
        # process): it runs after Prefect's exit handlers have sent their last logs.
        atexit.register(api.stop)
    start = time.monotonic()
    scenario(work, steps, args.threads, args.eval_rows, args.smoke, args.set,
             in_process=args.smoke)
    print(f"\nscheduled retraining, {steps} steps a run, {args.threads} thread(s), "
          f"{time.monotonic() - start:.0f} s; work directory {work}\n")
    return _emit(report(f"sqlite:///{work / 'mlflow.db'}"), args.out)


def _emit(text: str, out: str | None) -> int:
    """Print the report, write it to `out` when given; the exit status."""
    print(text)
    if out:
        Path(out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
