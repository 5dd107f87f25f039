"""`torch.compile` with `exact_k` masking: the static head (`BertMLM.forward`'s
`masked_per_row`) keeps the compiled forward in one graph (no break at the masked-position
`nonzero`) and a run whose batches change size (a short last batch, evaluation-sized
batches) compiles at most twice: once, then once more with a dynamic batch dimension."""

import pytest
import torch
from torch._dynamo.utils import counters

from mlm_pipeline.config import MaskingConfig, ModelConfig
from mlm_pipeline.masking.keyed import exact_k
from mlm_pipeline.masking.maskers import KeyedMasking
from mlm_pipeline.train.loop import accumulate_gradients
from mlm_pipeline.train.model import BertMLM

V, L, P = 128, 16, 0.3
#: Batch sizes of the run: full batches with short ones between (as a last batch would be).
BATCHES = [8, 8, 8, 5, 8, 3, 8, 6, 8, 7]


def _run(model_cfg, backend: str, static: bool) -> tuple[int, int, list[float]]:
    """Train-step every batch of `BATCHES` through `torch.compile(model, backend=backend)`;
    return (graphs compiled, graph breaks, the losses)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BertMLM(model_cfg, V, L)
    compiled = torch.compile(model, backend=backend)
    masking = KeyedMasking(MaskingConfig(mlm_probability=P, selection="exact_k"), V)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step, b in enumerate(BATCHES):
        ids = torch.randint(5, V, (b, L), generator=gen)
        ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
        for r in range(b):  # a [SEP] between packed documents: maskable counts vary by row
            ids[r, 3 + (r + step) % 5] = 3
        batch = masking(ids, torch.arange(b) + 100 * step, 0)
        loss_sum, n = accumulate_gradients(compiled, [batch],
                                           masked_per_row=exact_k(L, P) if static else None)
        losses.append(float(loss_sum / n))
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), losses


def _eager_losses(model_cfg) -> list[float]:
    torch.manual_seed(0)
    model = BertMLM(model_cfg, V, L)
    masking = KeyedMasking(MaskingConfig(mlm_probability=P, selection="exact_k"), V)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step, b in enumerate(BATCHES):
        ids = torch.randint(5, V, (b, L), generator=gen)
        ids[:, 0], ids[:, -1] = 2, 3
        for r in range(b):
            ids[r, 3 + (r + step) % 5] = 3
        loss_sum, n = accumulate_gradients(model, [masking(ids, torch.arange(b) + 100 * step, 0)])
        losses.append(float(loss_sum / n))
    return losses


def test_static_head_compiles_at_most_twice(tiny_model_config):
    # aot_eager: dynamo's guards and graph capture plus AOT autograd, without code
    # generation, which is what decides recompiles and breaks (seconds instead of minutes).
    graphs, breaks, losses = _run(tiny_model_config, "aot_eager", static=True)
    assert breaks == 0
    assert graphs <= 2
    # the static head computes the same loss as the eager nonzero head
    assert losses == pytest.approx(_eager_losses(tiny_model_config), rel=1e-5)


def test_nonzero_head_breaks_the_graph(tiny_model_config):
    # The behaviour the static head removes (what the issue saw on GPU): a graph break at
    # `nonzero`, and the code after it compiled again as N and B change.
    graphs, breaks, _ = _run(tiny_model_config, "aot_eager", static=False)
    assert breaks > 0 and graphs > 2


@pytest.mark.slow
@pytest.mark.full  # inductor builds C++: one slice of the landings in CI
def test_static_head_compiles_at_most_twice_inductor(tiny_model_config):
    graphs, breaks, losses = _run(tiny_model_config, "inductor", static=True)
    assert breaks == 0 and graphs <= 2
    assert losses == pytest.approx(_eager_losses(tiny_model_config), rel=1e-4)


@pytest.mark.parametrize("preset", ["bert", "modern"])
def test_static_head_equals_nonzero_head(preset):
    # Eager, no compile: the same loss, count and gradients as the nonzero head (the sum
    # runs over the same terms in another order: equal to fp32 rounding).
    cfg = ModelConfig(preset=preset, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64, dropout=0.0)
    torch.manual_seed(0)
    model = BertMLM(cfg, V, L)
    masking = KeyedMasking(MaskingConfig(mlm_probability=P, selection="exact_k"), V)
    ids = torch.randint(5, V, (6, L), generator=torch.Generator().manual_seed(3))
    ids[:, 0], ids[:, -1], ids[:3, 5] = 2, 3, 3
    inp, labels = masking(ids, torch.arange(6), 0)
    outs, grads = [], []
    for k in (None, exact_k(L, P)):
        model.zero_grad()
        out = model(inp, labels=labels, masked_per_row=k)
        out.loss.backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    n = int((labels != -100).sum())
    assert int(outs[0].num_masked) == int(outs[1].num_masked) == n
    assert outs[1].logits.shape == (6 * exact_k(L, P), V)
    assert float(outs[1].loss) == pytest.approx(float(outs[0].loss), rel=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_static_head_refuses_rows_over_the_bound(tiny_model_config):
    model = BertMLM(tiny_model_config, V, L)
    ids = torch.randint(5, V, (2, L))
    labels = ids.clone()  # every position labelled: more than k
    with pytest.raises(RuntimeError, match="more labels than masked_per_row"):
        model(ids, labels=labels, masked_per_row=exact_k(L, P))


@pytest.mark.parametrize(("compile_", "selection", "expected"), [
    ("on", "exact_k", "k"), ("off", "exact_k", None), ("on", "bernoulli", None)])
def test_loop_passes_the_static_head_only_when_compiled_with_exact_k(
        compile_, selection, expected, tiny_model_config, tiny_shard_manifest,
        tiny_tokenizer_manifest):
    from mlm_pipeline.config import TrainConfig
    from mlm_pipeline.train.stage import build_parts

    masking = MaskingConfig(mlm_probability=P, selection=selection)
    parts = build_parts(TrainConfig(micro_batch_size=4, compile=compile_, device="cpu"),
                        tiny_model_config, masking, tiny_shard_manifest,
                        tiny_tokenizer_manifest)
    seq_len = tiny_shard_manifest.seq_len
    assert parts.masked_per_row == (exact_k(seq_len, P) if expected else None)


# --- How many times a run compiles, and what happens past the recompile limit ------------


def _compile_count(model_cfg, batches: list[int], selection: str) -> tuple[int, list[int], int]:
    """Train-step `batches` (row counts) through `perf.compile_model` (eager backend: graph
    capture and guards only, the part that decides recompiles); return (graphs compiled,
    the predicted-token count N of each step, recompile-limit fallbacks)."""
    from mlm_pipeline.train.perf import compile_model, recompile_limit_hits

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BertMLM(model_cfg, V, L)
    compiled = compile_model(model, torch.device("cpu"), backend="eager")
    masking = KeyedMasking(MaskingConfig(mlm_probability=P, selection=selection), V)
    gen = torch.Generator().manual_seed(1)
    hits, counts = recompile_limit_hits(), []
    for step, b in enumerate(batches):
        ids = torch.randint(5, V, (b, L), generator=gen)
        ids[:, 0], ids[:, -1] = 2, 3
        batch = masking(ids, torch.arange(b) + 100 * step, 0)
        counts.append(int((batch[1] != -100).sum()))
        accumulate_gradients(compiled, [batch],
                             masked_per_row=exact_k(L, P) if selection == "exact_k" else None)
    return counters["stats"]["unique_graphs"], counts, recompile_limit_hits() - hits


def test_exact_k_compiles_once_per_batch_shape_then_dynamic(tiny_model_config):
    # The static head: one graph for the whole forward; a second batch size makes dynamo
    # compile once more with a symbolic batch dimension, and no size after that recompiles.
    batches = [6, 4, 6, 3]
    graphs, _, fallbacks = _compile_count(tiny_model_config, batches, "exact_k")
    assert graphs == (1 if len(set(batches)) == 1 else 2) == 2
    assert fallbacks == 0


def test_bernoulli_compiles_at_most_three_graphs(tiny_model_config):
    # Full batches (what the loop feeds): the forward up to the head's `nonzero` is one
    # graph; the rest sees N predicted tokens, compiled once static and, when N changes,
    # once more with N symbolic: 1 + min(2, distinct N), under COMPILE_RECOMPILE_LIMIT.
    from mlm_pipeline.train.perf import COMPILE_RECOMPILE_LIMIT

    graphs, counts, fallbacks = _compile_count(tiny_model_config, [6] * 4, "bernoulli")
    assert len(set(counts)) > 1  # the case that matters: N changes from step to step
    assert graphs == 1 + min(2, len(set(counts)))
    assert COMPILE_RECOMPILE_LIMIT >= 2 and fallbacks == 0


def test_recompile_limit_hit_warns_once_and_is_recorded(
        monkeypatch, caplog, tmp_path, tiny_model_config, tiny_shard_manifest,
        tiny_tokenizer_manifest):
    # A limit of one compiled version: the head's second N (bernoulli masking changes it
    # from step to step) exceeds it, and dynamo runs that part eagerly from then on.
    import functools
    import logging

    from mlm_pipeline.config import TrainConfig
    from mlm_pipeline.tracking.records import train_tags
    from mlm_pipeline.train import perf, stage

    torch._dynamo.reset()
    monkeypatch.setattr(stage, "compile_model",
                        functools.partial(perf.compile_model, backend="eager"))
    monkeypatch.setattr(stage, "COMPILE_RECOMPILE_LIMIT", 1)
    cfg = TrainConfig(micro_batch_size=4, max_steps=4, warmup_steps=1, log_every=2,
                      seed=11, compile="on", device="cpu")
    with caplog.at_level(logging.WARNING, logger="mlm_pipeline.train.loop"):
        manifest = stage.train(cfg, tiny_model_config, MaskingConfig(), tiny_shard_manifest,
                               tiny_tokenizer_manifest, tmp_path / "run")
    warned = [r.getMessage() for r in caplog.records
              if r.name == "mlm_pipeline.train.loop" and "recompile limit" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "(1 compiled versions" in warned[0] and "eagerly" in warned[0]
    assert manifest.steps == 4
    assert manifest.compile_fallback == "recompile_limit"
    assert train_tags(manifest)["mlm.compile_fallback"] == "recompile_limit"
    unchanged = manifest.model_copy(update={"compile_fallback": None})
    assert "mlm.compile_fallback" not in train_tags(unchanged)
    assert train_tags(unchanged)["mlm.stop_reason"] == "max_steps"
