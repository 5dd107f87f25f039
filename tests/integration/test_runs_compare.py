"""`mlm-pipeline runs` / `compare` and the loss plot on real MLflow runs (SQLite in tmp_path).

The runs are logged the way the pipeline logs them, through `MlflowTracker`: params from
`records.run_params` of two configs that differ only in `train.lr`, `train/*` per log
interval through the tracker's `MlflowSink`, `eval/*` at evaluation steps with
`log_metrics`, the `digest.shards` tag. One `runs` runs in a fresh process
(`python -m mlm_pipeline.cli`, as a user starts it); the other commands go through the same
`cli.main` in this process, since what they read is the SQLite store, not per-process state
(a fresh interpreter costs seconds of imports each). Expected values are computed here from
what was logged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from mlm_pipeline import cli
from mlm_pipeline.config_files import load_config
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.tracking.plots import LOSS_PLOT, log_loss_plot
from mlm_pipeline.tracking.records import run_params

EXPERIMENT = "compare-test"
TOKENS_PER_STEP = 512
STEPS = (10, 20, 30, 40, 50, 60)
EVAL_STEPS = (20, 40, 60)
#: Per run: lr override, train/loss and train/tokens_per_s per interval, eval/loss at
#: EVAL_STEPS, final eval/mlm_accuracy, probe/accuracy (None: not logged), finetune/accuracy
#: and finetune/scratch_accuracy (None: not logged), the probe's controls (random init, TF-IDF
#: on the same input, majority; None: not logged), `unavailable.*` tags, shards digest.
RUNS = {
    "run-a": {"lr": "0.001", "loss": (9.0, 8.0, 7.5, 7.0, 6.8, 6.6),
              "speed": (1000.0, 2000.0, 2000.0, 4000.0, 4000.0, 4000.0),
              "eval": (8.5, 7.4, 6.9), "acc": 0.125, "probe": 0.75, "finetune": (0.8125, 0.5625),
              "controls": (0.625, 0.6875, 0.5), "unavailable": {}, "digest": "a1" * 32},
    "run-b": {"lr": "0.002", "loss": (8.8, 7.7, 7.1, 6.6, 6.3, 6.1),
              "speed": (500.0, 500.0, 1000.0, 1000.0, 1000.0, 1000.0),
              "eval": (8.0, 6.9, 6.2), "acc": 0.25, "probe": None, "finetune": None,
              "controls": None, "unavailable": {"unavailable.probe": "no data: fetch failed",
                                               "unavailable.finetune": "disabled"},
              "digest": "b2" * 32},
}
CONTROLS = ("probe/accuracy_random_init", "probe/tfidf_accuracy_same_input",
            "probe/majority_accuracy")
#: An adapted run's parent figures (run-a has a parent, run-b not), each a column.
PARENT = {"eval/parent_loss": 7.25, "eval/parent_mlm_accuracy": 0.0625,
          "probe/accuracy_parent": 0.6875, "finetune/parent_accuracy": 0.75,
          "finetune/diff_parent": 0.0625, "finetune/diff_parent_ci95_low": -0.125,
          "finetune/diff_parent_ci95_high": 0.25}
WIDTH_PX, HEIGHT_PX = 800, 500
COMPARE_WIDTH_PX = 1200  # two panels side by side


def _log_run(tracker: MlflowTracker, name: str, spec: dict, with_eval: bool = True) -> str:
    tracker.run_name = name
    cfg = load_config(None, [f"train.lr={spec['lr']}"])
    # a param MLflow's transformers flavor logs on the run, on one run only
    flavor = {"tokenizer_kwargs/truncation": "True"} if name == "run-a" else {}
    run_id = tracker.start_run({**run_params(cfg), **flavor},
                               {"digest.shards": spec["digest"], **spec["unavailable"]})
    sink = tracker.sink(run_id)
    for step, loss, speed in zip(STEPS, spec["loss"], spec["speed"]):
        sink.log({"train/loss": loss, "train/lr": float(spec["lr"]) * step / STEPS[-1],
                  "train/tokens_seen": step * TOKENS_PER_STEP, "train/tokens_per_s": speed},
                 step)
    sink.close()
    if with_eval:
        for step, loss in zip(EVAL_STEPS, spec["eval"]):
            tracker.log_metrics(run_id, {"eval/loss": loss}, step=step)
        final = {"eval/mlm_accuracy": spec["acc"]}
        if spec["probe"] is not None:
            final["probe/accuracy"] = spec["probe"]
        if spec["finetune"] is not None:
            final["finetune/accuracy"], final["finetune/scratch_accuracy"] = spec["finetune"]
        if spec["controls"] is not None:
            final.update(zip(CONTROLS, spec["controls"]))
        if name == "run-a":
            final.update(PARENT)
        tracker.log_metrics(run_id, final, step=STEPS[-1])
    tracker.end_run(run_id)
    return run_id


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Two finished runs (and the tracker), run-a holding the registry alias champion;
    shared by the module's tests, which add runs only to other experiments."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    tracker = MlflowTracker(uri, EXPERIMENT)
    ids = {name: _log_run(tracker, name, spec) for name, spec in RUNS.items()}
    client = tracker.client
    client.create_registered_model("tiny-model")
    version = client.create_model_version("tiny-model", f"runs:/{ids['run-a']}/model",
                                          run_id=ids["run-a"])
    client.set_registered_model_alias("tiny-model", "champion", version.version)
    return tracker, ids


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The command in a fresh `python -m mlm_pipeline.cli` process working in `tmp_path`."""
    return subprocess.run([sys.executable, "-m", "mlm_pipeline.cli", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def run_cli(tmp_path, capsys, monkeypatch):
    """`run_cli(*args)`: the command through `cli.main` in this process, working in
    `tmp_path`, as a `CompletedProcess` (exit status, captured stdout and stderr)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()  # drop what came before
        status = cli.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["mlm-pipeline", *args], status, out, err)

    return run


def _expected_speed(speeds) -> float:
    # Every interval adds 10 steps of 512 tokens; its loop time is those tokens / speed.
    interval = 10 * TOKENS_PER_STEP
    return interval * len(speeds) / sum(interval / s for s in speeds)


def test_runs_lists_both_runs_with_the_differing_param(tmp_path, logged, run_cli):
    tracker, ids = logged
    out = _cli(tmp_path, "runs", "--experiment", EXPERIMENT, "--tracking-uri",
               tracker.tracking_uri, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["run"]: r for r in json.loads(out.stdout)}
    assert set(rows) == set(RUNS)
    for name, spec in RUNS.items():
        row = rows[name]
        assert row["id"] == ids[name] and row["status"] == "FINISHED"
        assert row["train.lr"] == spec["lr"]
        assert "model.hidden_size" not in row and "train.max_steps" not in row
        assert "tokenizer_kwargs/truncation" not in row  # not the user's param
        assert row["tokens seen"] == STEPS[-1] * TOKENS_PER_STEP
        assert row["tokens/s (seen / loop time)"] == pytest.approx(
            _expected_speed(spec["speed"]))
        assert row["eval/loss"] == spec["eval"][-1]
        assert row["eval/mlm_accuracy"] == spec["acc"]
        assert row["probe/accuracy"] == spec["probe"]
        assert (row["finetune/accuracy"], row["finetune/scratch_accuracy"]) == (
            spec["finetune"] or (None, None))
        # the controls side by side with the figure, and what was not computed, by name
        assert tuple(row[k] for k in CONTROLS) == (spec["controls"] or (None,) * 3)
        # an adapted run's parent figures beside its own; blank for a run without one
        assert {k: row[k] for k in PARENT} == (
            PARENT if name == "run-a" else dict.fromkeys(PARENT))
        assert row["not computed"] == (", ".join(sorted(
            k.removeprefix("unavailable.") for k in spec["unavailable"])) or None)
        assert row["data (digest.shards)"] == spec["digest"]
        assert row["wall time"] >= 0
    assert rows["run-a"]["registry alias"] == "champion (tiny-model v1)"
    assert rows["run-b"]["registry alias"] is None

    table = run_cli("runs", "--experiment", EXPERIMENT, "--tracking-uri", tracker.tracking_uri)
    assert table.returncode == 0, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 100  # fits 100 columns
    for name in RUNS:
        assert name in table.stdout and ids[name][:8] in table.stdout
        assert RUNS[name]["digest"][:12] not in table.stdout  # a --wide column
    assert "train.lr" in table.stdout and "model.hidden_size" not in table.stdout
    assert "tokenizer_kwargs" not in table.stdout
    assert "0.0010" not in table.stdout and "0.001" in table.stdout  # params shown as logged
    wide = run_cli("runs", "--experiment", EXPERIMENT, "--tracking-uri", tracker.tracking_uri,
                   "--wide")
    for name in RUNS:
        assert RUNS[name]["digest"][:12] in wide.stdout
    assert "champion (tiny-model v1)" in wide.stdout


def test_runs_filter_and_unknown_experiment(logged, run_cli):
    tracker, ids = logged
    out = run_cli("runs", "--experiment", EXPERIMENT, "--tracking-uri",
               tracker.tracking_uri, "--json", "--filter", "params.`train.lr` = '0.002'")
    assert out.returncode == 0, out.stderr
    assert [r["id"] for r in json.loads(out.stdout)] == [ids["run-b"]]
    bad = run_cli("runs", "--experiment", "nope", "--tracking-uri", tracker.tracking_uri)
    assert bad.returncode == 1 and "'nope'" in bad.stderr and EXPERIMENT in bad.stderr


def test_compare_writes_a_png_with_one_line_per_run(tmp_path, logged, run_cli):
    tracker, ids = logged
    png = tmp_path / "out" / "x.png"
    out = run_cli("compare", "run-a", ids["run-b"], "--out", str(png),
               "--tracking-uri", tracker.tracking_uri)
    assert out.returncode == 0, out.stderr
    assert "run-a" in out.stdout and "run-b" in out.stdout and "train.lr" in out.stdout
    with Image.open(png) as img:
        img.load()
        assert img.format == "PNG" and img.size == (COMPARE_WIDTH_PX, HEIGHT_PX)

    from mlm_pipeline.app.compare import compare_runs

    table, fig = compare_runs(tracker, ["run-a", ids["run-b"]])
    train_ax, eval_ax = fig.axes  # one panel per loss, never both on one axis
    assert train_ax.get_ylabel().startswith("train/loss")
    assert train_ax.get_title().startswith("train/loss")
    assert eval_ax.get_ylabel().startswith("eval/loss")
    assert eval_ax.get_title().startswith("eval/loss")
    assert [line.get_label() for line in train_ax.get_lines()] == ["run-a", "run-b"]
    assert [line.get_label() for line in eval_ax.get_lines()] == ["run-a", "run-b"]
    for line, spec in zip(train_ax.get_lines(), RUNS.values()):
        assert list(line.get_xdata()) == [s * TOKENS_PER_STEP for s in STEPS]
        assert list(line.get_ydata()) == list(spec["loss"])
    for line, spec in zip(eval_ax.get_lines(), RUNS.values()):
        assert list(line.get_xdata()) == [s * TOKENS_PER_STEP for s in EVAL_STEPS]
        assert list(line.get_ydata()) == list(spec["eval"])
    assert [r["run"] for r in table.rows] == ["run-a", "run-b"]


def test_compare_falls_back_to_train_loss_and_names_a_missing_run(tmp_path, logged, run_cli):
    tracker, ids = logged
    other = MlflowTracker(tracker.tracking_uri, "other-experiment")
    no_eval = _log_run(other, "run-c", RUNS["run-a"], with_eval=False)
    from mlm_pipeline.app.compare import compare_runs

    _, fig = compare_runs(tracker, [ids["run-a"], no_eval])
    train_ax, eval_ax = fig.axes
    assert [line.get_label() for line in train_ax.get_lines()] == ["run-a", "run-c"]
    assert list(train_ax.get_lines()[1].get_ydata()) == list(RUNS["run-a"]["loss"])
    assert [line.get_label() for line in eval_ax.get_lines()] == ["run-a"]
    assert "not logged by: run-c" in eval_ax.get_title()

    missing = "0" * 32
    out = run_cli("compare", ids["run-a"], missing, "--tracking-uri", tracker.tracking_uri,
                  "--out", str(tmp_path / "y.png"))
    assert out.returncode == 1 and missing in out.stderr
    assert not (tmp_path / "y.png").exists()
    out = run_cli("compare", "no-such-run", "--tracking-uri", tracker.tracking_uri)
    assert out.returncode == 1 and "'no-such-run'" in out.stderr


def test_compare_and_promote_take_the_id_prefix_that_runs_prints(tmp_path, logged, run_cli):
    """`runs` shows 8 characters of each id: `compare` and `promote` accept any unique
    prefix; an ambiguous one is refused with the candidates listed."""
    tracker, ids = logged
    shown = {name: ids[name][:8] for name in RUNS}  # as the table shows them (test above)
    out = run_cli("compare", shown["run-b"], shown["run-a"], "--json",
               "--out", str(tmp_path / "p.png"), "--tracking-uri", tracker.tracking_uri)
    assert out.returncode == 0, out.stderr
    assert [r["id"] for r in json.loads(out.stdout)] == [ids["run-b"], ids["run-a"]]

    from mlm_pipeline.app.compare import resolve_run_id

    # 17 more runs: with 16 hex digits, two of the 19 ids share their first character.
    other = MlflowTracker(tracker.tracking_uri, "prefix-experiment")
    made = [other.start_run({}) for _ in range(17)]
    for run_id in made:
        other.end_run(run_id)
    every = made + list(ids.values())
    shared = next(c for c in "0123456789abcdef" if sum(r[0] == c for r in every) > 1)
    with pytest.raises(ValueError, match=f"the prefix '{shared}' matches several MLflow "
                                         "run ids") as err:
        resolve_run_id(tracker, shared)
    assert all(r in str(err.value) for r in every if r.startswith(shared))
    assert resolve_run_id(tracker, made[0][:12]).info.run_id == made[0]

    promoted = run_cli("promote", shown["run-a"], "--tracking-uri", tracker.tracking_uri)
    assert promoted.returncode == 0, promoted.stderr
    assert "not an MLflow run id" not in promoted.stderr
    with pytest.raises(ValueError, match="no MLflow run with id, id prefix or name 'xyz0'"):
        resolve_run_id(tracker, "xyz0")


def test_log_loss_plot_logs_a_png_artifact(tmp_path, logged):
    tracker, ids = logged
    path = log_loss_plot(tracker, ids["run-a"])
    assert path == LOSS_PLOT == "plots/loss.png"
    listed = [a.path for a in tracker.client.list_artifacts(ids["run-a"], "plots")]
    assert listed == [LOSS_PLOT]
    local = tracker.client.download_artifacts(ids["run-a"], LOSS_PLOT, str(tmp_path))
    with Image.open(local) as img:
        img.load()
        assert img.format == "PNG" and img.size == (WIDTH_PX, HEIGHT_PX)


def test_loss_figure_places_eval_steps_on_the_tokens_axis():
    from mlm_pipeline.tracking.plots import loss_figure

    tokens = [(s, float(s * TOKENS_PER_STEP)) for s in STEPS]
    train = list(zip(STEPS, RUNS["run-a"]["loss"]))
    evals = [(5, 9.5), (25, 7.9), (70, 6.0)]  # before, between and after the logged steps
    lr = [(s, 1e-3) for s in STEPS]
    fig = loss_figure(train, evals, lr, tokens, title="run-a")
    loss_ax, lr_ax = fig.axes
    by_label = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(by_label["eval/loss (held out)"].get_xdata()) == [
        5 * TOKENS_PER_STEP, 25 * TOKENS_PER_STEP, 70 * TOKENS_PER_STEP]
    assert list(by_label["train/loss"].get_ydata()) == list(RUNS["run-a"]["loss"])
    assert [line.get_label() for line in lr_ax.get_lines()] == ["train/lr"]
    with pytest.raises(ValueError, match="train/tokens_seen"):
        loss_figure(train, [], [], [])


@pytest.mark.slow
@pytest.mark.full  # one slice of the landings in CI; the tests above run on every push
def test_runs_and_compare_on_two_pipeline_runs(tmp_path, prefect_api_url, fresh_mlflow_db):
    """Two real `mlm-pipeline run`s of a tiny config differing in `train.lr` (each in a
    fresh process, on the session's Prefect server), then `runs` and `compare` on them."""

    assets = Path(__file__).resolve().parents[1] / "assets"
    uri = fresh_mlflow_db(tmp_path / "mlflow.db")
    cfg = {"name": "cmp", "work_dir": str(tmp_path / "work"),
           "ingest": {"sources": [str(assets / "tiny_fr.txt")], "validation_fraction": 0.1},
           "tokenizer": {"vocab_size": 128}, "shards": {"seq_len": 32, "rows_per_shard": 16},
           "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                     "intermediate_size": 64},
           "train": {"micro_batch_size": 4, "max_steps": 12, "warmup_steps": 2,
                     "log_every": 2, "checkpoint_every": 100, "precision": "fp32"},
           "eval": {"batch_size": 8, "every_steps": 4, "periodic_rows": 8, "probes": []},
           "linear_probe": {"enabled": False},
           "tracking": {"tracking_uri": uri, "experiment_name": "cmp", "log_model": False}}
    config = tmp_path / "cmp.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cli = Path(sys.executable).parent / "mlm-pipeline"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true", PREFECT_API_URL=prefect_api_url)
    ids = []
    for lr in ("0.001", "0.003"):
        summary = tmp_path / f"summary-{lr}.json"
        run = subprocess.run([str(cli), "run", str(config), "--set", f"train.lr={lr}",
                              "--summary-json", str(summary)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        ids.append(json.loads(summary.read_text())["mlflow_run_id"])

    out = _cli(tmp_path, "runs", "--experiment", "cmp", "--tracking-uri", uri, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)}
    assert set(rows) == set(ids)
    assert [rows[i]["train.lr"] for i in ids] == ["0.001", "0.003"]
    assert "model.hidden_size" not in rows[ids[0]]
    assert all(rows[i]["tokens seen"] == 12 * 4 * 32 for i in ids)
    png = tmp_path / "compare.png"
    out = _cli(tmp_path, "compare", *ids, "--out", str(png), "--tracking-uri", uri)
    assert out.returncode == 0, out.stderr
    with Image.open(png) as img:
        img.load()
        assert img.size == (COMPARE_WIDTH_PX, HEIGHT_PX)


def test_runs_without_experiment_lists_the_newest_runs_experiment_names_whole(
        tmp_path, run_cli, monkeypatch):
    """Right after a run logged to `mlm-pipeline-tiny`, `runs` with no `--experiment`
    lists that experiment (and says so); in a 160-column terminal, with many differing
    params, each run name stays whole on one line."""
    import re

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowTracker(uri, "older-experiment").start_run({})
    tiny = MlflowTracker(uri, "mlm-pipeline-tiny")
    names = ["tiny-modern-1000-" + "x" * 60 + "-3fa2c1", "tiny-modern-60-" + "y" * 60]
    for i, name in enumerate(names):
        tiny.run_name = name
        params = {f"train.option_{k:02d}": f"value-{i}-{k}-" + "z" * 12 for k in range(12)}
        tiny.end_run(tiny.start_run(params))
    monkeypatch.setenv("COLUMNS", "160")  # read by rich when the command prints
    monkeypatch.setenv("FORCE_COLOR", "1")
    out = run_cli("runs", "--tracking-uri", uri)
    assert out.returncode == 0, out.stderr
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)
    assert "experiment mlm-pipeline-tiny" in text and "the newest run's" in text
    assert "older-experiment" not in text
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 160
    for name in names:
        assert any(name in line for line in lines), name
