"""The history of a registered model from the registry alone: `mlm-pipeline models NAME`.

One row per version, newest first (`COLUMNS`). Every value comes from the model version's
tags (`tracking.version_lineage`, `tracking.registry`) and the registered model's aliases,
never from the runs: the history reads the same when the runs were deleted (`mlm-pipeline
gc`, the MLflow UI); versions registered before the lineage tags show blanks there. The
`decision` is the current tag (`forced` after `mlm-pipeline promote`). Nothing is written.
"""

from __future__ import annotations

from mlm_pipeline.app.compare import RunTable, check_store
from mlm_pipeline.tracking.tracker import MlflowTracker
from mlm_pipeline.tracking.version_lineage import PREFIX, parent_label

__all__ = ["COLUMNS", "model_history", "model_versions", "promote_run"]

#: The columns shown by default (`--wide`: all).
NARROW = ["version", "aliases", "parent", "corpus", "tokenizer", "steps added", "decision",
          "eval/loss"]
#: The columns of the history, in order.
COLUMNS = ["version", "aliases", "parent", "corpus", "tokenizer", "steps added",
           "decision", "eval/loss", "registered", "id"]


def model_versions(tracker: MlflowTracker, name: str) -> tuple[RunTable, str]:
    """`mlm-pipeline models NAME`: `model_history` and its title."""
    table = model_history(tracker, name)
    return table, (f"{len(table.rows)} versions of registered model {name} "
                   f"({tracker.tracking_uri})")


def promote_run(tracker: MlflowTracker, run: str, name: str | None = None) -> list[str]:
    """`mlm-pipeline promote RUN`: force `champion` onto the version of `run` (an id, a
    unique id prefix or a name; `tracking.registry.promote`); returns the decision's
    lines (`summary.registry_lines`).

    Raises:
        ValueError: the run is unknown or ambiguous, or registered no version.
    """
    from mlm_pipeline.app.compare import resolve_run_id
    from mlm_pipeline.app.summary import registry_lines, registry_summary
    from mlm_pipeline.tracking.registry import promote

    run_id = resolve_run_id(tracker, run).info.run_id
    return registry_lines(registry_summary(promote(tracker, run_id, name)))


def model_history(tracker: MlflowTracker, name: str) -> RunTable:
    """The versions of registered model `name`, newest first (`COLUMNS`), raw: full digests
    and run ids, `registered` as `YYYY-MM-DD HH:MM` UTC, `steps added` an int, `eval/loss`
    a float; `parent` as `v3`, a run-id prefix, a checkpoint name or `-`.

    Raises:
        ValueError: the SQLite database does not exist, or no model `name` is registered
            there (the message lists the registered names).
    """
    import datetime as dt

    from mlflow.exceptions import MlflowException

    check_store(tracker)
    client = tracker.client
    try:
        aliases = dict(client.get_registered_model(name).aliases)
    except MlflowException as exc:
        names = sorted(m.name for m in client.search_registered_models())
        raise ValueError(f"no registered model {name!r} at {tracker.tracking_uri} "
                         f"(registered: {', '.join(names) or 'none'})") from exc
    quoted = name.replace("'", "\\'")
    versions = sorted(client.search_model_versions(f"name = '{quoted}'"),
                      key=lambda v: int(v.version), reverse=True)
    rows = []
    for v in versions:
        tags = v.tags
        held = sorted(a for a, number in aliases.items() if str(number) == str(v.version))
        steps = tags.get(f"{PREFIX}steps_added")
        loss = tags.get("eval_loss")
        when = dt.datetime.fromtimestamp(v.creation_timestamp / 1000, dt.timezone.utc)
        rows.append({
            "version": int(v.version), "aliases": ", ".join(held) or None,
            "parent": parent_label(tags) if f"{PREFIX}parent" in tags else None,
            "corpus": tags.get(f"{PREFIX}corpus_digest"),
            "tokenizer": tags.get(f"{PREFIX}tokenizer_digest") or tags.get("digest.tokenizer"),
            "steps added": int(steps) if steps is not None else None,
            "decision": tags.get("decision") or tags.get(f"{PREFIX}decision"),
            "eval/loss": float(loss) if loss is not None else None,
            "registered": when.strftime("%Y-%m-%d %H:%M"), "id": v.run_id,
        })
    return RunTable(list(COLUMNS), rows, NARROW)
