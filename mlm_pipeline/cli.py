"""The `mlm-pipeline` command line: one table of commands over the verbs of
`mlm_pipeline.app` (and a few stage and config functions).

    mlm-pipeline run CONFIG [--set key=value ...] [--fresh] [--summary-json PATH]
    mlm-pipeline config CONFIG [--set key=value ...]
    mlm-pipeline config-reference [--out PATH]
    mlm-pipeline fetch-corpus [NAME ...] [--cache-dir DIR]
    mlm-pipeline fill-mask CHECKPOINT_OR_RUN_DIR TOKENIZER_MODEL TEXT [TEXT ...]
    mlm-pipeline fill-mask (RUN_ID | models:/NAME@ALIAS) TEXT [TEXT ...] [--tracking-uri URI]
    mlm-pipeline export SOURCE OUT_DIR [--tokenizer PATH] [--force] [--tracking-uri URI]
    mlm-pipeline promote RUN_ID [--name NAME] [--tracking-uri URI]
    mlm-pipeline tokenize [CONFIG | --tokenizer PATH] [--text TEXT ...] [--json]
    mlm-pipeline runs [--experiment NAME] [--filter FILTER] [--max N] [--json]
    mlm-pipeline models NAME [--json] [--tracking-uri URI]
    mlm-pipeline compare RUN [RUN ...] [--out compare.png] [--experiment NAME] [--json]
    mlm-pipeline gc [--keep N] [--dry-run] [--experiment NAME] [--work-dir DIR]
    mlm-pipeline alerts install (--webhook-url URL | --block TYPE/NAME)
    mlm-pipeline alerts remove

Each `Command` names its verb, its arguments (shared ones defined once) and how its result
is shown; an argument's destination is the verb's keyword (`--tracking-uri` becomes the
verb's `tracker`). Errors become one line on stderr (`main`).

`run` (the `mlm-pretraining` flow, in this process) and `alerts` (Prefect automations) need
Prefect, which the library never imports: the console script `mlm_pipeline_flows.console:main`
hands them in (`main(argv, run_flow=..., flow_verbs={"alerts": ...})`). Every other command
works from `python -m mlm_pipeline.cli` too; `run` and `alerts` from there say which entry
to use.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlm_pipeline.app.runlog import one_line, versions
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import ConfigError
from mlm_pipeline.errors import TrainingInterrupted

#: Runs the pretraining flow: (config name or path, dotted overrides) -> run summary (the
#: dict `mlm_pipeline.app.summary.summary` builds); with the keyword `sweep` (a grid,
#: `app.sweep.parse_grid`), the sweep flow, whose record has the children's summaries.
RunFlow = Callable[..., dict[str, Any]]

#: The verbs that need Prefect, by command name (`alerts`): handed in by the console
#: script, as the flow is.
FlowVerbs = Mapping[str, Callable[..., Any]]

#: A `Command.verb` that the console script hands in (`FlowVerbs`, by the command's name).
FROM_FLOWS = "<flows>"


def no_flow(command: str) -> str:
    """What `command` says when the entry point gave it no Prefect side."""
    return (f"`{command}` needs Prefect, which this entry point does not provide: use the "
            "`mlm-pipeline` command (entry point mlm_pipeline_flows.console:main), "
            f"or `python -m mlm_pipeline_flows.console {command} ...`")


#: What `run` says when the entry point gave it no flow.
NO_FLOW = no_flow("run")

#: The epilog of `mlm-pipeline run --help`.
RUN_EXAMPLES = """examples:
  mlm-pipeline run tiny                                   the shipped tiny config
  mlm-pipeline run tiny --set train.max_steps=50 --set train.lr=3e-4   overrides
  mlm-pipeline run tiny --set 'ingest.sources=["my/*.txt", "notes.jsonl"]'   your corpus
  mlm-pipeline run my.yaml --set tracking.run_name=lr-sweep-1   a YAML file, a run name
  mlm-pipeline run tiny          after Ctrl-C or a crash: continues the unfinished run
  mlm-pipeline run tiny --fresh  starts a new MLflow run instead
  mlm-pipeline run tiny --sweep train.lr=1e-4,3e-4,1e-3   a sweep: one parent run, three
                                 nested runs on data prepared once
  mlm-pipeline -v run tiny       tracebacks in the terminal (else in <work_dir>/logs/)
See `mlm-pipeline config tiny` for every key and `mlm-pipeline config-reference`."""

#: A model SOURCE, as `fill-mask` and `export` take it.
SOURCE_HELP = ("a checkpoint directory (…/checkpoints/step-XXXXXXXX), a training run "
               "directory (its newest checkpoint), an MLflow run id or a models:/NAME@ALIAS "
               "URI")


@dataclass(frozen=True)
class Arg:
    """One argument: `argparse.add_argument(*flags, **options)`; its destination is the
    verb's keyword, unless `verb` is false (it only changes how the result is shown).
    With `stdin`, a value not given is the lines of standard input."""

    flags: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    verb: bool = True
    stdin: bool = False

    @property
    def dest(self) -> str:
        """The argument's destination (argparse's rule)."""
        return self.options.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


def arg(*flags: str, verb: bool = True, stdin: bool = False, **options: Any) -> Arg:
    """An `Arg` (see there)."""
    return Arg(flags, options, verb, stdin)


#: The arguments several commands share, defined once.
CONFIG = arg("config", help="YAML path, or config name: tiny -> ./configs/tiny.yaml, else "
             "the shipped tiny config")
OVERRIDES = arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                help="dotted override, repeatable (e.g. --set train.max_steps=50)")
TRACKING_URI = arg("--tracking-uri", metavar="URI", help="MLflow tracking URI for run ids "
                   "and models:/ URIs (default: $MLFLOW_TRACKING_URI, else "
                   "sqlite:///./mlflow.db)")
TRUST = arg("--trust-unverified", dest="trust_unverified", action="store_true",
            help="use a checkpoint that cannot be verified (no digest: written before "
            "checkpoints were verified); damaged checkpoints are refused all the same")
SOURCE = arg("source", help=SOURCE_HELP)
JSON = arg("--json", action="store_true", verb=False, help="print JSON (full ids and "
           "digests, wall time in seconds, every column)")
WIDE = arg("--wide", action="store_true", verb=False, help="every column, as wide as it "
           "takes (default: the main columns, fitted to 100 columns)")
EXPERIMENT = arg("--experiment", metavar="NAME", help="MLflow experiment (default: every "
                 "experiment, or for runs the newest run's)")


def show_json(result: Any, args: argparse.Namespace) -> None:
    """Print the result as indented JSON."""
    print(json.dumps(result, ensure_ascii=False, indent=2, default=str))


def show_lines(result: Sequence[Any], args: argparse.Namespace) -> None:
    """Print each item on its own line."""
    for line in result:
        print(line)


def show_text(result: str, args: argparse.Namespace) -> None:
    """Write the text as it is."""
    sys.stdout.write(result)


#: The width a table fits on a pipe (in a terminal: the terminal's).
TABLE_WIDTH = 100


def show_table(result: tuple[Any, str], args: argparse.Namespace) -> None:
    """A `RunTable` and its title: the rows as JSON with `--json`, else a `rich` table of
    its main columns fitted to the terminal (on a pipe, `TABLE_WIDTH`), or with `--wide`
    every column, as wide as it takes."""
    table, title = result
    if args.json:
        print(json.dumps(table.rows, indent=2))
        return
    from rich.console import Console

    console = Console()
    width = 100_000 if args.wide else console.width if console.is_terminal else TABLE_WIDTH
    Console(width=width).print(table.rich(title, wide=args.wide))


def show_tokens(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The pieces and ids of each text (JSON with `--json`)."""
    if args.json:
        show_json(result, args)
        return
    for i, r in enumerate(result["results"]):
        if i:
            print()
        print("pieces: " + " ".join(r["pieces"]))
        print("ids: " + " ".join(str(x) for x in r["ids"]))


def _verb(path: str) -> Callable[..., Any]:
    """The function `module:name`, imported when the command runs (so that the command
    line starts without torch, mlflow or the stages)."""
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Command:
    """One sub-command: `verb` (`module:function`, or `FROM_FLOWS`: the function the
    console script hands in under the command's name) is called with the arguments' values
    by destination and its result shown by `show`."""

    name: str
    help: str
    verb: str
    args: tuple[Arg, ...] = ()
    show: Callable[[Any, argparse.Namespace], None] = show_json

    def __call__(self, args: argparse.Namespace, flow_verbs: FlowVerbs | None = None) -> int:
        """Run the verb on the parsed `args` and show its result; returns 0 (2, with a line
        on stderr, for a `FROM_FLOWS` verb that `flow_verbs` lacks)."""
        if self.verb == FROM_FLOWS:
            verb = (flow_verbs or {}).get(self.name)
            if verb is None:
                print(f"mlm-pipeline: {no_flow(self.name)}", file=sys.stderr)
                return 2
        else:
            verb = _verb(self.verb)
        kwargs = {a.dest: getattr(args, a.dest) for a in self.args if a.verb}
        for a in self.args:
            if a.stdin and kwargs[a.dest] is None:
                kwargs[a.dest] = [line.rstrip("\n") for line in sys.stdin]
        if "tracking_uri" in kwargs:
            from mlm_pipeline.config import TrackingConfig
            from mlm_pipeline.tracking import MlflowTracker

            uri = kwargs.pop("tracking_uri")
            kwargs["tracker"] = MlflowTracker.from_config(TrackingConfig(tracking_uri=uri))
        self.show(verb(**kwargs), args)
        return 0


COMMANDS = (
    Command("config", "print the resolved config as YAML",
            "mlm_pipeline.config_files:resolved_yaml", (CONFIG, OVERRIDES), show_text),
    Command("config-reference", "print every config key as Markdown (the page "
            "docs/configuration.md)", "mlm_pipeline.config.reference:reference_page",
            (arg("--out", metavar="PATH", help="write the page to PATH instead of stdout "
                 "(refresh the docs: --out docs/configuration.md)"),), show_text),
    Command("fetch-corpus", "fetch a built-in Debian corpus into the cache",
            "mlm_pipeline.ingest.corpora:fetch_corpora",
            (arg("names", nargs="*", default=["fr"], help="corpus names (default: fr)"),
             arg("--cache-dir", help="cache directory (default: $MLM_PIPELINE_CACHE)")),
            show_lines),
    Command("fill-mask", "predict [MASK] tokens with a checkpoint or an MLflow model",
            "mlm_pipeline.app.consumers:fill_mask_source",
            (SOURCE, arg("args", nargs="+", metavar="[TOKENIZER_MODEL] TEXT", help="for a "
                         "checkpoint, its SentencePiece .model file first; then texts with "
                         "[MASK]"),
             arg("--top-k", type=int, default=5), TRUST, TRACKING_URI)),
    Command("export", "write a Hugging Face transformers model directory from a checkpoint "
            "or an MLflow model", "mlm_pipeline.app.consumers:export_source",
            (SOURCE, arg("out_dir", help="model directory to create (config.json, "
                         "model.safetensors, tokenizer files, README.md)"),
             arg("--tokenizer", metavar="PATH", help="tokenizer stage directory (default: "
                 "found by the checkpoint's tokenizer digest in its work directory)"),
             arg("--force", dest="overwrite", action="store_true",
                 help="replace a non-empty OUT_DIR"), TRUST, TRACKING_URI)),
    Command("promote", "force the registry alias champion onto a run's model version",
            "mlm_pipeline.app.models:promote_run",
            (arg("run", metavar="RUN_ID", help="MLflow run (id, unique id prefix or name) "
                 "whose registered version becomes champion"),
             arg("--name", help="registered model name (default: the one the run "
                 "registered)"), TRACKING_URI), show_lines),
    Command("tokenize", "show how the tokenizer segments a text",
            "mlm_pipeline.app.consumers:tokenize",
            (arg("config", nargs="?", help="config whose trained tokenizer to use (a name or "
                 "YAML path, as for run)"), OVERRIDES,
             arg("--tokenizer", metavar="PATH", help="SentencePiece .model file or tokenizer "
                 "stage directory instead"),
             arg("--text", dest="texts", action="append", metavar="TEXT", stdin=True,
                 help="text to segment, repeatable (default: each line of stdin)"),
             arg("--json", action="store_true", verb=False,
                 help="print JSON (text, pieces, ids)")), show_tokens),
    Command("runs", "list the runs of an experiment with the params that differ, speed and "
            "final metrics", "mlm_pipeline.app.compare:experiment_runs",
            (EXPERIMENT,
             arg("--filter", dest="filter_string", default="", metavar="FILTER",
                 help="MLflow search filter, e.g. \"params.`train.lr` = '0.001'\" or "
                 "\"metrics.`eval/loss` < 5\""),
             arg("--max", dest="max_runs", type=int, default=50, metavar="N",
                 help="at most N runs, newest first (default: 50)"),
             arg("--parent", metavar="RUN", help="only the runs nested under this run (a "
                 "sweep's children; id, unique id prefix or name)"), JSON, WIDE,
             TRACKING_URI),
            show_table),
    Command("models", "list a registered model's versions, newest first, with parent, "
            "corpus and tokenizer digests, steps added, decision and aliases (from the "
            "model registry alone)", "mlm_pipeline.app.models:model_versions",
            (arg("name", metavar="NAME", help="registered model name (default of a pipeline "
                 "run: its experiment name)"), JSON, WIDE, TRACKING_URI), show_table),
    Command("compare", "compare runs: the table of `runs` and a PNG of train loss and eval "
            "loss (two panels) against tokens seen", "mlm_pipeline.app.compare:compare_table",
            (arg("runs", nargs="+", metavar="RUN", help="MLflow run id, unique id prefix "
                 "(e.g. the 8 characters `runs` shows) or run name; a sweep's parent run "
                 "stands for its children"),
             arg("--out", default="compare.png", metavar="PATH",
                 help="PNG to write (default: compare.png)"), EXPERIMENT, JSON, WIDE,
             TRACKING_URI), show_table),
    Command("gc", "remove the local training state (checkpoints/) of finished runs, keeping "
            "the champion's, unfinished runs' and the newest", "mlm_pipeline.app.gc:gc",
            (arg("--keep", type=int, default=1, metavar="N", help="newest finished runs per "
                 "experiment whose state is kept (default: 1)"),
             arg("--dry-run", action="store_true", help="list what would go; remove nothing"),
             EXPERIMENT,
             arg("--work-dir", default=PipelineConfig().work_dir, metavar="DIR",
                 help="the config's work_dir (default: %(default)s)"), TRACKING_URI),
            show_lines),
    Command("alerts", "create or update (install) or delete (remove) the Prefect "
            "automations on $PREFECT_API_URL: notify on a Failed, Crashed or TimedOut flow "
            "run, mark runs without heartbeats Crashed", FROM_FLOWS,
            (arg("action", choices=("install", "remove")),
             arg("--webhook-url", metavar="URL", help="install: POST the notification "
                 "(JSON: text, subject, body) to URL"),
             arg("--block", metavar="TYPE/NAME", help="install: notify through this saved "
                 "Prefect notification block instead (e.g. an email block)"),
             arg("--zombie-file", metavar="PATH", help="the zombie-run automation's YAML "
                 "(default: the one installed with the flows)")),
            show_lines),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mlm-pipeline`: `run` and every command of `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="mlm-pipeline", description="Pretrain BERT-style masked language models.")
    parser.add_argument("--version", action="version", version=versions())
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks "
                        "(and, for run, Prefect's failure reports)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the full pipeline as a local Prefect flow (through "
                       "the mlm-pipeline command, which provides the flow)", epilog=RUN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for a in (CONFIG, OVERRIDES):
        p.add_argument(*a.flags, **a.options)
    p.add_argument("--summary-json", metavar="PATH",
                   help="write run id, final metrics and stage manifest paths as JSON")
    p.add_argument("--fresh", action="store_true",
                   help="start a new MLflow run even if an unfinished run of this config "
                        "could be continued (tracking.resume=never)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="train every combination of these values (repeatable) on data "
                   "prepared once: an MLflow parent run with a nested run per combination")
    p.set_defaults(command_=None)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        for a in command.args:
            p.add_argument(*a.flags, **a.options)
        p.set_defaults(command_=command)
    for p in sub.choices.values():  # also accepted after the command
        p.add_argument("-v", "--verbose", action="store_true",
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def continue_command(argv: Sequence[str]) -> str:
    """The command that continues an interrupted `mlm-pipeline run`: the command line as
    typed (`argv`, without the program name), less `--fresh`, which would start a new
    run instead."""
    return shlex.join(["mlm-pipeline", *(a for a in argv if a != "--fresh")])


def run(args: argparse.Namespace, run_flow: RunFlow | None, argv: Sequence[str]) -> int:
    """`mlm-pipeline run`: check the config and local inputs, run the flow, print the
    summary; returns the exit status (130 after an interruption, with the command that
    continues it)."""
    from mlm_pipeline.app.phases import alone_warning
    from mlm_pipeline.app.runlog import (print_summary, print_sweep_summary, quiet_third_party,
                                         run_logging, tell_after_interrupt)
    from mlm_pipeline.app.sweep import parse_grid
    from mlm_pipeline.config_files import load_config
    from mlm_pipeline.ingest.holdout import check_holdout
    from mlm_pipeline.ingest.sources import check_local_sources

    if run_flow is None:
        print(f"mlm-pipeline: {NO_FLOW}", file=sys.stderr)
        return 2
    # Fail on a bad config or a mistyped input path before paying for Prefect's start-up
    # (and before its task-failure tracebacks).
    overrides = list(args.overrides) + (["tracking.resume=never"] if args.fresh else [])
    cfg = load_config(args.config, overrides)
    check_local_sources(cfg.ingest)
    check_holdout(cfg)
    if (warning := alone_warning(cfg)) is not None:
        print(f"mlm-pipeline: warning: {warning}", file=sys.stderr)
    grid = parse_grid(args.sweep)
    if grid and args.fresh:
        raise ConfigError("--sweep continues its own unfinished runs; --fresh is not for it")
    console, log = run_logging(cfg.work_dir, args.verbose)
    if not args.verbose:
        quiet_third_party()
    try:
        result = run_flow(args.config, overrides, **({"sweep": grid} if grid else {}))
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        where = (f" at step {exc.step}, checkpoint {exc.checkpoint}"
                 if isinstance(exc, TrainingInterrupted) else "")
        tell_after_interrupt(f"mlm-pipeline: interrupted{where}; to continue, run the same "
                             f"command: {continue_command(argv)}")
        return 130
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
    if grid:
        print_sweep_summary(result)
    else:
        print_summary(result, cfg.tracking.experiment_name)
    return 0


def main(argv: Sequence[str] | None = None, run_flow: RunFlow | None = None,
         flow_verbs: FlowVerbs | None = None) -> int:
    """The `mlm-pipeline` command line (`python -m mlm_pipeline.cli`, and through
    `mlm_pipeline_flows.console.main` the console script).

    Args:
        argv: arguments without the program name; None reads `sys.argv`.
        run_flow: what `run` calls after checking the config and local inputs: runs the
            pretraining flow and returns its summary. None: `run` fails with status 2 and
            names the entry point that has it.
        flow_verbs: the verbs of the `FROM_FLOWS` commands by name (`alerts`); one
            missing fails as `run` does without its flow.

    Returns:
        The exit status: 0 on success, 2 for a config error (or `run` without a flow), 1 for
        bad input or a failed run, with one line on stderr (the traceback with `--verbose`;
        for `run` also in the log file the line names).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = args.command_
    if command is not None:  # `run` logs through `RunConsole` and a log file
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args, run_flow, argv) if command is None else command(args, flow_verbs)
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
