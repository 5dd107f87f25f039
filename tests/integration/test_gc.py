"""`mlm-pipeline gc`: finished runs' local training state goes, never the champion's, an
unfinished run's or the newest N finished runs' of an experiment (real `train()` runs, a
real MLflow store and model registry on SQLite)."""

from __future__ import annotations

import os
import uuid

import pytest

from mlm_pipeline.cli import main
from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.app.gc import plan_gc
from mlm_pipeline.train import train


def _du(path) -> int:
    """Bytes of the regular files under `path`, counted here independently of `gc`."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


@pytest.fixture()
def runs(tmp_path, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """Two experiments of runs with real checkpoints under `<work>/train/<run id>/`:
    a: finished f1 (oldest, champion) < f2 < f3 < f4 (newest finished), killed k5, running r6
    b: finished b1. Also a directory of no MLflow run and one not named by a run id."""
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "gc-a")
    client, work = tracker.client, tmp_path / "work"
    spec = {"f1": ("gc-a", "FINISHED"), "f2": ("gc-a", "FINISHED"), "f3": ("gc-a", "FINISHED"),
            "f4": ("gc-a", "FINISHED"), "k5": ("gc-a", "KILLED"), "r6": ("gc-a", "RUNNING"),
            "b1": ("gc-b", "FINISHED")}
    ids = {}
    for i, (name, (experiment, status)) in enumerate(spec.items()):
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        run_id = client.create_run(exp_id, start_time=1_000 * (i + 1), run_name=name).info.run_id
        train(TrainConfig(micro_batch_size=4, max_steps=2, warmup_steps=1, log_every=1),
              tiny_model_config, MaskingConfig(), tiny_shard_manifest, tiny_tokenizer_manifest,
              work / "train" / run_id)
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        ids[name] = run_id
    client.create_registered_model("gc-model")
    version = client.create_model_version("gc-model", f"runs:/{ids['f1']}/model", ids["f1"])
    client.set_registered_model_alias("gc-model", "champion", version.version)
    for other in (uuid.uuid4().hex, "bert"):  # not in this store / not a run id
        (work / "train" / other / "checkpoints").mkdir(parents=True)
        (work / "train" / other / "checkpoints" / "x.bin").write_bytes(b"\0" * 100)
    return tracker, work, ids


def test_plan_keeps_champion_unfinished_and_newest(runs):
    tracker, work, ids = runs
    items = {i.run_id: i for i in plan_gc(tracker, work, keep=1)}
    removed = {name for name, rid in ids.items() if items[rid].action == "remove"}
    assert removed == {"f2", "f3"}  # f4 newest finished, f1 champion, k5/r6 unfinished
    assert "champion" in items[ids["f1"]].reason and "resumed" in items[ids["k5"]].reason
    assert len(items) == len(ids) + 1  # the unknown run is listed (kept), `bert` is not
    assert {i.bytes for i in items.values() if i.run_id in ids.values()} != {0}
    for item in items.values():
        assert item.bytes == _du(item.path)
    only_b = plan_gc(tracker, work, keep=0, experiment="gc-b")
    assert [(i.run_id, i.action) for i in only_b] == [(ids["b1"], "remove")]
    assert {ids[n] for n in ("f2", "f3", "f4", "b1")} == {
        i.run_id for i in plan_gc(tracker, work, keep=0) if i.action == "remove"}
    with pytest.raises(ValueError, match="--keep"):
        plan_gc(tracker, work, keep=-1)


def test_gc_command_dry_run_then_remove(runs, capsys):
    tracker, work, ids = runs
    state = {name: work / "train" / rid / "checkpoints" for name, rid in ids.items()}
    sizes = {name: _du(path) for name, path in state.items()}
    args = ["gc", "--work-dir", str(work), "--tracking-uri", tracker.tracking_uri,
            "--experiment", "gc-a", "--keep", "1"]
    before = _du(work)

    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line for line in out if line.startswith("would remove ")]
    assert sorted(listed) == sorted(
        f"would remove {state[n]} ({sizes[n] / 2**20:,.1f} MiB, {sizes[n]:,} bytes; run "
        f"{ids[n]}, experiment 'gc-a')" for n in ("f2", "f3"))
    assert out[-1].startswith("would free ") and f"({sizes['f2'] + sizes['f3']:,} bytes)" in out[-1]
    assert all(path.is_dir() for path in state.values()) and _du(work) == before

    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("removed ") for line in out) == 2
    assert f"({sizes['f2'] + sizes['f3']:,} bytes)" in out[-1]
    assert {n for n, path in state.items() if not path.exists()} == {"f2", "f3"}
    assert (work / "train" / ids["f2"] / "metrics.jsonl").is_file()  # only the state goes
    assert before - _du(work) == sizes["f2"] + sizes["f3"]


def test_logged_training_state_is_opt_in():
    """The MLflow copy holds the weights only unless `tracking.log_training_state`."""
    from mlm_pipeline.config import TrackingConfig

    assert TrackingConfig().log_training_state is False


def test_keep_last_runs_after_a_run_applies_to_its_experiment_only(runs):
    """`tracking.keep_last_runs=2` (what the flow calls when a run finished): experiment a
    keeps its two newest finished runs (f3, f4), the champion f1 and the unfinished ones;
    experiment b is not touched."""
    from mlm_pipeline.config import PipelineConfig
    from mlm_pipeline.app.gc import keep_last_runs

    tracker, work, ids = runs
    before = {name: _du(work / "train" / rid / "checkpoints") for name, rid in ids.items()}
    cfg = PipelineConfig(work_dir=str(work), tracking={"experiment_name": "gc-a",
                                                        "keep_last_runs": 2})
    assert keep_last_runs(tracker, cfg) == before["f2"]
    gone = {name for name, rid in ids.items()
            if not (work / "train" / rid / "checkpoints").exists()}
    assert gone == {"f2"}
    assert keep_last_runs(tracker, PipelineConfig(work_dir=str(work))) == 0  # None: keep all
