"""The run's MLflow model and the registry's champion and challenger, against a real
MLflow SQLite backend with real tiny trained models (`tracking.registry.publish`).

Four runs are trained, evaluated and published in order under one registered name:

- A (6 steps) is the first version: champion;
- B (2 steps, worse) gets challenger, champion stays A;
- C (20 steps, better) takes champion;
- D (20 steps on other shards: another `seq_len`) is not compared: challenger only.

Then the consumers: `fill-mask` and `export` with each kind of SOURCE, one-line errors for
bad ones, `promote`, and `mlflow.pyfunc` / `mlflow.transformers` loading by alias in a
fresh process.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_pipeline import cli
from mlm_pipeline.config import (
    EvalConfig,
    MaskingConfig,
    ModelConfig,
    PipelineConfig,
    ShardConfig,
    TokenizerConfig,
    TrackingConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate, fill_mask
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer, train_tokenizer
from mlm_pipeline.tracking import MlflowTracker, registry
from mlm_pipeline.tracking.records import record_results
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import load_model
from mlm_pipeline.train.export import export_checkpoint

transformers = pytest.importorskip("transformers")
mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

NAME = "mlm-registry-test"
TEXT = "Le [MASK] du chat est doux et chaud."
STEPS = {"A": 6, "B": 2, "C": 20, "D": 20}


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(scope="module")
def client(uri) -> MlflowClient:
    """An independent reader of the same database."""
    return MlflowClient(tracking_uri=uri)


def _aliases(client: MlflowClient) -> dict[str, int]:
    return {alias: int(client.get_model_version_by_alias(NAME, alias).version)
            for alias in (registry.CHAMPION, registry.CHALLENGER)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus_manifest, uri, client):
    """name -> dict(run_id, trained, evaluated, shards, tok, result, aliases after)."""
    work = tmp_path_factory.mktemp("registry-work")
    tok = train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest, work)
    shards = {seq: write_shards(ShardConfig(seq_len=seq, rows_per_shard=64,
                                            encode_batch_size=4),
                                tiny_corpus_manifest, tok, work) for seq in (32, 24)}
    tracker = MlflowTracker(uri, experiment_name=NAME)
    model = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=2,
                        intermediate_size=64)
    out = {}
    for name, steps in STEPS.items():
        sh = shards[24 if name == "D" else 32]
        cfg = TrainConfig(micro_batch_size=4, max_steps=steps, warmup_steps=1, lr=3e-3,
                          checkpoint_every=steps, precision="fp32", seed=3)
        trained = train(cfg, model, MaskingConfig(), sh, tok, work / "train" / name)
        evaluated = evaluate(EvalConfig(), trained, sh, tok, work)
        run_id = tracker.start_run({"run": name})
        tracker.log_metrics(run_id, evaluated.metrics, step=trained.steps)
        result = registry.publish(tracker, run_id, NAME, trained, evaluated, tok.output_dir,
                                  TEXT)
        tracker.end_run(run_id)
        out[name] = {"run_id": run_id, "trained": trained, "evaluated": evaluated,
                     "shards": sh, "tok": tok, "result": result, "aliases": _aliases(client),
                     "loss": evaluated.metrics["eval/loss"]}
    return out


def test_losses_order_the_scenario(runs):
    # The scenario needs B worse than A and C better (fewer / more steps, same data).
    assert runs["B"]["loss"] > runs["A"]["loss"] > runs["C"]["loss"]


def test_first_run_is_champion(runs):
    a = runs["A"]
    assert a["result"]["decision"] == "first" and a["result"]["version"] == 1
    assert a["aliases"] == {"champion": 1, "challenger": 1}


def test_worse_run_is_challenger_and_champion_stays(runs):
    b = runs["B"]
    assert b["result"]["decision"] == "kept" and b["result"]["version"] == 2
    assert b["aliases"] == {"champion": 1, "challenger": 2}
    assert b["result"]["champion_before"]["eval_loss"] == runs["A"]["loss"]


def test_better_run_takes_champion(runs):
    c = runs["C"]
    assert c["result"]["decision"] == "promoted"
    assert c["aliases"] == {"champion": 3, "challenger": 3}
    assert c["result"]["champion_before"]["version"] == 1


def test_run_on_other_data_is_not_compared(runs):
    d = runs["D"]
    assert d["result"]["decision"] == "not_compared"
    assert d["aliases"] == {"champion": 3, "challenger": 4}
    assert "not compared" in d["result"]["reason"] and "other data" in d["result"]["reason"]
    assert d["shards"].digest[:12] in d["result"]["reason"]
    assert runs["C"]["shards"].digest[:12] in d["result"]["reason"]


def test_decision_losses_and_digest_are_on_the_run(runs, client):
    c = runs["C"]
    run = client.get_run(c["run_id"])
    ev = c["evaluated"]
    data = {"shards": c["shards"].digest, "seed": EvalConfig().seed, "max_rows": None,
            "masking": ev.config["masking"]}
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    tags = run.data.tags
    assert tags["registry.decision"] == "promoted" and tags["registry.version"] == "3"
    assert tags["registry.champion_version"] == "3" and tags["registry.champion_before"] == "1"
    assert tags["registry.champion_before_run_id"] == runs["A"]["run_id"]
    assert tags["registry.eval_data"] == digest and tags["registry.shards"] == c["shards"].digest
    assert run.data.metrics["registry/eval_loss"] == c["loss"]
    assert run.data.metrics["registry/champion_eval_loss"] == runs["A"]["loss"]
    version = client.get_model_version(NAME, "3")
    assert version.run_id == c["run_id"] and version.tags["eval_data"] == digest
    assert float(version.tags["eval_loss"]) == c["loss"]


def test_the_run_model_is_a_fill_mask_transformers_model(runs, client, uri):
    a = runs["A"]
    tracking_uri, uri = uri, a["result"]["model_uri"]
    with mlflow.tracking._tracking_service.utils._use_tracking_uri(tracking_uri):
        info = mlflow.models.get_model_info(uri)
    assert info.flavors["transformers"]["task"] == "fill-mask"
    assert info.signature.inputs.input_types() == [mlflow.types.DataType.string]
    assert info.saved_input_example_info is not None
    logged = client.get_logged_model(uri.removeprefix("models:/"))
    assert logged.source_run_id == a["run_id"]
    # In the run's experiment, next to the database (not ./mlruns of the Default one).
    run = client.get_run(a["run_id"])
    assert logged.experiment_id == run.info.experiment_id
    assert logged.artifact_location.startswith(
        str(Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts"))
    # `step` = the final step: the run's metrics at that step are the model's.
    steps = {m.key: m.step for m in logged.metrics}
    assert steps["eval/loss"] == STEPS["A"]


def test_training_state_is_uploaded_only_when_asked(runs, uri, client):
    a = runs["A"]
    tracker = MlflowTracker(uri, experiment_name=NAME)
    for flag in (False, True):
        run_id = tracker.start_run({"flag": flag})
        cfg = PipelineConfig(tracking=TrackingConfig(log_training_state=flag))
        record_results(tracker, run_id, cfg, a["trained"], a["evaluated"])
        ckpts = [x.path for x in client.list_artifacts(run_id, "checkpoints")]
        assert ckpts == ([f"checkpoints/step-{STEPS['A']:08d}"] if flag else [])
        tracker.end_run(run_id)


def _cli_json(capsys, argv) -> dict | list:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_fill_mask_from_the_champion(runs, uri, capsys):
    c = runs["C"]
    ckpt = c["trained"].file(c["trained"].checkpoint_dir)
    want = fill_mask(load_model(ckpt), Tokenizer.load(c["tok"]), [TEXT], seq_len=32)
    for source in (f"models:/{NAME}@champion", c["run_id"]):
        got = _cli_json(capsys, ["fill-mask", source, TEXT, "--tracking-uri", uri])
        assert [p["token"] for p in got[0]["predictions"][0]] == \
            [p["token"] for p in want[0]["predictions"][0]]
        for p, q in zip(got[0]["predictions"][0], want[0]["predictions"][0]):
            assert p["probability"] == pytest.approx(q["probability"], abs=1e-5)


def test_export_from_each_mlflow_source(runs, uri, capsys, tmp_path):
    from safetensors.torch import load_file

    a = runs["A"]
    ref = export_checkpoint(a["trained"].file(a["trained"].checkpoint_dir), tmp_path / "ref")
    for i, source in enumerate((a["run_id"], f"models:/{NAME}/1",
                                a["result"]["model_uri"])):
        out = tmp_path / f"out{i}"
        got = _cli_json(capsys, ["export", source, str(out), "--tracking-uri", uri])
        assert got["source"] == source and set(got["files"]) == {
            p.name for p in ref.iterdir()}
        for name in ("tokenizer.json", "README.md"):
            assert (out / name).read_text() == (ref / name).read_text()
        w, r = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
        assert sorted(w) == sorted(r) and all((w[k] == r[k]).all() for k in w)


@pytest.mark.parametrize("command", ["export", "fill-mask"])
@pytest.mark.parametrize("case", ["garbage", "unknown-run", "run-without-model", "alias"])
def test_bad_source_is_one_line(case, command, runs, uri, tmp_path, capsys):
    tracker = MlflowTracker(uri, experiment_name=NAME + "-bare")
    source, expect = {
        "garbage": ("not-a-source", "is not a checkpoint directory"),
        "unknown-run": ("0" * 32, "not found"),
        "run-without-model": (tracker.start_run({}), "logged no model"),
        "alias": (f"models:/{NAME}@nope", "no such MLflow model"),
    }[case]
    rest = [str(tmp_path / "o")] if command == "export" else [TEXT]
    capsys.readouterr()  # what the setup logged (starting a run) is not the command's output
    assert cli.main([command, source, *rest, "--tracking-uri", uri]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlm-pipeline: error: ") and expect in err and source in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_load_by_alias_in_a_fresh_process(runs, uri, tmp_path):
    c = runs["C"]
    exported = export_checkpoint(c["trained"].file(c["trained"].checkpoint_dir),
                                 tmp_path / "c")
    want = transformers.pipeline("fill-mask", model=str(exported))(TEXT)
    code = (
        "import json, sys, mlflow\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        f"m = mlflow.pyfunc.load_model('models:/{NAME}@champion')\n"
        f"p = mlflow.transformers.load_model('models:/{NAME}@champion')\n"
        f"print(json.dumps([list(m.predict([{TEXT!r}])), p({TEXT!r}),\n"
        # Longer than seq_len (32 tokens): the served model truncates instead of failing.
        f"                  list(m.predict([{TEXT + ' Le chat dort.' * 12!r}]))]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1",
                               "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    pyfunc_out, pipe_out, long_out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(long_out) == 1 and isinstance(long_out[0], str)
    assert pyfunc_out == [want[0]["token_str"]]
    assert [x["token"] for x in pipe_out] == [x["token"] for x in want]


def test_promote_forces_champion(runs, uri, client, capsys):
    b = runs["B"]
    assert cli.main(["promote", b["run_id"], "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "forced" in out and f"models:/{NAME}@champion" in out
    assert _aliases(client)["champion"] == 2
    assert client.get_run(b["run_id"]).data.tags["registry.decision"] == "forced"
    assert cli.main(["promote", runs["C"]["run_id"], "--tracking-uri", uri]) == 0
    assert _aliases(client)["champion"] == 3
    assert cli.main(["promote", "nope", "--tracking-uri", uri]) == 1

