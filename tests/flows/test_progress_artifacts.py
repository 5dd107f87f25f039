"""Under Prefect, each long data stage keeps a progress artifact (`<stage>-progress`) that
ends at 100 %; without a terminal display the tasks log progress lines. The `full` tier: CI
runs it in one slice of the landings, every one with CI_FULL=1."""

from __future__ import annotations

import logging

import pytest

from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining
from tests.flows.test_pretraining_flow import _overrides, run_tree


@pytest.mark.slow  # a whole flow run: about a minute on two cores
@pytest.mark.full
def test_data_stages_publish_progress_artifacts(tmp_path, caplog):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with caplog.at_level(logging.INFO, logger="mlm_pipeline.progress"):
        state = mlm_pretraining(
            PretrainParams(config="tiny", overrides=[*_overrides(tmp_path, uri),
                                                     "tracking.log_model=false"]),
            return_state=True)
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=run_tree(state.state_details.flow_run_id))))
    progress = {a.key: float(a.data) for a in artifacts if a.type == "progress"}
    for key in ("ingest-progress", "tokenizer-progress", "shards-train-progress",
                "shards-validation-progress", "evaluate-progress", "training-progress"):
        assert progress[key] == 100.0, (key, progress)
    # No display was set (not the CLI): the tasks logged progress lines (LogProgress), each
    # stage its first update and its last line.
    lines = [r.getMessage() for r in caplog.records if r.name == "mlm_pipeline.progress"]
    for stage in ("ingest", "tokenizer", "shards train", "evaluate"):
        assert any(line.startswith(f"progress: {stage}") and "done in" in line
                   for line in lines), (stage, lines)
