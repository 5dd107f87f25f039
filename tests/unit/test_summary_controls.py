"""The run summary puts every downstream figure beside its controls, and names each figure
it could not compute with the reason (`app.summary.evaluation_lines`)."""

from mlm_pipeline.app.summary import evaluation_lines

METRICS = {
    "eval/mlm_probability": 0.15, "eval/mlm_accuracy": 0.3971, "eval/loss": 3.5,
    "eval/baseline_accuracy": 0.0412, "eval/mlm_accuracy_at_train_rate": 0.3668,
    "eval/loss_at_train_rate": 3.9,
    "probe/accuracy": 0.6612, "probe/accuracy_random_init": 0.6150,
    "probe/accuracy_random_init_sd": 0.0351, "probe/tfidf_accuracy": 0.7970,
    "probe/tfidf_accuracy_same_input": 0.7350, "probe/majority_accuracy": 0.5710,
    "probe/test_rows": 385,
    "finetune/accuracy": 0.7065, "finetune/accuracy_sd": 0.0101,
    "finetune/scratch_accuracy": 0.6987, "finetune/scratch_accuracy_sd": 0.0123,
    "finetune/diff": 0.0078, "finetune/diff_ci95_low": -0.0201,
    "finetune/diff_ci95_high": 0.0357, "finetune/seeds": 3,
    "finetune/tfidf_accuracy": 0.7970, "finetune/tfidf_accuracy_same_input": 0.7350,
    "finetune/majority_accuracy": 0.5710,
}


def test_each_figure_stands_beside_its_controls_on_one_line():
    lines = evaluation_lines({"metrics": METRICS, "unavailable": {}})
    held_out = next(line for line in lines if line.startswith("Held-out"))
    assert "at 15 % masking" in held_out and "0.3971" in held_out and "0.0412" in held_out
    assert "0.3668" in held_out  # the training-rate figure beside, named as such
    probe = next(line for line in lines if line.startswith("Linear probe"))
    for value in ("0.6612", "0.6150 +- 0.0351", "0.7970", "0.7350", "0.5710"):
        assert value in probe, value
    assert probe.index("0.6612") < probe.index("0.6150")
    tuned = next(line for line in lines if line.startswith("Fine-tuning (3 seeds"))
    for value in ("0.7065 +- 0.0101", "0.6987 +- 0.0123", "+0.0078", "[-0.0201, +0.0357]",
                  "0.7970", "0.7350", "0.5710"):
        assert value in tuned, value
    assert not any(line.startswith("Not computed") for line in lines)


def test_a_figure_not_computed_is_named_with_its_reason():
    metrics = {k: v for k, v in METRICS.items() if not k.startswith("finetune/")}
    del metrics["probe/accuracy_random_init_sd"]
    reasons = {"finetune": "disabled (finetune.enabled: false)",
               "probe/accuracy_random_init_sd": "one random-init seed: no spread"}
    lines = evaluation_lines({"metrics": metrics, "unavailable": reasons})
    assert not any(line.startswith("Fine-tuning") for line in lines)
    probe = next(line for line in lines if line.startswith("Linear probe"))
    assert "random init 0.6150 |" in probe  # the mean without an invented spread
    assert [line for line in lines if line.startswith("Not computed")] == [
        f"Not computed: {k}: {v}" for k, v in sorted(reasons.items())]


PARENT = {
    "eval/parent_loss": 5.25, "eval/parent_mlm_accuracy": 0.1234,
    "probe/accuracy_parent": 0.6421,
    "finetune/parent_accuracy": 0.6902, "finetune/parent_accuracy_sd": 0.0111,
    "finetune/parent_lr": 3e-4, "finetune/parent_epoch": 2,
    "finetune/diff_parent": 0.0163, "finetune/diff_parent_ci95_low": -0.0042,
    "finetune/diff_parent_ci95_high": 0.0368,
}


def test_an_adapted_run_shows_its_parent_beside_each_figure():
    lines = evaluation_lines({"metrics": {**METRICS, **PARENT}, "unavailable": {}})
    held_out = next(line for line in lines if line.startswith("Held-out"))
    assert "the parent (before adaptation)" in held_out
    assert "accuracy 0.1234, loss 5.2500" in held_out
    probe = next(line for line in lines if line.startswith("Linear probe"))
    assert probe.index("0.6612") < probe.index("parent 0.6421") < probe.index("0.6150")
    tuned = next(line for line in lines if line.startswith("Fine-tuning (3 seeds"))
    for value in ("parent 0.6902 +- 0.0111 (lr 0.0003, epoch 2)",
                  "adapted - parent +0.0163 [-0.0042, +0.0368]", "+0.0078"):
        assert value in tuned, value
    # without a parent, no parent words at all
    plain = evaluation_lines({"metrics": METRICS, "unavailable": {}})
    assert not any("parent" in line for line in plain)


def test_a_parent_figure_not_computed_is_named_with_its_reason():
    why = "parent '/gone' not readable: /gone: no such directory"
    lines = evaluation_lines({"metrics": METRICS, "unavailable": {
        "eval/parent_loss": why, "probe/accuracy_parent": why}})
    assert f"Not computed: eval/parent_loss: {why}" in lines
    assert f"Not computed: probe/accuracy_parent: {why}" in lines
