"""Lineage of registered model versions (`tracking.version_lineage`), the lineage columns
of `mlm-pipeline runs`, and `mlm-pipeline models NAME` read from the registry alone, on a
real MLflow SQLite store.

Three runs register versions of one model the way `train-evaluate` does, through
`app.publish.register_and_decide` (no model files: a logged model created and finalized by the client,
which is all `decide` reads), then `record_version_lineage` with train manifests whose
checkpoints hold a `state.json` written here:

- A (6 steps, loss 5.0) from random weights: v1, `first`; registered as an older
  release did, without lineage tags, so the next version must find it by alias;
- B (4 steps, loss 4.0) warm-started from `models:/NAME@champion` (v1's checkpoint):
  v2, `promoted`, so the alias now names v2 itself and the parent is the champion it
  was registered under;
- C (3 steps, loss 4.5) warm-started from B's checkpoint directory, given as a path:
  v3, `kept`, found as v2 by its checkpoint digest.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from mlm_pipeline import cli
from mlm_pipeline.app.decide import Challenger
from mlm_pipeline.app.publish import register_and_decide
from mlm_pipeline.manifest import TrainManifest
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking.version_lineage import (
    log_model_metrics,
    record_version_lineage,
)
from tests.integration.test_runs_compare import _cli  # a command in a fresh process

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import LoggedModelStatus, Metric  # noqa: E402

NAME = "lineage-test"
EVAL_DATA = "e" * 64  # one evaluation data digest: the losses are compared as they are
#: run -> steps, eval/loss, corpus digest, tokenizer digest, checkpoint digest.
RUNS = {
    "A": (6, 5.0, "c1" * 32, "t1" * 32, "a1" * 32),
    "B": (4, 4.0, "c2" * 32, "t1" * 32, "b2" * 32),
    "C": (3, 4.5, "c3" * 32, "t1" * 32, "c3" * 32),
}


def _trained(work: Path, run_id: str, steps: int, digest: str,
             init: dict | None) -> TrainManifest:
    """A train manifest of run `run_id` in `work/train/<run id>` with its final checkpoint
    `step-<steps>/state.json` (`state_sha256` = `digest`), as the training stage lays out."""
    out = work / "train" / run_id
    checkpoint = out / "checkpoints" / f"step-{steps}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"state_sha256": digest, "step": steps}))
    return TrainManifest(
        stage="train", digest=hashlib.sha256(run_id.encode()).hexdigest(),
        output_dir=str(out), config={}, inputs={}, created_at=time.time(), wall_time_s=1.0,
        checkpoint_dir=f"checkpoints/step-{steps}", steps=steps, tokens_seen=steps * 64,
        final_metrics={}, metrics_log="metrics.jsonl", stopped_early=False, device="cpu",
        precision="fp32", init=init)


def _register(tracker: MlflowTracker, run_id: str, loss: float) -> dict:
    """A READY logged model of `run_id`, registered and decided
    (`app.publish.register_and_decide`)."""
    client = tracker.client
    model = client.create_logged_model(tracker.experiment_id(), name="model",
                                       source_run_id=run_id)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    uri = f"models:/{model.model_id}"
    challenger = Challenger(NAME, 0, loss, EVAL_DATA, "s" * 64)
    return {**register_and_decide(tracker, NAME, run_id, uri, challenger), "model_uri": uri}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, fresh_mlflow_db):
    """The three versions (see the module docstring): run name -> run id, manifest,
    registry record, lineage tags; and the tracker."""
    root = tmp_path_factory.mktemp("lineage")
    tracker = MlflowTracker(fresh_mlflow_db(root / "mlflow.db"), NAME)
    work = root / "work"
    out = {}
    parents = {"A": None, "B": ("A", f"models:/{NAME}@champion"), "C": ("B", None)}
    for name, (steps, loss, corpus, tokenizer, digest) in RUNS.items():
        tracker.run_name = f"run-{name}"
        run_id = tracker.start_run({"run": name})
        init = None
        if parents[name]:
            parent, source = parents[name]
            before = out[parent]["trained"]
            checkpoint = before.file(before.checkpoint_dir)
            init = {"source": source or str(checkpoint), "checkpoint": str(checkpoint),
                    "digest": RUNS[parent][4], "step": RUNS[parent][0]}
            tracker.set_tags(run_id, {"mlm.init_from": init["source"],
                                      "mlm.init_checkpoint": init["checkpoint"]})
        trained = _trained(work, run_id, steps, digest, init)
        tracker.log_metrics(run_id, {"train/tokens_seen": steps * 64.0}, step=steps)
        tracker.log_metrics(run_id, {"eval/loss": loss, "eval/mlm_accuracy": 0.25},
                            step=steps)
        registered = _register(tracker, run_id, loss)
        tags = None
        if name == "A":  # registered by an older release: no lineage tags
            assert registered["decision"] == "first"
        else:
            tags = record_version_lineage(tracker, registered, trained, corpus, tokenizer)
        tracker.end_run(run_id)
        out[name] = {"run_id": run_id, "trained": trained, "registered": registered,
                     "tags": tags}
    return tracker, out


def _version_tags(client: MlflowClient, version: int) -> dict[str, str]:
    return dict(client.get_model_version(NAME, str(version)).tags)


def test_decisions_of_the_scenario(chain):
    _, runs = chain
    assert [(runs[n]["registered"]["version"], runs[n]["registered"]["decision"])
            for n in "ABC"] == [(1, "first"), (2, "promoted"), (3, "kept")]


def test_parent_by_alias_that_moved_to_the_new_version(chain):
    tracker, runs = chain
    tags = _version_tags(MlflowClient(tracker.tracking_uri), 2)
    assert tags["lineage.parent_source"] == f"models:/{NAME}@champion"
    assert tags["lineage.parent"] == f"models:/{NAME}/1"  # not v2, which holds it now
    assert tags["lineage.parent_version"] == "1"
    assert tags["lineage.parent_run_id"] == runs["A"]["run_id"]
    assert tags["lineage.parent_digest"] == RUNS["A"][4]
    assert tags["lineage.parent_step"] == "6"
    assert tags["lineage.model_digest"] == RUNS["B"][4]
    assert tags["lineage.corpus_digest"] == RUNS["B"][2]
    assert tags["lineage.tokenizer_digest"] == RUNS["B"][3]
    assert tags["lineage.steps_added"] == "4"
    assert tags["lineage.decision"] == "promoted"


def test_parent_given_as_a_checkpoint_path_is_found_by_digest(chain):
    tracker, runs = chain
    tags = _version_tags(MlflowClient(tracker.tracking_uri), 3)
    checkpoint = runs["B"]["trained"].file(runs["B"]["trained"].checkpoint_dir)
    assert tags["lineage.parent_source"] == str(checkpoint)
    assert tags["lineage.parent"] == f"models:/{NAME}/2"
    assert tags["lineage.parent_version"] == "2"
    assert tags["lineage.parent_run_id"] == runs["B"]["run_id"]
    assert (tags["lineage.steps_added"], tags["lineage.decision"]) == ("3", "kept")


def test_the_run_carries_its_parent_and_steps_added(chain):
    tracker, runs = chain
    run = MlflowClient(tracker.tracking_uri).get_run(runs["C"]["run_id"]).data.tags
    assert run["lineage.parent"] == f"models:/{NAME}/2"
    assert run["lineage.parent_version"] == "2"
    assert run["lineage.steps_added"] == "3"


def _steps(client, run_id: str) -> dict[str, list[int]]:
    """Every metric of the run -> the steps of its history, in order."""
    return {key: [m.step for m in client.get_metric_history(run_id, key)]
            for key in client.get_run(run_id).data.metrics}


def test_eval_metrics_are_linked_to_the_logged_model_never_logged_twice(
        tmp_path, fresh_mlflow_db):
    tracker = MlflowTracker(fresh_mlflow_db(tmp_path / "mlflow.db"), "model-metrics")
    run_id = tracker.start_run({})
    metrics = {"eval/loss": 3.25, "eval/mlm_accuracy": 0.5, "eval/perplexity": float("inf"),
               "eval/rows": 20.0}
    tracker.log_metrics(run_id, {"eval/loss": 3.25, "eval/mlm_accuracy": 0.5}, step=7)
    client = MlflowClient(tracker.tracking_uri)
    stamps = {k: client.get_metric_history(run_id, k)[0].timestamp
              for k in ("eval/loss", "eval/mlm_accuracy")}
    model = tracker.client.create_logged_model(tracker.experiment_id(), name="model",
                                               source_run_id=run_id)
    uri = f"models:/{model.model_id}"
    digest = "d" * 36
    logged = log_model_metrics(tracker, run_id, uri, metrics, 7, "shards-validation", digest)
    # inf is not logged; eval/rows, which the run did not hold, is logged once, linked
    assert logged == {"eval/loss": 3.25, "eval/mlm_accuracy": 0.5, "eval/rows": 20.0}
    # Again (a publish step done twice): nothing more.
    assert log_model_metrics(tracker, run_id, uri, metrics, 7, "shards-validation",
                             digest) == {}
    mlflow.set_tracking_uri(tracker.tracking_uri)
    try:
        found = mlflow.get_logged_model(model.model_id).metrics
    finally:
        mlflow.set_tracking_uri(None)
    assert sorted((m.key, m.value, m.step, m.dataset_name, m.dataset_digest) for m in found) == [
        ("eval/loss", 3.25, 7, "shards-validation", digest),
        ("eval/mlm_accuracy", 0.5, 7, "shards-validation", digest),
        ("eval/rows", 20.0, 7, "shards-validation", digest)]
    # The links are the run's own points (their timestamps): one point per key and step.
    assert {m.key: m.timestamp for m in found if m.key in stamps} == stamps
    assert _steps(client, run_id) == {"eval/loss": [7], "eval/mlm_accuracy": [7],
                                      "eval/rows": [7]}
    # A model `log_model(step=...)` logged: MLflow linked the run's points at that step
    # to it, without a dataset; nothing is added, neither to the model nor to the run.
    linked = tracker.client.create_logged_model(tracker.experiment_id(), name="model",
                                                source_run_id=run_id)
    tracker.client.log_batch(run_id, metrics=[
        Metric(m.key, m.value, m.timestamp, m.step, model_id=linked.model_id, run_id=run_id)
        for key in ("eval/loss", "eval/mlm_accuracy", "eval/rows")
        for m in client.get_metric_history(run_id, key)])
    assert log_model_metrics(tracker, run_id, f"models:/{linked.model_id}", metrics, 7,
                             "shards-validation", digest) == {}
    found = client.get_logged_model(linked.model_id).metrics
    assert sorted((m.key, m.dataset_digest) for m in found) == [
        ("eval/loss", None), ("eval/mlm_accuracy", None), ("eval/rows", None)]
    assert _steps(client, run_id) == {"eval/loss": [7], "eval/mlm_accuracy": [7],
                                      "eval/rows": [7]}
    with pytest.raises(ValueError, match="not a logged model"):
        log_model_metrics(tracker, run_id, f"models:/{NAME}/1", metrics, 7, "x", digest)


def test_runs_shows_parent_steps_added_and_decision(chain, tmp_path):
    tracker, runs = chain
    out = _cli(tmp_path, "runs", "--experiment", NAME, "--tracking-uri",
               tracker.tracking_uri, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)}
    got = {n: (rows[runs[n]["run_id"]]["parent"], rows[runs[n]["run_id"]]["steps added"],
               rows[runs[n]["run_id"]]["decision"]) for n in "ABC"}
    # A has no lineage tags: its steps are those of its last train/tokens_seen point.
    assert got == {"A": ("-", 6, "first"), "B": ("v1", 4, "promoted"),
                   "C": ("v2", 3, "kept")}


def test_models_reads_the_history_from_the_registry_alone(chain, tmp_path, capsys):
    tracker, runs = chain
    client = MlflowClient(tracker.tracking_uri)
    for name in "ABC":  # the runs are gone: the history is in the version tags
        client.delete_run(runs[name]["run_id"])
    out = _cli(tmp_path, "models", NAME, "--tracking-uri", tracker.tracking_uri, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["version"], r["aliases"], r["parent"], r["corpus"], r["tokenizer"],
             r["steps added"], r["decision"], r["eval/loss"], r["id"]) for r in rows] == [
        (3, "challenger", "v2", RUNS["C"][2], RUNS["C"][3], 3, "kept", 4.5,
         runs["C"]["run_id"]),
        (2, "champion", "v1", RUNS["B"][2], RUNS["B"][3], 4, "promoted", 4.0,
         runs["B"]["run_id"]),
        # Registered without lineage tags: blanks, not guesses.
        (1, None, None, None, None, None, "first", 5.0, runs["A"]["run_id"]),
    ]
    # The table cuts digests to 12 characters; an unknown name lists the registered ones.
    assert cli.main(["models", NAME, "--tracking-uri", tracker.tracking_uri]) == 0
    table = capsys.readouterr().out
    assert RUNS["B"][2][:12] in table and RUNS["B"][2][:13] not in table
    assert cli.main(["models", "nope", "--tracking-uri", tracker.tracking_uri]) == 1
    err = capsys.readouterr().err
    assert "'nope'" in err and NAME in err
