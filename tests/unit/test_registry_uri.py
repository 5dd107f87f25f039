"""The registry's temporary MLflow tracking URI leaves the process's own setting as it was."""

from mlm_pipeline.tracking.registry import _tracking_uri


def test_the_environment_tracking_uri_survives_the_block(monkeypatch, tmp_path):
    mine = f"sqlite:///{tmp_path / 'mine.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mine)
    with _tracking_uri(f"sqlite:///{tmp_path / 'other.db'}"):
        pass
    import os

    # MLflow's restore of an unset URI unsets the variable; deployments read it afterwards
    assert os.environ["MLFLOW_TRACKING_URI"] == mine
