"""CUDA-only checks (STYLE rule 13: `@pytest.mark.gpu`, skipped without a device): bf16
autocast, the fused AdamW step, and the compiled static head on the GPU.

Fixture-free on purpose: `benchmarks/gpu_check.py` runs these as plain functions on a GPU
image without pytest (only `tmp_path`-free tests, no conftest fixtures)."""

from __future__ import annotations

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, ModelConfig
from mlm_pipeline.masking.keyed import exact_k, mask_tokens
from mlm_pipeline.train.loop import accumulate_gradients
from mlm_pipeline.train.model import BertMLM

CUDA = torch.cuda.is_available()
V, L, P = 512, 64, 0.3


def _model(preset: str, device: str) -> BertMLM:
    torch.manual_seed(0)
    cfg = ModelConfig(preset=preset, hidden_size=64, num_layers=2, num_heads=2,
                      intermediate_size=128, dropout=0.0)
    return BertMLM(cfg, V, L).to(device)


def _batch(b: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (b, L), generator=g)
    ids[:, 0], ids[:, -1], ids[:, L // 3] = 2, 3, 3  # [CLS] doc [SEP] doc [SEP]
    inp, labels = mask_tokens(ids, vocab_size=V, row_index=torch.arange(b), seed=1,
                              mlm_probability=P, selection="exact_k")
    return inp.to(device), labels.to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", ["bert", "modern"])
def test_bf16_autocast_close_to_fp32(preset):
    model = _model(preset, "cuda")
    inp, labels = _batch(16, "cuda")
    with torch.no_grad():
        fp32 = model(inp, labels=labels)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(inp, labels=labels)
    assert bf16.logits.dtype == torch.bfloat16 and bf16.loss.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: the mean loss (about ln V = 6.2 nats) to ~1e-2
    assert abs(float(bf16.loss) - float(fp32.loss)) < 0.05
    assert int(bf16.num_masked) == int(fp32.num_masked) == int((labels != -100).sum())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_adamw_matches_cpu():
    cpu, gpu = _model("modern", "cpu"), _model("modern", "cuda")
    opts = [torch.optim.AdamW(m.param_groups(0.01), lr=1e-3, foreach=False, fused=fused)
            for m, fused in ((cpu, False), (gpu, True))]
    for step in range(3):
        for m, opt in zip((cpu, gpu), opts):
            inp, labels = _batch(8, next(m.parameters()).device.type, seed=step)
            m(inp, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    worst = max(float((a - b.cpu()).abs().max()) for a, b in zip(cpu.parameters(),
                                                                 gpu.parameters()))
    assert worst < 1e-4  # three steps of lr 1e-3: differences are fp32 rounding, ~1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_compiled_static_head_on_cuda():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model("modern", "cuda")
    compiled = torch.compile(model)
    k = exact_k(L, P)
    for b in (16, 16, 11, 16, 5):
        batch = _batch(b, "cuda", seed=b)
        with torch.no_grad():
            eager = model(*batch[:1], labels=batch[1])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
            loss_sum, n = accumulate_gradients(compiled, [batch], masked_per_row=k)
        assert abs(float(loss_sum / n) - float(eager.loss)) < 1e-3
        model.zero_grad(set_to_none=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] <= 2


def test_masking_config_exact_k_bound():
    # CPU: the static head size the loop passes is the masker's own bound
    cfg = MaskingConfig(mlm_probability=P, selection="exact_k")
    _, labels = _batch(32, "cpu")
    assert int((labels != -100).sum(1).max()) <= exact_k(L, cfg.mlm_probability)
