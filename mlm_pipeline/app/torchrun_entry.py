"""The torchrun entry point of a tracked run: rank 0 logs to MLflow while training.

`app.training_run` launches `python -m mlm_pipeline.app.torchrun_entry --inputs ...
--out-dir ...` on every rank (`train.launch.run_torchrun(..., extra=launch_extra(...))`).
Every rank calls `stage.train`; rank 0 also gets what the one-process path gets:
`StdoutSink` (its lines reach the launcher, `launch.sink_line_step`), the run's sinks and
periodic evaluator (`training_run.live_tracking`; the evaluator is refused before the launch
with FSDP2) and the run's system metrics while training.

The MLflow run id, the whole pipeline config (for `eval`, `masking`, `linear_probe`,
`tracking`), the resolved tracking URI and the fetched parent travel in `inputs.json` under
`extra`, never on the command line. `mlm_pipeline.train` never imports this module (stage
order): the launcher takes it by name.
"""

from __future__ import annotations

from mlm_pipeline.app.training_run import TORCHRUN_ENTRY, live_tracking
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.tracking.tracker import MlflowTracker


def _main(argv: list[str] | None = None) -> None:
    """One rank's training (`main`)."""
    from mlm_pipeline.train.launch import parse_rank_args, rank_logging, read_launch_inputs
    from mlm_pipeline.train.stage import train

    args = parse_rank_args(argv, TORCHRUN_ENTRY)
    rank = rank_logging()
    inputs = read_launch_inputs(args.inputs)
    train_args = (inputs.train, inputs.model, inputs.masking, inputs.shards,
                  inputs.tokenizer, args.out_dir)
    # An MLflow `train.init_from` fetched by the launcher (`training_run.launch_extra`).
    init = {"init_checkpoint": inputs.init_checkpoint}
    if rank != 0:
        train(*train_args, **init)
        return
    from mlm_pipeline.sinks import MultiSink, StdoutSink

    missing = {"run_id", "pipeline", "tracking_uri"} - inputs.extra.keys()
    if missing:
        raise ValueError(f"{args.inputs}: 'extra' lacks {sorted(missing)} (written by "
                         "training_run.launch_extra)")
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
    """Entry point of one rank (`python -m mlm_pipeline.app.torchrun_entry --inputs
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
