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
run or this job's unfinished one continued).
"""
