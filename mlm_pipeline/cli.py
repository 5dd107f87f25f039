"""The `mlm-pipeline` command line.

    mlm-pipeline run CONFIG [--set key=value ...] [--fresh] [--summary-json PATH]
    mlm-pipeline config CONFIG [--set key=value ...]
    mlm-pipeline fetch-corpus [NAME ...] [--cache-dir DIR]
    mlm-pipeline fill-mask CHECKPOINT_OR_RUN_DIR TOKENIZER_MODEL TEXT [TEXT ...]
    mlm-pipeline fill-mask (RUN_ID | models:/NAME@ALIAS) TEXT [TEXT ...] [--tracking-uri URI]
    mlm-pipeline export SOURCE OUT_DIR [--tokenizer PATH] [--force] [--tracking-uri URI]
    mlm-pipeline promote RUN_ID [--name NAME] [--tracking-uri URI]
    mlm-pipeline tokenize [CONFIG | --tokenizer PATH] [--text TEXT ...] [--json]
    mlm-pipeline runs [--experiment NAME] [--filter FILTER] [--max N] [--json] [--tracking-uri URI]
    mlm-pipeline compare RUN [RUN ...] [--out compare.png] [--experiment NAME] [--json]

`run` executes the `mlm-pretraining` Prefect flow in this process. The library never
imports Prefect or the flows (`tests/unit/test_boundaries.py`), so the flow comes in as an
argument: the `mlm-pipeline` console script is `mlm_pipeline_flows.cli:main` (the repository's
`flows/cli.py`), which calls `main(argv, run_flow=...)` here with the flow. Every other
command works from `python -m mlm_pipeline.cli` too; `run` from there says which entry to use.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import ConfigError, dump_config, load_config
from mlm_pipeline.app.runlog import one_line, print_summary, run_logging, versions

#: Runs the pretraining flow: (config name or path, dotted overrides) -> run summary (the
#: dict `mlm_pipeline.tracking.records.summary` builds).
RunFlow = Callable[[str, list[str]], dict[str, Any]]

#: The epilog of `mlm-pipeline run --help`.
RUN_EXAMPLES = """examples:
  mlm-pipeline run tiny                                   the shipped tiny config
  mlm-pipeline run tiny --set train.max_steps=50 --set train.lr=3e-4   overrides
  mlm-pipeline run tiny --set 'ingest.sources=["my/*.txt", "notes.jsonl"]'   your corpus
  mlm-pipeline run my.yaml --set tracking.run_name=lr-sweep-1   a YAML file, a run name
  mlm-pipeline run tiny          after Ctrl-C or a crash: continues the unfinished run
  mlm-pipeline run tiny --fresh  starts a new MLflow run instead
  mlm-pipeline -v run tiny       tracebacks in the terminal (else in <work_dir>/logs/)
See `mlm-pipeline config tiny` for every key and `mlm-pipeline config-reference`."""

#: What `run` says when the entry point gave it no flow.
NO_FLOW = (
    "`run` needs the Prefect flow, which this entry point does not provide: use the "
    "`mlm-pipeline` command (entry point mlm_pipeline_flows.cli:main), "
    "or `python -m mlm_pipeline_flows.cli run ...`"
)


def _cmd_run(args: argparse.Namespace, run_flow: RunFlow | None) -> int:
    if run_flow is None:
        print(f"mlm-pipeline: {NO_FLOW}", file=sys.stderr)
        return 2
    # Fail on a bad config or a mistyped input path before paying for Prefect's start-up
    # (and before its task-failure tracebacks).
    overrides = list(args.set) + (["tracking.resume=never"] if args.fresh else [])
    cfg = load_config(args.config, overrides)
    from mlm_pipeline.ingest.sources import check_local_sources

    check_local_sources(cfg.ingest)
    console, log = run_logging(cfg.work_dir, args.verbose)
    try:
        result = run_flow(args.config, overrides)
    except Exception as exc:  # noqa: BLE001 -- any failure of the flow becomes one line
        log.handle(logging.LogRecord(__name__, logging.ERROR, __file__, 0, "run failed", None,
                                     sys.exc_info()))
        if args.verbose and not console.reported:
            traceback.print_exc()
        stage = f"stage {console.failed_task!r} failed: " if console.failed_task else ""
        where = "" if args.verbose else f" (traceback in {log.baseFilename}; --verbose)"
        print(f"mlm-pipeline: error: {stage}{one_line(exc)}{where}", file=sys.stderr)
        return 1
    if args.summary_json:
        from mlm_pipeline.tracking.records import write_summary

        write_summary(result, args.summary_json)
    print_summary(result, cfg.tracking.experiment_name)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    sys.stdout.write(dump_config(load_config(args.config, args.set)))
    return 0


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from mlm_pipeline.config.reference import config_reference, write_config_reference

    if args.out:
        print(write_config_reference(args.out))
    else:
        sys.stdout.write(config_reference())
    return 0


def _cmd_fetch_corpus(args: argparse.Namespace) -> int:

    from mlm_pipeline.ingest.corpora import default_cache_dir, fetch_debian_corpus

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    for name in args.names:
        for path in fetch_debian_corpus(name, cache):
            print(path)
    return 0


def _tracker(args: argparse.Namespace):
    from mlm_pipeline.config import TrackingConfig
    from mlm_pipeline.tracking import MlflowTracker

    return MlflowTracker.from_config(TrackingConfig(tracking_uri=args.tracking_uri))


def _cmd_fill_mask(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.consumers import fill_mask_source

    results = fill_mask_source(args.source, args.args, top_k=args.top_k,
                               tracker=_tracker(args), trust_unverified=args.trust_unverified)
    print(json.dumps(results, ensure_ascii=False, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.consumers import export_source

    written = export_source(args.source, args.out_dir, tokenizer=args.tokenizer,
                            overwrite=args.force, tracker=_tracker(args),
                            trust_unverified=args.trust_unverified)
    print(json.dumps(written, indent=2))
    return 0


def _cmd_promote(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.compare import resolve_run_id
    from mlm_pipeline.tracking.records import registry_lines, registry_summary
    from mlm_pipeline.tracking.registry import promote

    tracker = _tracker(args)
    run_id = resolve_run_id(tracker, args.run_id).info.run_id  # an id prefix or a name too
    for line in registry_lines(registry_summary(promote(tracker, run_id, args.name))):
        print(line)
    return 0


def _print_runs(table, title: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(table.rows, indent=2))
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: keep every column whole rather than fit 80 columns
        console = Console(width=100_000)
    console.print(table.rich(title))


def _cmd_runs(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.compare import find_runs, newest_run_experiment, run_table

    tracker = _tracker(args)
    experiment = args.experiment or newest_run_experiment(tracker) or tracker.experiment_name
    runs = find_runs(tracker, experiment, args.filter, args.max)
    which = "" if args.experiment else ", the newest run's; --experiment NAME for another"
    _print_runs(run_table(tracker, runs), f"{len(runs)} runs of experiment {experiment} "
                f"({tracker.tracking_uri}{which})", args.json)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.compare import compare_runs

    table, _ = compare_runs(_tracker(args), args.runs, args.out, args.experiment)
    _print_runs(table, f"{len(table.rows)} runs; loss against tokens seen: {args.out}",
                args.json)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from mlm_pipeline.app.gc import apply_gc, gc_report, plan_gc

    items = plan_gc(_tracker(args), args.work_dir, args.keep, args.experiment)
    if not args.dry_run:
        apply_gc(items)
    print("\n".join(gc_report(items, args.dry_run)))
    return 0


class StageMissingError(RuntimeError):
    """A stage output the command needs has not been produced for this config yet."""


def find_tokenizer(cfg: PipelineConfig) -> Path:
    """The `spm.model` that `mlm-pipeline run` trained for `cfg`, found by stage digests.

    The corpus is the ingest output of `cfg.ingest`'s digest (source contents + config);
    with a `debian:` source, whose digest needs the apt archive checked (`apt-cache`), it
    is the newest complete ingest output in `cfg.work_dir` made with this same `ingest`
    config, so nothing is fetched. The tokenizer is the output of the tokenizer digest of
    `cfg.tokenizer` and that corpus. Nothing is computed.

    Raises:
        StageMissingError: the ingest or tokenizer output for this config is not complete
            in `cfg.work_dir` (the message says to run `mlm-pipeline run` first).
        FileNotFoundError: a local source of `cfg.ingest.sources` matches no file.
    """
    from mlm_pipeline.ingest.stage import ingest_digest
    from mlm_pipeline.manifest import CorpusManifest as Corpus
    from mlm_pipeline.manifest import TokenizerManifest as Tok
    from mlm_pipeline.manifest import load_if_complete, read_manifest, stage_dir
    from mlm_pipeline.tokenizer.stage import STAGE
    from mlm_pipeline.tracking.parents import tokenizer_digest_for

    corpus, digest = None, ""
    if any(s.startswith("debian:") for s in cfg.ingest.sources):
        want = cfg.ingest.model_dump(mode="json")
        for path in stage_dir(cfg.work_dir, "ingest", "").glob("*/manifest.json"):
            m = read_manifest(path, Corpus)
            if m.config == want and (m := load_if_complete(path.parent, Corpus, m.digest)) \
                    and (corpus is None or m.created_at > corpus.created_at):
                corpus = m
    else:
        digest = ingest_digest(cfg.ingest, cfg.work_dir)
        corpus = load_if_complete(stage_dir(cfg.work_dir, "ingest", digest), Corpus, digest)
    if corpus is not None:
        digest = tokenizer_digest_for(cfg, corpus)
        out = stage_dir(cfg.work_dir, STAGE, digest)
        if (tok := load_if_complete(out, Tok, digest)) is not None:
            return tok.file(tok.model.path)
    raise StageMissingError(
        f"no {'ingest' if corpus is None else 'tokenizer'} output for config {cfg.name!r} in "
        f"work_dir {cfg.work_dir!r} (digest {digest[:16] or 'of this ingest config'}); run "
        "`mlm-pipeline run` with this config first, or pass --tokenizer PATH/TO/spm.model")


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from mlm_pipeline.tokenizer import Tokenizer

    if (args.config is None) == (args.tokenizer is None):
        print("mlm-pipeline tokenize: give either CONFIG or --tokenizer", file=sys.stderr)
        return 2
    try:
        tok = Tokenizer.load(args.tokenizer or find_tokenizer(load_config(args.config, args.set)))
    except (StageMissingError, FileNotFoundError) as exc:
        print(f"mlm-pipeline tokenize: {exc}", file=sys.stderr)
        return 1
    texts = args.text if args.text else [line.rstrip("\n") for line in sys.stdin]
    results = []
    for text, ids in zip(texts, tok.encode(texts)):
        results.append({"text": text, "pieces": [tok.id_to_piece(i) for i in ids], "ids": ids})
    if args.json:
        print(json.dumps({"tokenizer": str(tok.path), "vocab_size": tok.vocab_size,
                          "results": results}, ensure_ascii=False, indent=2))
        return 0
    for i, r in enumerate(results):
        if i:
            print()
        print("pieces: " + " ".join(r["pieces"]))
        print("ids: " + " ".join(str(x) for x in r["ids"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mlm-pipeline` (sub-commands run, config, config-reference,
    fetch-corpus, fill-mask, export, promote, tokenize, runs, compare)."""
    parser = argparse.ArgumentParser(
        prog="mlm-pipeline", description="Pretrain BERT-style masked language models.")
    parser.add_argument("--version", action="version", version=versions())
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks "
                        "(and, for run, Prefect's failure reports)")
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="YAML path, or config name: tiny -> ./configs/tiny.yaml, "
                       "else the shipped tiny config")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, repeatable (e.g. --set train.max_steps=50)")

    p = sub.add_parser("run", help="run the full pipeline as a local Prefect flow (through "
                       "the mlm-pipeline command, which provides the flow)", epilog=RUN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(p)
    p.add_argument("--summary-json", metavar="PATH",
                   help="write run id, final metrics and stage manifest paths as JSON")
    p.add_argument("--fresh", action="store_true",
                   help="start a new MLflow run even if an unfinished run of this config "
                        "could be continued (tracking.resume=never)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("config", help="print the resolved config as YAML")
    config_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("config-reference", help="print every config key as Markdown (the "
                       "page docs/configuration.md)")
    p.add_argument("--out", metavar="PATH", help="write the page to PATH instead of stdout "
                   "(refresh the docs: --out docs/configuration.md)")
    p.set_defaults(func=_cmd_config_reference)

    p = sub.add_parser("fetch-corpus", help="fetch a built-in Debian corpus into the cache")
    p.add_argument("names", nargs="*", default=["fr"], help="corpus names (default: fr)")
    p.add_argument("--cache-dir", help="cache directory (default: $MLM_PIPELINE_CACHE)")
    p.set_defaults(func=_cmd_fetch_corpus)

    def tracking_uri(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking URI for run "
                       "ids and models:/ URIs (default: $MLFLOW_TRACKING_URI, else "
                       "sqlite:///./mlflow.db)")

    def trust_unverified(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trust-unverified", action="store_true", help="use a checkpoint "
                       "that cannot be verified (no digest: written before checkpoints were "
                       "verified); damaged checkpoints are refused all the same")

    p = sub.add_parser("fill-mask", help="predict [MASK] tokens with a checkpoint or an "
                       "MLflow model")
    p.add_argument("source", help="a checkpoint directory (…/checkpoints/step-XXXXXXXX), a "
                   "training run directory (its newest checkpoint), an MLflow run id or a "
                   "models:/NAME@ALIAS URI")
    p.add_argument("args", nargs="+", metavar="[TOKENIZER_MODEL] TEXT", help="for a "
                   "checkpoint, its SentencePiece .model file first; then texts with [MASK]")
    p.add_argument("--top-k", type=int, default=5)
    trust_unverified(p)
    tracking_uri(p)
    p.set_defaults(func=_cmd_fill_mask)

    p = sub.add_parser("export", help="write a Hugging Face transformers model directory "
                       "from a checkpoint or an MLflow model")
    p.add_argument("source", help="a checkpoint directory (…/checkpoints/step-XXXXXXXX), a "
                   "training run directory (its newest checkpoint), an MLflow run id or a "
                   "models:/NAME@ALIAS URI")
    p.add_argument("out_dir", help="model directory to create (config.json, "
                   "model.safetensors, tokenizer files, README.md)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer stage directory (default: "
                   "found by the checkpoint's tokenizer digest in its work directory)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    trust_unverified(p)
    tracking_uri(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("promote", help="force the registry alias champion onto a run's "
                       "model version")
    p.add_argument("run_id", help="MLflow run (id, unique id prefix or name) whose "
                   "registered version becomes champion")
    p.add_argument("--name", help="registered model name (default: the one the run "
                   "registered)")
    tracking_uri(p)
    p.set_defaults(func=_cmd_promote)

    p = sub.add_parser("tokenize", help="show how the tokenizer segments a text")
    p.add_argument("config", nargs="?",
                   help="config whose trained tokenizer to use (a name or YAML path, as for run)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of the config, repeatable")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="SentencePiece .model file or tokenizer stage directory instead")
    p.add_argument("--text", action="append", metavar="TEXT",
                   help="text to segment, repeatable (default: each line of stdin)")
    p.add_argument("--json", action="store_true", help="print JSON (text, pieces, ids)")
    p.set_defaults(func=_cmd_tokenize)

    def table_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print the rows as JSON (full "
                       "ids and digests, wall time in seconds)")
        tracking_uri(p)

    p = sub.add_parser("runs", help="list the runs of an experiment with the params that "
                       "differ, speed and final metrics")
    p.add_argument("--experiment", metavar="NAME", help="MLflow experiment (default: the "
                   "experiment of the newest run in the store)")
    p.add_argument("--filter", default="", metavar="FILTER", help="MLflow search filter, "
                   "e.g. \"params.`train.lr` = '0.001'\" or \"metrics.`eval/loss` < 5\"")
    p.add_argument("--max", type=int, default=50, metavar="N", help="at most N runs, "
                   "newest first (default: 50)")
    table_args(p)
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("compare", help="compare runs: the table of `runs` and a PNG of "
                       "train loss and eval loss (two panels) against tokens seen")
    p.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run id, unique id prefix "
                   "(e.g. the 8 characters `runs` shows) or run name")
    p.add_argument("--out", default="compare.png", metavar="PATH",
                   help="PNG to write (default: compare.png)")
    p.add_argument("--experiment", metavar="NAME", help="look run names up in this "
                   "experiment only (default: every experiment)")
    table_args(p)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("gc", help="remove the local training state (checkpoints/) of "
                       "finished runs, keeping the champion's, unfinished runs' and the newest")
    p.add_argument("--keep", type=int, default=1, metavar="N", help="newest finished runs "
                   "per experiment whose state is kept (default: 1)")
    p.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    p.add_argument("--experiment", metavar="NAME", help="only runs of this experiment")
    p.add_argument("--work-dir", default=PipelineConfig().work_dir, metavar="DIR",
                   help="the config's work_dir (default: %(default)s)")
    tracking_uri(p)
    p.set_defaults(func=_cmd_gc)
    for command in sub.choices.values():  # also accepted after the command
        command.add_argument("-v", "--verbose", action="store_true",
                             default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None, run_flow: RunFlow | None = None) -> int:
    """The `mlm-pipeline` command line (`python -m mlm_pipeline.cli`, and through
    `mlm_pipeline_flows.cli.main` the console script).

    Args:
        argv: arguments without the program name; None reads `sys.argv`.
        run_flow: what `run` calls after checking the config and local inputs: runs the
            pretraining flow and returns its summary. None: `run` fails with status 2 and
            names the entry point that has it.

    Returns:
        The exit status: 0 on success, 2 for a config error (or `run` without a flow), 1 for
        bad input or a failed run, with one line on stderr (the traceback with `--verbose`;
        for `run` also in the log file the line names).
    """
    args = build_parser().parse_args(argv)
    if args.func is not _cmd_run:  # `run` logs through `RunConsole` and a log file
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _cmd_run(args, run_flow) if args.func is _cmd_run else args.func(args)
    except ConfigError as exc:
        print(f"mlm-pipeline: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 -- the command line's last resort
        # Bad input the library reports with the file or field named: one line, not a
        # traceback (unless --verbose).
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (--verbose shows the traceback)"
        print(f"mlm-pipeline: error: {one_line(exc)}"
              + ("" if isinstance(exc, ValueError | OSError | RuntimeError) else hint),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
