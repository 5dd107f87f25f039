"""A rerun never continues an unfinished run backwards (`tracking.resume.plan`): against a
real MLflow store (SQLite) with real runs, params and tags; the newest checkpoint of a run
is given as a path (its step is in its name).

- a run killed at step 100 of 200: `train.max_steps` 60, 100 or 150 is refused naming
  `--fresh` and `tracking.resume_run_id`; 300 continues it;
- a run that trained all its 60 steps and failed after training: 60 finishes it; 10 or 200
  start a new run (named with `tracking.resume_run_id`, they are refused);
- through `mlm-pipeline run`: the refusal is one line on stderr and exit status 1.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mlm_pipeline import cli
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config_files import load_config
from mlm_pipeline.errors import ResumeRefusedError
from mlm_pipeline.tracking import MlflowTracker, resume
from mlm_pipeline.tracking.records import run_params

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny_fr.txt"
URI = ""  # the module's MLflow database (`_one_database`)


@pytest.fixture(scope="module", autouse=True)
def _one_database(tmp_path_factory):
    """One MLflow database for the module (creating one takes seconds); each test has an
    experiment of its own (`_overrides`), so each has its own job."""
    global URI
    URI = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def _overrides(tmp_path: Path, max_steps: int) -> list[str]:
    return [f"work_dir={tmp_path / 'work'}", f"ingest.sources=[{ASSET}]",
            f"tracking.tracking_uri={URI}", f"tracking.experiment_name={tmp_path.name}",
            f"train.max_steps={max_steps}"]


def _config(tmp_path: Path, max_steps: int) -> PipelineConfig:
    return load_config("tiny", _overrides(tmp_path, max_steps))


def _failed_run(tmp_path: Path, max_steps: int) -> tuple[MlflowTracker, str]:
    """A FAILED run of the tiny job trained towards `max_steps`, as `start_tracking`
    opens it (params and job key)."""
    cfg = _config(tmp_path, max_steps)
    tracker = MlflowTracker.from_config(cfg.tracking)
    run_id = tracker.start_run(run_params(cfg), {resume.JOB_KEY_TAG: resume.job_key(cfg)})
    tracker.end_run(run_id, "FAILED")
    return tracker, run_id


def _find(tracker: MlflowTracker, tmp_path: Path, max_steps: int, step: int):
    cfg = _config(tmp_path, max_steps)
    return resume.find_resumable(tracker, cfg, run_params(cfg),
                                 lambda _: tmp_path / f"step-{step:08d}")


@pytest.mark.parametrize("max_steps", [60, 100, 150])
def test_a_smaller_budget_is_refused(tmp_path, max_steps):
    # at or below the checkpoint: going back; between it and 200: a schedule cut short
    tracker, run_id = _failed_run(tmp_path, 200)
    with pytest.raises(ResumeRefusedError) as refused:
        _find(tracker, tmp_path, max_steps, step=100)
    message = str(refused.value)
    assert "\n" not in message
    assert run_id in message and "step 100" in message
    assert f"train.max_steps={max_steps}" in message
    assert "--fresh" in message and "tracking.resume_run_id" in message
    assert tracker.get_run(run_id).info.status == "FAILED"  # not reopened


def test_a_larger_budget_continues_the_training(tmp_path):
    tracker, run_id = _failed_run(tmp_path, 200)
    found = _find(tracker, tmp_path, 300, step=100)
    assert (found.run_id, found.step, found.finish) == (run_id, 100, False)
    assert found.compatible["train.max_steps"] == ("200", "300")
    # recorded by continue_run: the budget in effect is the new one
    cfg = _config(tmp_path, 300)
    resume.continue_run(tracker, run_id, run_params(cfg), {}, found.step, found.compatible)
    run = tracker.get_run(run_id)
    assert json.loads(run.data.tags["mlm.resume.1"])["changed"]["train.max_steps"] == {
        "from": "200", "to": "300"}
    assert resume.run_budget(run.data.params, run.data.tags) == 300
    assert run.data.tags["mlm.max_steps"] == "300"  # the param stays "200" (immutable)


def test_the_summary_names_the_budget_trained_to():
    from mlm_pipeline.app.summary import training_lines

    lines = training_lines({"steps": 300, "max_steps": 300, "tokens_seen": 9600,
                            "stop_reason": "max_steps"})
    assert "Stop reason: max_steps (all 300 train.max_steps trained)" in lines


def test_a_run_that_trained_its_budget_is_finished_by_the_same_budget(tmp_path, caplog):
    tracker, run_id = _failed_run(tmp_path, 60)
    found = _find(tracker, tmp_path, 60, step=60)
    assert (found.run_id, found.finish) == (run_id, True)
    cfg = _config(tmp_path, 60)
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.tracking.resume"):
        resume.continue_run(tracker, run_id, run_params(cfg), {}, 60, finish=True)
    (line,) = [r.getMessage() for r in caplog.records
                 if r.name == "mlm_pipeline.tracking.resume" and run_id in r.getMessage()]
    assert line.startswith(f"finishing MLflow run {run_id}") and "--fresh" in line


@pytest.mark.parametrize("max_steps", [10, 200])
def test_another_budget_leaves_a_trained_run_alone(tmp_path, max_steps, caplog):
    tracker, run_id = _failed_run(tmp_path, 60)
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.tracking.resume"):
        assert _find(tracker, tmp_path, max_steps, step=60) is None
    assert any(run_id in r.getMessage() and "a new run starts" in r.getMessage()
               for r in caplog.records)
    assert tracker.get_run(run_id).info.status == "FAILED"  # untouched
    with pytest.raises(ResumeRefusedError, match="--fresh"):  # named, it is refused
        resume.plan(run_id, 60, 60, max_steps, named=True)


def test_every_continuing_line_names_fresh(tmp_path, caplog):
    tracker, run_id = _failed_run(tmp_path, 200)
    cfg = _config(tmp_path, 200)
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.tracking.resume"):
        resume.continue_run(tracker, run_id, run_params(cfg), {}, 100)
    (line,) = [r.getMessage() for r in caplog.records
                 if r.name == "mlm_pipeline.tracking.resume" and run_id in r.getMessage()]
    assert line.startswith(f"continuing MLflow run {run_id} from step 100") and "--fresh" in line


def test_run_refuses_in_one_line_with_status_1(tmp_path, capsys, monkeypatch):
    """`mlm-pipeline run` as a user meets it, up to the flow's first task: the run's
    real `start-tracking` (its function, without a Prefect server) meets a run killed at
    step 100 of 200 and a rerun with train.max_steps=60."""
    from mlm_pipeline_flows.tracking_tasks import start_tracking

    monkeypatch.chdir(tmp_path)
    tracker, run_id = _failed_run(tmp_path, 200)
    checkpoints = tmp_path / "work" / "train" / run_id / "checkpoints"
    monkeypatch.setattr("mlm_pipeline.app.open_run.newest_checkpoint",
                        lambda cfg, rid: checkpoints / "step-00000100")

    def run_flow(config: str, overrides: list[str]):
        return start_tracking.fn(load_config(config, overrides), "flows/pretraining.py")

    argv = ["run", "tiny", *(a for o in _overrides(tmp_path, 60) for a in ("--set", o))]
    status = cli.main(argv, run_flow=run_flow)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[-1].startswith(f"mlm-pipeline: error: cannot continue MLflow run {run_id} "
                              "from step 100 with train.max_steps=60")
    assert "--fresh" in err[-1]
    assert tracker.get_run(run_id).info.status == "FAILED"  # not reopened
