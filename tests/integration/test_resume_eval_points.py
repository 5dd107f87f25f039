"""A run killed during a periodic evaluation, after MLflow got that step's `train/loss`, and
resumed from its previous checkpoint: MLflow ends with every key once per step, the
evaluation point of the interrupted step included (the resumed run sends, key by key, only
the steps MLflow lacks)."""

import pytest
from mlflow.tracking import MlflowClient

from mlm_pipeline.app.training_run import live_tracking
from mlm_pipeline.config import MaskingConfig, TrainConfig
from mlm_pipeline.config_files import load_config
from mlm_pipeline.tracking.tracker import MlflowTracker
from mlm_pipeline.train import train

EVERY, STEPS, KILLED_AT = 2, 5, 4


class Killed(Exception):
    """Stands for the process dying in the middle of an evaluation."""


def _train_cfg():
    # checkpoints at 2 and 4: the kill during the evaluation of step 4 comes before the
    # checkpoint of step 4 (the loop evaluates, then saves), so the resume starts at 2
    return TrainConfig(micro_batch_size=4, max_steps=STEPS, warmup_steps=1, log_every=1,
                       lr=1e-3, seed=5, checkpoint_every=EVERY, keep_last_checkpoints=10)


def _train_once(cfg, tracker, run_id, out, model_cfg, shards, tokenizer, kill_at=None):
    """What the flow's train task does: the run's sinks from `live_tracking`, closed (so
    flushed) however training ends."""
    sink, evaluator = live_tracking(cfg, shards, tokenizer, tracker, run_id)
    if kill_at is not None:
        real = evaluator.__call__

        class Dying(type(evaluator)):
            def __call__(self, model, step, precision):
                if step == kill_at:
                    raise Killed(step)
                return real(model, step, precision)

        evaluator.__class__ = Dying
    try:
        return train(_train_cfg(), model_cfg, MaskingConfig(), shards, tokenizer, out, sink,
                     evaluator)
    finally:
        sink.close()


def test_a_kill_during_an_evaluation_loses_no_point(
        tmp_path, fresh_mlflow_db, tiny_model_config, tiny_shard_manifest,
        tiny_tokenizer_manifest):
    cfg = load_config("tiny", [f"eval.every_steps={EVERY}", "eval.periodic_rows=4",
                               "eval.batch_size=4", "eval.probes=[]"])
    uri = fresh_mlflow_db(tmp_path / "mlflow.db")
    tracker = MlflowTracker(uri, "resume-eval")
    run_id = tracker.start_run({}, run_name="killed-in-eval")
    args = (cfg, tracker, run_id, tmp_path / "train", tiny_model_config,
            tiny_shard_manifest, tiny_tokenizer_manifest)

    with pytest.raises(Killed):
        _train_once(*args, kill_at=KILLED_AT)
    client = MlflowClient(uri)
    # the state the resume meets: step 4's train/loss was sent, its evaluation point not
    assert max(m.step for m in client.get_metric_history(run_id, "train/loss")) == KILLED_AT
    assert [m.step for m in client.get_metric_history(run_id, "eval/loss")] == [EVERY]

    _train_once(*args)
    train_steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    eval_steps = sorted(m.step for m in client.get_metric_history(run_id, "eval/loss"))
    assert train_steps == list(range(1, STEPS + 1))
    assert eval_steps == [2, 4]  # every_steps=2 before the last step (5)
