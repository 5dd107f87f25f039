"""Evaluation during training (`eval.every_steps`): the points of the validation curve are
at steps k*N, equal a standalone evaluation of the checkpoint saved at that step, do not
depend on the eval batch size, and do not change what is trained; the fill-mask table has
`top_k` sorted rows per sentence per evaluation."""

import json

import pytest
import torch

from mlm_pipeline.config import EvalConfig, FillMaskProbe, MaskingConfig, TrainConfig
from mlm_pipeline.evaluate.periodic import PeriodicEvaluator
from mlm_pipeline.evaluate.stage import masked_lm_metrics
from mlm_pipeline.masking import KeyedMasking
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import list_checkpoints, load_model
from mlm_pipeline.train.data import ShardDataset

EVERY, STEPS, ROWS, SEED = 2, 7, 5, 31
PROBES = [FillMaskProbe(text="Le [MASK] est là.", answers=["chat"]),
          "Une [MASK] de plus."]


def _train_cfg(**kw):
    return TrainConfig(micro_batch_size=4, max_steps=STEPS, warmup_steps=1, log_every=1,
                       lr=1e-3, seed=5, checkpoint_every=EVERY, keep_last_checkpoints=10, **kw)


def _evaluator(eval_cfg, shards, tokenizer, rows_out):
    return PeriodicEvaluator(eval_cfg, MaskingConfig(), shards, tokenizer,
                             on_probes=lambda rows, step: rows_out.extend(rows))


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    """One run with periodic evaluation (and its table rows), one without."""
    eval_cfg = EvalConfig(every_steps=EVERY, periodic_rows=ROWS, batch_size=3, seed=SEED,
                          probes=PROBES)
    rows: list[dict] = []
    out = tmp_path_factory.mktemp("periodic")
    with_eval = train(_train_cfg(), tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                      tiny_tokenizer_manifest, out / "with",
                      evaluator=_evaluator(eval_cfg, tiny_shard_manifest,
                                           tiny_tokenizer_manifest, rows))
    without = train(_train_cfg(), tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                    tiny_tokenizer_manifest, out / "without")
    return with_eval, without, rows, eval_cfg


def _records(manifest):
    return [json.loads(line) for line in
            manifest.file(manifest.metrics_log).read_text().splitlines()]


def test_points_at_every_n_steps_before_the_last(run):
    manifest, _, _, _ = run
    steps = [r["step"] for r in _records(manifest) if "eval/loss" in r]
    # The last step's point is the final evaluation on the whole split (not periodic).
    assert steps == list(range(EVERY, STEPS, EVERY))
    for r in _records(manifest):
        if "eval/loss" in r:
            assert {"eval/mlm_accuracy", "eval/top5_accuracy", "eval/perplexity",
                    "eval/probe_accuracy"} <= r.keys()
            assert r["eval/mlm_accuracy"] <= r["eval/top5_accuracy"] <= 1.0


def test_points_equal_a_standalone_evaluation_of_the_checkpoint(run, tiny_shard_manifest):
    manifest, _, _, _ = run
    points = {r["step"]: r for r in _records(manifest) if "eval/loss" in r}
    checkpoints = {int(p.name.split("-")[-1]): p
                   for p in list_checkpoints(manifest.file("checkpoints"))}
    data = ShardDataset(tiny_shard_manifest, "validation")
    for step, point in points.items():
        model = load_model(checkpoints[step])
        # Independent of the evaluator: fresh masking built here, other batch size.
        ref = masked_lm_metrics(model, data, batch_size=2, max_rows=ROWS,
                                precision=manifest.precision,
                                masking=KeyedMasking(MaskingConfig(),
                                                     tiny_shard_manifest.vocab_size,
                                                     seed=SEED))
        for key in ("eval/loss", "eval/mlm_accuracy", "eval/top5_accuracy"):
            assert point[key] == pytest.approx(ref[key], rel=1e-5), (step, key)


def test_periodic_metrics_do_not_depend_on_the_batch_size(
        run, tiny_shard_manifest, tiny_tokenizer_manifest):
    manifest, _, _, eval_cfg = run
    model = load_model(list_checkpoints(manifest.file("checkpoints"))[-1])
    got = []
    for batch_size in (1, 4, 64):
        cfg = eval_cfg.model_copy(update={"batch_size": batch_size})
        got.append(_evaluator(cfg, tiny_shard_manifest, tiny_tokenizer_manifest, [])(
            model, 1, "fp32"))
    for other in got[1:]:
        for key in ("eval/loss", "eval/mlm_accuracy", "eval/top5_accuracy"):
            assert other[key] == pytest.approx(got[0][key], rel=1e-5), key


def test_training_is_unchanged_by_periodic_evaluation(run):
    with_eval, without, _, _ = run
    a = {r["step"]: r["train/loss"] for r in _records(with_eval) if "train/loss" in r}
    b = {r["step"]: r["train/loss"] for r in _records(without) if "train/loss" in r}
    assert list(a) == list(range(1, STEPS + 1))
    assert a == b
    wa = load_model(with_eval.file(with_eval.checkpoint_dir)).state_dict()
    wb = load_model(without.file(without.checkpoint_dir)).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wb)


def test_fill_mask_table_has_top_k_sorted_rows_per_sentence_per_evaluation(run):
    _, _, rows, eval_cfg = run
    evaluations = len(range(EVERY, STEPS, EVERY))
    assert len(rows) == evaluations * len(PROBES) * eval_cfg.top_k
    for step in range(EVERY, STEPS, EVERY):
        for probe in eval_cfg.probes:
            group = [r for r in rows if r["step"] == step and r["sentence"] == probe.text]
            assert [r["rank"] for r in group] == list(range(1, eval_cfg.top_k + 1))
            probs = [r["probability"] for r in group]
            assert all(0.0 < p <= 1.0 for p in probs)
            assert probs == sorted(probs, reverse=True)
            assert all(r["expected"] == ", ".join(probe.answers) for r in group)


def test_probe_accuracy_counts_hits_of_the_expected_word(tiny_tokenizer_manifest):
    from mlm_pipeline.evaluate.probes import probe_metrics, table_rows

    probes = [FillMaskProbe(text="a [MASK]", answers=["Chat"]),
              FillMaskProbe(text="b [MASK]", answers=["x", "poil"]),
              FillMaskProbe(text="c [MASK]", answers=["rien"]),
              FillMaskProbe(text="d [MASK]")]
    pred = lambda *tokens: {"predictions": [[{"token": t, "probability": 0.1} for t in tokens]]}
    results = [pred("\u2581chat", "\u2581le"), pred("\u2581la", "\u2581poil"),
               {"text": "c", "error": "no mask"}, pred("\u2581un", "\u2581une")]
    metrics = probe_metrics(results, probes, top_k=2)
    # Answered probes: 3; top-1 hits: "chat" (case-folded); top-2 hits: chat and poil.
    assert metrics == {"eval/probe_accuracy": pytest.approx(1 / 3),
                       "eval/probe_top2_accuracy": pytest.approx(2 / 3)}
    rows = table_rows(results, probes, step=7)
    assert [r["hit"] for r in rows] == [True, False, False, True, False, False]
    assert probe_metrics([pred("\u2581x")], [FillMaskProbe(text="[MASK]")], 1) == {}


def test_answers_that_are_not_one_piece_are_reported(tiny_tokenizer_manifest, caplog):
    from mlm_pipeline.evaluate.probes import warn_answer_problems

    tok = Tokenizer.load(tiny_tokenizer_manifest)
    # A word of the 128-piece vocabulary (one piece) and one it cannot hold.
    single = next(p for i in range(5, tok.vocab_size)
                  if (p := tok.id_to_piece(i)).startswith("\u2581") and len(p) > 2)
    word = single[1:]
    assert tok.encode([word]) == [[tok.piece_to_id(single)]]
    probes = [FillMaskProbe(text="[MASK] ici", answers=[word, "xylophonesque"])]
    with caplog.at_level("WARNING", logger="mlm_pipeline.evaluate.probes"):
        assert warn_answer_problems(tok, probes) == 1
        assert warn_answer_problems(tok, probes) == 1  # the final evaluation checks again
    (record,) = caplog.records  # one line for the run, not one per answer and check
    message = record.getMessage()
    assert "\n" not in message
    assert "1 expected answer(s) of 1 probe(s)" in message
    pieces = " ".join(tok.id_to_piece(i) for i in tok.encode(["xylophonesque"])[0])
    assert f"'xylophonesque' ({pieces})" in message
    assert repr(word) not in message
