"""The registry decides on the fixed holdout text (`eval.holdout_sources`), against a real
MLflow SQLite backend with real tiny trained models (`app.publish.publish`).

Three runs on the same data, each evaluated with a holdout and published in order:

- v1 (holdout H1) is the first version: champion;
- v2 (holdout H1) is compared with the champion on H1 by the champion's own holdout score
  (same digest and seed: not re-scored);
- v3 (holdout H2, another text) re-scores the champion on H2: its H1 tag is never used.

Every score is checked against `bits_per_char` computed here from the checkpoints.
"""

from __future__ import annotations

import pytest

from mlm_pipeline.app.publish import publish, record_results
from mlm_pipeline.config import (
    EvalConfig,
    MaskingConfig,
    ModelConfig,
    PipelineConfig,
    ShardConfig,
    TokenizerConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate
from mlm_pipeline.evaluate.bpc import bits_per_char
from mlm_pipeline.ingest import read_holdout
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer, train_tokenizer
from mlm_pipeline.tracking import MlflowTracker
from mlm_pipeline.train import train
from mlm_pipeline.train.verified import load_verified

pytest.importorskip("transformers")
mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

NAME = "mlm-holdout-test"
TEXT = "Le [MASK] du chat est doux et chaud."
PLAN = {"v1": ("H1", 6), "v2": ("H1", 20), "v3": ("H2", 2)}


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_corpus_manifest, tiny_paragraphs):
    work = tmp_path_factory.mktemp("holdout-work")
    uri = f"sqlite:///{work}/mlflow.db"
    holdouts = {}
    for key, paragraphs in {"H1": tiny_paragraphs[:3], "H2": tiny_paragraphs[3:6]}.items():
        src = work / f"holdout-{key}"
        src.mkdir()
        # Reversed word order: text the models were not trained on.
        (src / "bench.txt").write_text("\n\n".join(
            " ".join(reversed(p.split())) for p in paragraphs) + "\n", encoding="utf-8")
        holdouts[key] = read_holdout(PipelineConfig.model_validate(
            {"eval": {"holdout_sources": [str(src)]}}))
    tok = train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest, work)
    shards = write_shards(ShardConfig(seq_len=32, rows_per_shard=64, encode_batch_size=4),
                          tiny_corpus_manifest, tok, work)
    tracker = MlflowTracker(uri, experiment_name=NAME)
    model = ModelConfig(preset="bert", hidden_size=32, num_layers=2, num_heads=2,
                        intermediate_size=64)
    out = {"holdouts": holdouts, "client": MlflowClient(tracking_uri=uri)}
    for name, (key, steps) in PLAN.items():
        cfg = TrainConfig(micro_batch_size=4, max_steps=steps, warmup_steps=1, lr=3e-3,
                          checkpoint_every=steps, precision="fp32", seed=3)
        trained = train(cfg, model, MaskingConfig(), shards, tok, work / "train" / name)
        evaluated = evaluate(EvalConfig(), trained, shards, tok, work,
                             holdout=holdouts[key])
        run_id = tracker.start_run({"run": name})
        record_results(tracker, run_id, PipelineConfig(), trained, evaluated)
        result = publish(tracker, run_id, NAME, trained, evaluated, tok.output_dir,
                                  TEXT, shards)
        tracker.end_run(run_id)
        out[name] = {"run_id": run_id, "trained": trained, "evaluated": evaluated,
                     "result": result, "holdout": holdouts[key], "tok": tok}
    return out


def _bpc(run: dict, holdout) -> float:
    """The run's checkpoint scored here on `holdout`'s documents (default seed and cap)."""
    model, _ = load_verified(run["trained"].file(run["trained"].checkpoint_dir))
    cfg = EvalConfig()
    return bits_per_char(model, Tokenizer.load(run["tok"].output_dir),
                         list(holdout.documents), seed=cfg.seed,
                         max_chars=cfg.bpc_max_chars).bits_per_char


@pytest.mark.full
@pytest.mark.slow  # three tiny models trained, evaluated, logged and registered
def test_registry_decides_on_the_holdout_metric(published):
    v1, v2, v3 = published["v1"], published["v2"], published["v3"]
    client = published["client"]
    h1, h2 = published["holdouts"]["H1"], published["holdouts"]["H2"]
    assert h1.digest != h2.digest
    # Each run's logged metric and tag: its own checkpoint on its holdout text.
    for run in (v1, v2, v3):
        own = _bpc(run, run["holdout"])
        assert run["evaluated"].metrics["holdout/bits_per_char"] == pytest.approx(own,
                                                                                  rel=1e-6)
        data = client.get_run(run["run_id"]).data
        assert data.tags["digest.holdout"] == run["holdout"].digest
        assert data.metrics["holdout/bits_per_char"] == \
            run["evaluated"].metrics["holdout/bits_per_char"]
    assert v1["result"]["decision"] == "first"

    # v2, same holdout as champion v1: compared by v1's own score on the same digest.
    ours, theirs = _bpc(v2, h1), _bpc(v1, h1)
    r2 = v2["result"]
    held = r2["holdout"]
    assert r2["metric"] == "holdout/bits_per_char" and held["digest"] == h1.digest
    assert held["bits_per_char"] == pytest.approx(ours, rel=1e-6)
    assert held["champion_bits_per_char"] == pytest.approx(theirs, rel=1e-6)
    assert held["champion_rescored"] is False
    expected = "promoted" if ours < theirs else "kept"
    assert r2["decision"] == expected
    assert r2["reason"].startswith("holdout/bits_per_char ")
    assert f"{ours:.4f}" in r2["reason"] and f"{theirs:.4f}" in r2["reason"]
    assert h1.digest[:12] in r2["reason"]
    champion = 2 if expected == "promoted" else 1
    assert int(client.get_model_version_by_alias(NAME, "champion").version) == champion

    # v3, another holdout text: the champion re-scored on H2, never compared by its tag.
    champ = published[f"v{champion}"]
    ours, theirs = _bpc(v3, h2), _bpc(champ, h2)
    r3 = v3["result"]
    held = r3["holdout"]
    assert held["digest"] == h2.digest and held["champion_rescored"] is True
    assert held["bits_per_char"] == pytest.approx(ours, rel=1e-6)
    assert held["champion_bits_per_char"] == pytest.approx(theirs, rel=1e-6)
    assert theirs != pytest.approx(champ["evaluated"].metrics["holdout/bits_per_char"])
    expected = "promoted" if ours < theirs else "kept"
    assert r3["decision"] == expected and "re-scored" in r3["reason"]
    assert f"{ours:.4f}" in r3["reason"] and f"{theirs:.4f}" in r3["reason"]
    assert h2.digest[:12] in r3["reason"]
    # On the run ...
    data = client.get_run(v3["run_id"]).data
    assert data.tags["registry.metric"] == "holdout/bits_per_char"
    assert data.tags["registry.holdout_digest"] == h2.digest
    assert data.tags["registry.decision"] == expected
    assert data.metrics["registry/holdout_bits_per_char"] == held["bits_per_char"]
    assert data.metrics["registry/champion_holdout_bits_per_char"] == \
        held["champion_bits_per_char"]
    # ... and on the model version.
    tags = client.get_model_version(NAME, "3").tags
    assert tags["compared_metric"] == "holdout/bits_per_char"
    assert tags["compared_holdout_digest"] == h2.digest
    assert float(tags["compared_bits_per_char"]) == held["bits_per_char"]
    assert float(tags["compared_champion_bits_per_char"]) == held["champion_bits_per_char"]
    assert tags["compared_champion_version"] == str(champion)
    assert tags["holdout.digest"] == h2.digest
