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
