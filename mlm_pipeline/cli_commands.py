"""The handlers of the `mlm-pipeline` commands: each takes the parsed arguments
(`mlm_pipeline.cli.build_parser`), calls the application layer (`mlm_pipeline.app`) or a
stage, prints the result and returns the exit status. Errors propagate to
`mlm_pipeline.cli.main`, which turns them into one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlm_pipeline.app.prepared import StageMissingError, find_tokenizer
from mlm_pipeline.app.runlog import one_line, print_summary, run_logging
from mlm_pipeline.config_files import dump_config, load_config

#: Runs the pretraining flow: (config name or path, dotted overrides) -> run summary (the
#: dict `mlm_pipeline.app.summary.summary` builds).
RunFlow = Callable[[str, list[str]], dict[str, Any]]

#: What `run` says when the entry point gave it no flow.
NO_FLOW = (
    "`run` needs the Prefect flow, which this entry point does not provide: use the "
    "`mlm-pipeline` command (entry point mlm_pipeline_flows.cli:main), "
    "or `python -m mlm_pipeline_flows.cli run ...`"
)


def cmd_run(args: argparse.Namespace, run_flow: RunFlow | None) -> int:
    """`mlm-pipeline run`: check the config and local inputs, run the flow, print the summary.

    Returns:
        The exit status.
    """
    if run_flow is None:
        print(f"mlm-pipeline: {NO_FLOW}", file=sys.stderr)
        return 2
    # Fail on a bad config or a mistyped input path before paying for Prefect's start-up
    # (and before its task-failure tracebacks).
    overrides = list(args.set) + (["tracking.resume=never"] if args.fresh else [])
    cfg = load_config(args.config, overrides)
    from mlm_pipeline.ingest.holdout import check_holdout
    from mlm_pipeline.ingest.sources import check_local_sources

    check_local_sources(cfg.ingest)
    check_holdout(cfg)
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
        from mlm_pipeline.app.summary import write_summary

        write_summary(result, args.summary_json)
    print_summary(result, cfg.tracking.experiment_name)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """`mlm-pipeline config`: print the resolved config as YAML.

    Returns:
        The exit status.
    """
    sys.stdout.write(dump_config(load_config(args.config, args.set)))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    """`mlm-pipeline config-reference`: print or write the config reference.

    Returns:
        The exit status.
    """
    from mlm_pipeline.config.reference import config_reference, write_config_reference

    if args.out:
        print(write_config_reference(args.out))
    else:
        sys.stdout.write(config_reference())
    return 0


def cmd_fetch_corpus(args: argparse.Namespace) -> int:
    """`mlm-pipeline fetch-corpus`: fetch Debian corpora, print their paths.

    Returns:
        The exit status.
    """
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


def cmd_fill_mask(args: argparse.Namespace) -> int:
    """`mlm-pipeline fill-mask`: print the predictions of SOURCE as JSON.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.consumers import fill_mask_source

    results = fill_mask_source(args.source, args.args, top_k=args.top_k,
                               tracker=_tracker(args), trust_unverified=args.trust_unverified)
    print(json.dumps(results, ensure_ascii=False, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`mlm-pipeline export`: write SOURCE as a `transformers` directory, print what.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.consumers import export_source

    written = export_source(args.source, args.out_dir, tokenizer=args.tokenizer,
                            overwrite=args.force, tracker=_tracker(args),
                            trust_unverified=args.trust_unverified)
    print(json.dumps(written, indent=2))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """`mlm-pipeline promote`: give a run's model version the `champion` alias.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.compare import resolve_run_id
    from mlm_pipeline.app.summary import registry_lines, registry_summary
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


def cmd_runs(args: argparse.Namespace) -> int:
    """`mlm-pipeline runs`: print the table of an experiment's runs.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.compare import find_runs, newest_run_experiment, run_table

    tracker = _tracker(args)
    experiment = args.experiment or newest_run_experiment(tracker) or tracker.experiment_name
    runs = find_runs(tracker, experiment, args.filter, args.max)
    which = "" if args.experiment else ", the newest run's; --experiment NAME for another"
    _print_runs(run_table(tracker, runs), f"{len(runs)} runs of experiment {experiment} "
                f"({tracker.tracking_uri}{which})", args.json)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """`mlm-pipeline models NAME`: print a registered model's versions, newest first, with
    their lineage (from the registry alone: `mlm_pipeline.app.models`).

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.models import model_history

    tracker = _tracker(args)
    table = model_history(tracker, args.name)
    _print_runs(table, f"{len(table.rows)} versions of registered model {args.name} "
                f"({tracker.tracking_uri})", args.json)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """`mlm-pipeline compare`: print the runs' table and draw the comparison PNG.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.compare import compare_runs

    table, _ = compare_runs(_tracker(args), args.runs, args.out, args.experiment)
    _print_runs(table, f"{len(table.rows)} runs; loss against tokens seen: {args.out}",
                args.json)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """`mlm-pipeline gc`: remove (or list) finished runs' local training state.

    Returns:
        The exit status.
    """
    from mlm_pipeline.app.gc import apply_gc, gc_report, plan_gc

    items = plan_gc(_tracker(args), args.work_dir, args.keep, args.experiment)
    if not args.dry_run:
        apply_gc(items)
    print("\n".join(gc_report(items, args.dry_run)))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    """`mlm-pipeline tokenize`: print the pieces and ids of texts.

    Returns:
        The exit status.
    """
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
