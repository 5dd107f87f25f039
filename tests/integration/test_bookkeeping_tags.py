"""Settings about which run goes on (`tracking.resume_run_id`, `tracking.resume`) and what
to trust (`train.trust_unverified_checkpoint`) are no run params: a continued run keeps the
params of the run it continues, and the `tracking.` settings are tags."""

from __future__ import annotations

from mlm_pipeline.app.open_run import open_or_continue
from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking.records import run_params


def _cfg(tmp_path, **tracking) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                     "experiment_name": "bookkeeping", **tracking}})


def test_a_continued_run_keeps_its_params_and_tags_how_it_was_continued(tmp_path):
    first = _cfg(tmp_path)
    tracker = MlflowTracker.from_config(first.tracking)
    run_id = tracker.start_run(run_params(first))
    tracker.end_run(run_id, "KILLED")
    params_before = dict(tracker.get_run(run_id).data.params)

    again = _cfg(tmp_path, resume_run_id=run_id, resume="never")
    again = again.model_copy(update={"train": again.train.model_copy(
        update={"trust_unverified_checkpoint": True})})
    # the path every continued run takes (`mlm-pipeline run` and the flows)
    assert open_or_continue(again, MlflowTracker.from_config(again.tracking), {}).continued

    run = tracker.get_run(run_id)
    assert run.data.params == params_before
    for key in ("tracking.resume_run_id", "tracking.resume", "train.trust_unverified_checkpoint"):
        assert key not in run.data.params
    assert run.data.tags["tracking.resume_run_id"] == run_id
    assert run.data.tags["tracking.resume"] == "never"
    assert params_before["train.lr"] == str(first.train.lr)  # the config's params are there
