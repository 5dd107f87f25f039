"""The run's MLflow model and the registry's champion and challenger, against a real
MLflow SQLite backend with real tiny trained models (`app.publish.publish`).

Four runs are trained, evaluated and published in order under one registered name:

- A (6 steps) is the first version: champion;
- B (2 steps, worse) gets challenger, champion stays A;
- C (20 steps, better) takes champion;
- D (2 steps on other shards: another `seq_len`, the same tokenizer): champion C is
  re-scored on D's evaluation data, and stays.

Under a second name, a grown corpus: the champion re-scored on a warm-started
challenger's evaluation data with the same tokenizer, and compared in bits per character
across tokenizers.

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
from mlm_pipeline.app.publish import publish, record_results
from mlm_pipeline.app.summary import registry_lines, registry_summary
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
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import load_model
from mlm_pipeline.train.export import export_checkpoint

transformers = pytest.importorskip("transformers")
mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

NAME = "mlm-registry-test"
TEXT = "Le [MASK] du chat est doux et chaud."
STEPS = {"A": 6, "B": 2, "C": 20, "D": 2}


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
    out = {"work": work}
    for name, steps in STEPS.items():
        sh = shards[24 if name == "D" else 32]
        cfg = TrainConfig(micro_batch_size=4, max_steps=steps, warmup_steps=1, lr=3e-3,
                          checkpoint_every=steps, precision="fp32", seed=3)
        trained = train(cfg, model, MaskingConfig(), sh, tok, work / "train" / name)
        evaluated = evaluate(EvalConfig(), trained, sh, tok, work)
        run_id = tracker.start_run({"run": name})
        tracker.log_metrics(run_id, evaluated.metrics, step=trained.steps)
        # As a pipeline run records it: how a later version finds this one's checkpoint.
        tracker.log_artifacts(run_id, trained.path, "manifests/train")
        result = publish(tracker, run_id, NAME, trained, evaluated, tok.output_dir,
                                  TEXT, sh)
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


def test_run_on_other_data_rescores_the_champion(runs, client):
    c, d = runs["C"], runs["D"]
    # C's loss on D's data, computed here by the evaluate stage itself: C's checkpoint on
    # D's validation rows with D's fixed masks (same eval seed, fp32, CPU).
    want = evaluate(EvalConfig(), c["trained"], d["shards"], d["tok"],
                    runs["work"] / "independent").metrics["eval/loss"]
    result = d["result"]
    assert want != c["loss"] and result["champion_rescored"] is True
    assert result["champion_eval_loss"] == want  # exact: same rows, masks, precision
    assert result["decision"] == "kept" and d["loss"] >= want
    assert d["aliases"] == {"champion": 3, "challenger": 4}
    assert result["reason"].startswith(f"eval/loss {d['loss']:.4f} >= champion version 3's "
                                       f"{want:.4f} re-scored on this version's eval data")
    assert client.get_run(d["run_id"]).data.metrics["registry/champion_eval_loss"] == want
    assert float(client.get_model_version(NAME, "4").tags["compared_champion_eval_loss"]) \
        == want


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


@pytest.mark.slow  # a fresh interpreter loads transformers and MLflow: the push tier
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



# --- A grown corpus: the champion re-scored on the challenger's eval data --------------

GROWN = "mlm-registry-grown"


@pytest.fixture(scope="module")
def grown(tmp_path_factory, tiny_paragraphs, uri):
    """Under `GROWN`: v1 trained and evaluated on corpus A; v2 warm-started from v1 with
    the same tokenizer on corpus B (A and ten new documents, one of them a validation
    document); v3 on B with another tokenizer (BPE). Each run records its results as a
    pipeline run does (`record_results`: the train manifest the champion is found by)."""
    from tests.conftest import build_corpus_manifest

    work = tmp_path_factory.mktemp("grown-work")
    new_docs = [" ".join(reversed(p.split())) for p in tiny_paragraphs[:10]]
    corpus = {"A": build_corpus_manifest(work / "corpus-a", tiny_paragraphs),
              "B": build_corpus_manifest(work / "corpus-b", tiny_paragraphs + new_docs)}
    tok = train_tokenizer(TokenizerConfig(vocab_size=128), corpus["A"], work)
    other_tok = train_tokenizer(TokenizerConfig(vocab_size=128, model_type="bpe"),
                                corpus["B"], work)
    shard_cfg = ShardConfig(seq_len=32, rows_per_shard=64, encode_batch_size=4)
    shards = {"A": write_shards(shard_cfg, corpus["A"], tok, work),
              "B": write_shards(shard_cfg, corpus["B"], tok, work),
              "B-bpe": write_shards(shard_cfg, corpus["B"], other_tok, work)}
    tracker = MlflowTracker(uri, experiment_name=GROWN)
    model = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=2,
                        intermediate_size=64)
    out = {}
    plan = {"v1": ("A", tok, 6, None), "v2": ("B", tok, 6, "v1"),
            "v3": ("B-bpe", other_tok, 4, None)}
    for name, (data, tk, steps, parent) in plan.items():
        init = None if parent is None else str(
            out[parent]["trained"].file(out[parent]["trained"].checkpoint_dir))
        cfg = TrainConfig(micro_batch_size=4, max_steps=steps, warmup_steps=1, lr=3e-3,
                          checkpoint_every=steps, precision="fp32", seed=3, init_from=init)
        trained = train(cfg, model, MaskingConfig(), shards[data], tk, work / "train" / name)
        evaluated = evaluate(EvalConfig(), trained, shards[data], tk, work)
        run_id = tracker.start_run({"run": name})
        record_results(tracker, run_id, PipelineConfig(), trained, evaluated)
        # v2 passes its shards as the flow does; v3 leaves them to be found by digest,
        # and passes its corpus (not in the work directory's ingest/ here).
        result = publish(tracker, run_id, GROWN, trained, evaluated, tk.output_dir,
                                  TEXT, shards[data] if name == "v2" else None,
                                  corpus["B"] if name == "v3" else None)
        tracker.end_run(run_id)
        out[name] = {"run_id": run_id, "trained": trained, "evaluated": evaluated,
                     "shards": shards[data], "tok": tk, "result": result,
                     "loss": evaluated.metrics["eval/loss"]}
    out["work"] = work
    out["corpus"] = corpus
    return out


def _eval_data(evaluated) -> str:
    """`eval_data_digest` written out: what the loss was measured on."""
    data = {"shards": evaluated.inputs["shards"], "seed": EvalConfig().seed,
            "max_rows": None, "masking": evaluated.config["masking"]}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@pytest.mark.full
@pytest.mark.slow  # three more models trained, logged, registered: ~30 s
def test_grown_corpus_champion_is_rescored_on_the_challengers_data(grown, client):
    v1, v2 = grown["v1"], grown["v2"]
    assert v1["result"]["decision"] == "first"
    assert v2["trained"].init["source"].endswith(v1["trained"].checkpoint_dir)
    # The scenario: other eval data (the grown corpus adds a validation document).
    assert v2["shards"].validation.rows > v1["shards"].validation.rows
    assert _eval_data(v2["evaluated"]) != _eval_data(v1["evaluated"])
    # The champion's loss on B, computed here by the evaluate stage itself: v1's
    # checkpoint on B's validation rows with B's fixed masks (same seed, fp32, CPU).
    want = evaluate(EvalConfig(), v1["trained"], v2["shards"], v2["tok"],
                    grown["work"] / "independent").metrics["eval/loss"]
    assert want != v1["loss"]
    result = v2["result"]
    assert result["champion_rescored"] is True
    assert result["champion_eval_loss"] == want  # exact: same rows, masks and precision
    assert result["compared_on"] == _eval_data(v2["evaluated"])
    expected = "promoted" if v2["loss"] < want else "kept"
    assert result["decision"] == expected
    assert result["metric"] == "eval/loss" and result["reason"].startswith("eval/loss ")
    assert f"{want:.4f}" in result["reason"] and "re-scored" in result["reason"]
    champion = client.get_model_version_by_alias(GROWN, registry.CHAMPION)
    assert int(champion.version) == (2 if expected == "promoted" else 1)
    # On the run ...
    run = client.get_run(v2["run_id"])
    tags = run.data.tags
    assert tags["registry.decision"] == expected and tags["registry.metric"] == "eval/loss"
    assert tags["registry.compared_eval_data"] == _eval_data(v2["evaluated"])
    assert tags["registry.champion_rescored"] == "true"
    assert run.data.metrics["registry/eval_loss"] == v2["loss"]
    assert run.data.metrics["registry/champion_eval_loss"] == want
    # ... and on the model version.
    vt = client.get_model_version(GROWN, "2").tags
    assert vt["decision"] == expected and vt["compared_metric"] == "eval/loss"
    assert vt["compared_eval_data"] == _eval_data(v2["evaluated"])
    assert float(vt["compared_eval_loss"]) == v2["loss"]
    assert float(vt["compared_champion_eval_loss"]) == want
    assert vt["compared_champion_version"] == "1" and vt["digest.tokenizer"] == \
        v2["tok"].digest
    # The summary a user reads names the re-score.
    lines = registry_lines(registry_summary(result))
    assert "re-scored on this version's eval data" in lines[2] and f"{want:.4f}" in lines[2]


@pytest.mark.full
@pytest.mark.slow  # three more models trained, logged, registered: ~30 s
def test_another_tokenizer_is_compared_in_bits_per_char(grown, client):
    import pyarrow.parquet as pq

    from mlm_pipeline.evaluate.bpc import bits_per_char
    from mlm_pipeline.train.verified import load_verified

    v3 = grown["v3"]
    result = v3["result"]
    before = result["champion_before"]
    champ = grown[f"v{before['version']}"]
    assert champ["tok"].digest != v3["tok"].digest
    # Both scores computed here: each checkpoint with its own tokenizer on corpus B's
    # validation documents (read from the Parquet file), the default seed and budget.
    corpus = grown["corpus"]["B"]
    texts = [t for e in corpus.validation
             for t in pq.read_table(corpus.file(e.path)).column("text").to_pylist()]
    cfg = EvalConfig()

    def bpc(run) -> float:
        model, _ = load_verified(run["trained"].file(run["trained"].checkpoint_dir))
        tok = Tokenizer.load(run["tok"].output_dir)
        return bits_per_char(model, tok, texts, seed=cfg.seed,
                             max_chars=cfg.bpc_max_chars).bits_per_char

    ours, theirs = bpc(v3), bpc(champ)
    assert ours != theirs
    assert result["bits_per_char"] == ours and result["champion_bits_per_char"] == theirs
    expected = "promoted" if ours < theirs else "kept"
    assert result["decision"] == expected and result["metric"] == "eval/bits_per_char"
    assert result["reason"].startswith("eval/bits_per_char ")
    assert f"{ours:.4f}" in result["reason"] and f"{theirs:.4f}" in result["reason"]
    assert "another tokenizer" in result["reason"]
    assert v3["tok"].digest[:12] in result["reason"] and champ["tok"].digest[:12] in \
        result["reason"]
    assert result["champion_eval_loss"] is None  # losses of other vocabularies: not compared
    champion = int(client.get_model_version_by_alias(GROWN, registry.CHAMPION).version)
    assert champion == (3 if expected == "promoted" else before["version"])
    run = client.get_run(v3["run_id"])
    assert run.data.tags["registry.decision"] == expected
    assert run.data.tags["registry.metric"] == "eval/bits_per_char"
    assert run.data.metrics["registry/bits_per_char"] == ours
    assert run.data.metrics["registry/champion_bits_per_char"] == theirs
    tags = client.get_model_version(GROWN, "3").tags
    assert tags["compared_metric"] == "eval/bits_per_char"
    assert float(tags["compared_bits_per_char"]) == ours
    assert float(tags["compared_champion_bits_per_char"]) == theirs
    assert tags["compared_champion_version"] == str(before["version"])
