"""What the flow logs from evaluation, read back with `MlflowClient` on SQLite: the
validation curve (periodic points, then the final evaluation), the fill-mask table, the
downstream linear probe at each evaluation, the fine-tuning evaluation, `plots/loss.png`,
and the summary's link."""

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from mlm_pipeline_flows.pretraining import PretrainParams, mlm_pretraining

ASSETS = Path(__file__).resolve().parents[1] / "assets"
PROBES = ['{"text": "Le [MASK] est là.", "answers": ["chat"]}', '"Une [MASK] de plus."']


@pytest.fixture(scope="module")
def reviews_csv(tmp_path_factory, tiny_paragraphs) -> Path:
    """A labelled CSV in the polarity file's format (the real one comes from PyPI)."""
    sentences = [s.strip() for p in tiny_paragraphs for s in p.split(".") if s.strip()]
    path = tmp_path_factory.mktemp("probe") / "reviews.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        for i in range(80):
            good = i % 2 == 0
            writer.writerow([f"{sentences[i % len(sentences)]}. "
                             f"{'Magnifique, je recommande' if good else 'Ennuyeux et décevant'}"
                             f" ({i})", "1" if good else "-1"])
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, reviews_csv):
    tmp = tmp_path_factory.mktemp("flow-eval")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    overrides = [
        f"work_dir={tmp / 'work'}", f"ingest.sources=[{ASSETS / 'tiny_fr.txt'}]",
        "ingest.validation_fraction=0.15", "tokenizer.vocab_size=128", "shards.seq_len=16",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "train.micro_batch_size=4", "train.max_steps=6",
        "train.warmup_steps=2", "train.log_every=1", "eval.max_rows=20",
        "eval.every_steps=2", "eval.periodic_rows=6", f"eval.probes=[{', '.join(PROBES)}]",
        f"linear_probe.data_path={reviews_csv}", "linear_probe.at_each_eval=true",
        "finetune.enabled=true", "finetune.epochs=1", "finetune.batch_size=16",
        "finetune.lr=[1e-3]", "finetune.seeds=2", "linear_probe.random_init_seeds=1",
        f"tracking.tracking_uri={uri}", "tracking.experiment_name=flow-eval",
        "tracking.log_model=false",  # these tests are about the evaluations, not the model
    ]
    state = mlm_pretraining(PretrainParams(config="tiny", overrides=overrides),
                            return_state=True)
    assert state.is_completed()
    return state.result(), MlflowClient(tracking_uri=uri), tmp


def test_validation_curve_has_the_periodic_points_then_the_final_evaluation(run):
    summary, client, _ = run
    run_id = summary["mlflow_run_id"]
    for key in ("eval/loss", "eval/mlm_accuracy", "eval/top5_accuracy", "eval/perplexity",
                "eval/probe_accuracy", "probe/accuracy"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == [2, 4, 6], key
    # The controls do not change during training: computed once, at the final evaluation.
    for key in ("probe/tfidf_accuracy", "probe/accuracy_random_init", "eval/mlm_probability"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [6], key
    final = client.get_run(run_id).data.metrics
    assert final["eval/loss"] == pytest.approx(summary["metrics"]["eval/loss"])
    assert final["probe/accuracy"] == pytest.approx(summary["metrics"]["probe/accuracy"])


def test_finetune_metrics_are_logged_once_at_the_final_step(run):
    summary, client, _ = run
    run_id = summary["mlflow_run_id"]
    for key in ("finetune/accuracy", "finetune/scratch_accuracy", "finetune/diff",
                "finetune/diff_ci95_low", "finetune/tfidf_accuracy",
                "finetune/tfidf_accuracy_same_input", "finetune/majority_accuracy",
                "finetune/train_rows", "finetune/dev_rows", "finetune/test_rows",
                "finetune/epochs", "probe/accuracy_random_init"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [6], key
        assert history[0].value == pytest.approx(summary["metrics"][key]), key
    final = client.get_run(run_id).data.metrics
    # 80 unique rows, half of each class: 0.3 of 40 = 12 per class in test, 0.15 of the
    # other 28 = 4 per class in dev, 24 per class in train.
    assert (final["finetune/train_rows"], final["finetune/dev_rows"],
            final["finetune/test_rows"]) == (48, 8, 24)
    assert final["finetune/majority_accuracy"] == 0.5 and final["finetune/epochs"] == 1
    tags = client.get_run(run_id).data.tags
    assert tags["unavailable.probe/accuracy_random_init_sd"].startswith("one random-init")
    assert len(tags["digest.task.polarity-fr"]) == 64
    from mlm_pipeline.app.summary import training_lines

    lines = training_lines(summary)
    assert any(line.startswith("Fine-tuning (2 seeds, up to 1 epochs on 48 rows") and
               "from random weights" in line and "pretrained - scratch" in line
               for line in lines)
    assert any(line.startswith("Linear probe (24 test rows): trained ") and "random init"
               in line for line in lines)
    assert any(line.startswith("Held-out masked LM at 15 % masking") for line in lines)


def read_table(client, run_id, tmp):
    """The run's fill-mask table as row dicts, read from the artifact's JSON (pandas
    `orient="split"`: columns and data); MlflowClient.load_table searches runs through the
    fluent API's tracking URI, not the client's."""
    tags = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "eval/fill_mask_table.json", "type": "table"} in tags  # the UI's table view
    path = client.download_artifacts(run_id, "eval/fill_mask_table.json", str(tmp))
    table = json.loads(Path(path).read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def test_fill_mask_table_holds_every_evaluation(run):
    summary, client, tmp = run
    rows = read_table(client, summary["mlflow_run_id"], tmp)
    assert len(rows) == 3 * len(PROBES) * 5  # evaluations x sentences x top-5
    assert sorted({r["step"] for r in rows}) == [2, 4, 6]
    for step in (2, 4, 6):
        for sentence in {r["sentence"] for r in rows}:
            group = [r for r in rows if r["step"] == step and r["sentence"] == sentence]
            assert [r["rank"] for r in group] == [1, 2, 3, 4, 5]
            probs = [r["probability"] for r in group]
            assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)


def test_loss_plot_is_logged_and_linked_from_the_summary(run):
    summary, client, tmp = run
    run_id = summary["mlflow_run_id"]
    path = Path(client.download_artifacts(run_id, "plots/loss.png", str(tmp)))
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (800, 500)
    assert summary["loss_plot"] == "plots/loss.png"
