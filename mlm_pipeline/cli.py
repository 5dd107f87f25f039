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
    mlm-pipeline models NAME [--json] [--tracking-uri URI]
    mlm-pipeline compare RUN [RUN ...] [--out compare.png] [--experiment NAME] [--json]

`run` executes the `mlm-pretraining` Prefect flow in this process. The library never
imports Prefect or the flows (`tests/unit/test_boundaries.py`), so the flow comes in as an
argument: the `mlm-pipeline` console script is `mlm_pipeline_flows.cli:main` (the repository's
`flows/cli.py`), which calls `main(argv, run_flow=...)` here with the flow. Every other
command works from `python -m mlm_pipeline.cli` too; `run` from there says which entry to use.

This module parses the arguments and turns errors into one line; the commands' handlers are
in `mlm_pipeline.cli_commands`, over the verbs of `mlm_pipeline.app`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence

from mlm_pipeline import cli_commands as commands
from mlm_pipeline.app.runlog import one_line, versions
from mlm_pipeline.cli_commands import RunFlow
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import ConfigError

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mlm-pipeline` (sub-commands run, config, config-reference,
    fetch-corpus, fill-mask, export, promote, tokenize, runs, models, compare)."""
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
    p.set_defaults(func=commands.cmd_run)

    p = sub.add_parser("config", help="print the resolved config as YAML")
    config_args(p)
    p.set_defaults(func=commands.cmd_config)

    p = sub.add_parser("config-reference", help="print every config key as Markdown (the "
                       "page docs/configuration.md)")
    p.add_argument("--out", metavar="PATH", help="write the page to PATH instead of stdout "
                   "(refresh the docs: --out docs/configuration.md)")
    p.set_defaults(func=commands.cmd_config_reference)

    p = sub.add_parser("fetch-corpus", help="fetch a built-in Debian corpus into the cache")
    p.add_argument("names", nargs="*", default=["fr"], help="corpus names (default: fr)")
    p.add_argument("--cache-dir", help="cache directory (default: $MLM_PIPELINE_CACHE)")
    p.set_defaults(func=commands.cmd_fetch_corpus)

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
    p.set_defaults(func=commands.cmd_fill_mask)

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
    p.set_defaults(func=commands.cmd_export)

    p = sub.add_parser("promote", help="force the registry alias champion onto a run's "
                       "model version")
    p.add_argument("run_id", help="MLflow run (id, unique id prefix or name) whose "
                   "registered version becomes champion")
    p.add_argument("--name", help="registered model name (default: the one the run "
                   "registered)")
    tracking_uri(p)
    p.set_defaults(func=commands.cmd_promote)

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
    p.set_defaults(func=commands.cmd_tokenize)

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
    p.set_defaults(func=commands.cmd_runs)

    p = sub.add_parser("models", help="list a registered model's versions, newest first, "
                       "with parent, corpus and tokenizer digests, steps added, decision "
                       "and aliases (from the model registry alone)")
    p.add_argument("name", metavar="NAME", help="registered model name (default of a "
                   "pipeline run: its experiment name)")
    table_args(p)
    p.set_defaults(func=commands.cmd_models)

    p = sub.add_parser("compare", help="compare runs: the table of `runs` and a PNG of "
                       "train loss and eval loss (two panels) against tokens seen")
    p.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run id, unique id prefix "
                   "(e.g. the 8 characters `runs` shows) or run name")
    p.add_argument("--out", default="compare.png", metavar="PATH",
                   help="PNG to write (default: compare.png)")
    p.add_argument("--experiment", metavar="NAME", help="look run names up in this "
                   "experiment only (default: every experiment)")
    table_args(p)
    p.set_defaults(func=commands.cmd_compare)

    p = sub.add_parser("gc", help="remove the local training state (checkpoints/) of "
                       "finished runs, keeping the champion's, unfinished runs' and the newest")
    p.add_argument("--keep", type=int, default=1, metavar="N", help="newest finished runs "
                   "per experiment whose state is kept (default: 1)")
    p.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    p.add_argument("--experiment", metavar="NAME", help="only runs of this experiment")
    p.add_argument("--work-dir", default=PipelineConfig().work_dir, metavar="DIR",
                   help="the config's work_dir (default: %(default)s)")
    tracking_uri(p)
    p.set_defaults(func=commands.cmd_gc)
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
    if args.func is not commands.cmd_run:  # `run` logs through `RunConsole` and a log file
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return (commands.cmd_run(args, run_flow) if args.func is commands.cmd_run
                else args.func(args))
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
