"""The torchrun entry point of a tracked run: rank 0 logs to MLflow while training.

`train.launch.run_torchrun(..., entry=ENTRY, extra=launch_extra(cfg, run_id, tracker))`
starts `python -m mlm_pipeline.tracking.torchrun_entry --inputs ... --out-dir ...` on every
rank. Every rank calls `stage.train`; rank 0 also gets what the one-process path of the
flow's train task gets:

- `StdoutSink` (its lines reach the launcher, `launch.sink_line_step`) and, from
  `live_tracking` (which the one-process path uses too), the run's `MlflowSink`, behind
  `AfterStepSink` when the run already holds steps (`resume.logged_steps`, per key), so a
  resumed run never sends MLflow a step of a key twice nor loses one, and the periodic
  evaluator (`periodic.periodic_evaluator`, `eval.every_steps`), refused before the launch with FSDP2
  (`stage.refuse_fsdp2_evaluation`);
- the run's system metrics (`MlflowTracker.system_metrics`) while training.

The MLflow run id, the whole pipeline config (for `eval`, `masking`, `linear_probe`,
`tracking`) and the resolved tracking URI travel in `inputs.json` under `extra`, never on
the command line. `mlm_pipeline.train` never imports this module (stage order): the
launcher takes it by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import ShardManifest, TokenizerManifest
from mlm_pipeline.sinks import AfterStepSink, MetricsSink
from mlm_pipeline.tracking import resume
from mlm_pipeline.tracking.periodic import periodic_evaluator
from mlm_pipeline.tracking.tracker import MlflowTracker

if TYPE_CHECKING:
    from mlm_pipeline.evaluate.periodic import PeriodicEvaluator

#: The module `torchrun` runs on every rank of a tracked launch.
ENTRY = "mlm_pipeline.tracking.torchrun_entry"


def launch_extra(cfg: PipelineConfig, run_id: str, tracker: MlflowTracker) -> dict[str, Any]:
    """The `extra` of a tracked launch (`run_torchrun(..., extra=...)`): the run id, the
    pipeline config as JSON and the tracker's resolved URI (a default URI made from the
    launcher's working directory reaches every rank unchanged).

    Raises:
        ValueError: `eval.every_steps` is set under FSDP2 (`stage.refuse_fsdp2_evaluation`),
            refused here before any process starts.
    """
    if cfg.eval.every_steps is not None:
        from mlm_pipeline.train.stage import refuse_fsdp2_evaluation

        refuse_fsdp2_evaluation(cfg.train.distributed.world_size > 1,
                                cfg.train.distributed.strategy)
    return {"run_id": run_id, "pipeline": cfg.model_dump(mode="json"),
            "tracking_uri": tracker.tracking_uri}


def live_tracking(cfg: PipelineConfig, shards: ShardManifest, tokenizer: TokenizerManifest,
                  tracker: MlflowTracker, run_id: str
                  ) -> tuple[MetricsSink, PeriodicEvaluator | None]:
    """What the process that trains (one process, or rank 0 of a launch) logs to MLflow
    through: the run's `MlflowSink`, wrapped in `AfterStepSink` past the last step the run
    already holds of each key (`resume.logged_steps`: a resumed run sends no step of a key
    twice, and misses none, evaluation points included), and the
    periodic evaluator (`periodic_evaluator`, None without `eval.every_steps`), whose
    fill-mask rows of held steps are not appended again either.

    Raises:
        mlflow.exceptions.MlflowException: the run cannot be read (unknown id, store down).
    """
    held = resume.logged_steps(tracker, run_id)
    mlflow_sink = tracker.sink(run_id)
    # the fill-mask rows go with the evaluation points: those of a step whose point the
    # run lacks (a kill during that evaluation) are appended when it runs again
    held_eval = max((s for k, s in held.items() if k.startswith("eval/")), default=0)
    return (AfterStepSink(mlflow_sink, held) if held else mlflow_sink,
            periodic_evaluator(cfg, shards, tokenizer, tracker, run_id, held_eval))


def _main(argv: list[str] | None = None) -> None:
    from mlm_pipeline.train.launch import (
        parse_rank_args,
        rank_logging,
        read_launch_inputs,
    )
    from mlm_pipeline.train.stage import train

    args = parse_rank_args(argv, ENTRY)
    rank = rank_logging()
    inputs = read_launch_inputs(args.inputs)
    train_args = (inputs.train, inputs.model, inputs.masking, inputs.shards,
                  inputs.tokenizer, args.out_dir)
    # An MLflow `train.init_from` fetched by the launcher (`parents.launch_init`).
    init = {"init_checkpoint": inputs.extra.get("init_checkpoint")}
    if rank != 0:
        train(*train_args, **init)
        return
    from mlm_pipeline.sinks import MultiSink, StdoutSink

    missing = {"run_id", "pipeline", "tracking_uri"} - inputs.extra.keys()
    if missing:
        raise ValueError(f"{args.inputs}: 'extra' lacks {sorted(missing)} (written by "
                         "torchrun_entry.launch_extra)")
    cfg = PipelineConfig.model_validate(inputs.extra["pipeline"])
    run_id = inputs.extra["run_id"]
    tracker = MlflowTracker(inputs.extra["tracking_uri"], cfg.tracking.experiment_name,
                            cfg.tracking.run_name)
    mlflow_sink, evaluator = live_tracking(cfg, inputs.shards, inputs.tokenizer, tracker,
                                           run_id)
    sink = MultiSink(StdoutSink(), mlflow_sink)
    with tracker.system_metrics(run_id):
        try:
            train(*train_args, sink=sink, evaluator=evaluator, **init)
        finally:
            sink.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank (`python -m mlm_pipeline.tracking.torchrun_entry --inputs
    ... --out-dir ...`); an exception is recorded in torchrun's error file with this rank
    (`launch.recorded`), then raised.

    Raises:
        ValueError: `inputs.json` is invalid or its `extra` lacks a key of `launch_extra`.
        Exception: whatever `stage.train` or MLflow raises on this rank.
    """
    from mlm_pipeline.train.launch import recorded

    recorded(_main, argv)


if __name__ == "__main__":
    main()
