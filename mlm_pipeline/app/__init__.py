"""The application layer: the verbs a user runs, composed from the stages and tracking.

Above the stage packages (ingest, tokenizer, masking, shards, train, evaluate, tracking) and
below their two callers, the CLI (`mlm_pipeline.cli`) and the Prefect flows (`flows/`),
which only call these functions. Nothing here imports Prefect or the flows.

Rooms: `consumers` (`fill-mask` and `export` from any SOURCE), `compare` (the `runs` and
`compare` commands' table), `compare_plot` (the comparison figure of `compare`), `gc`
(removing finished runs' local training state), `runlog` (the `run` command's terminal,
log file, one-line errors and summary), `summary` (the run summary: its dict, text lines
and Markdown report), `prepared` (which stage outputs of a config exist;
checks that prepared data matches a config), `open_run` (the resume policy: a new MLflow
run or this job's unfinished one continued; the data a run records), `models` (a
registered model's history, `promote`), `parents` (the parent of a run, `train.init_from`,
and the retrain policy), `phases` (a recipe's chain of phases, `train.phase_of`),
`training_run` (the tracked training run: sinks, evaluator,
parent, stop signal, torchrun) and `torchrun_entry` (its entry on every rank), `publish`
(the end of a run: results recorded, the model exported, logged, registered and decided),
`decide` (the registry's decision, pure), `rescore` (the champion scored on a new
version's data) and `sweep` (a sweep: its grid, its parent run and nested runs).
"""
