"""Logit and loss parity between one of our models and its Hugging Face export, shared by
the `bert` and `modern` mapping tests (`tests/unit/test_hf_*.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 100  # padded to 128 rows in ours, 100 in the export


def batch(seed: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, seq_len) int64 `input_ids` among the ordinary ids and `labels` (-100 except at
    about 30 % of positions), seeded."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (3, seq_len), generator=g)
    labels = torch.full_like(input_ids, -100)
    chosen = torch.rand(3, seq_len, generator=g) < 0.3
    labels[chosen] = torch.randint(5, VOCAB, (int(chosen.sum()),), generator=g)
    return input_ids, labels


def assert_logits_and_loss_match(ours: torch.nn.Module, hf: torch.nn.Module,
                                 seq_len: int) -> None:
    """Ours (logits at the labelled positions) equals HF's full logits there, fp32 1e-5,
    and both losses equal the cross-entropy of HF's logits computed here."""
    input_ids, labels = batch(0, seq_len)
    with torch.no_grad():
        mine = ours(input_ids, labels=labels)
        theirs = hf(input_ids=input_ids, labels=labels)
    assert theirs.logits.shape == (3, seq_len, VOCAB)
    torch.testing.assert_close(mine.logits, theirs.logits[labels != -100],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    ref = F.cross_entropy(theirs.logits.reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(mine.loss, ref, atol=1e-5, rtol=1e-5)


def assert_logits_match_with_padding(ours: torch.nn.Module, hf: torch.nn.Module,
                                     seq_len: int, cut: int) -> None:
    """With right padding (row 0 from `cut`, row 2 from 5), the real positions' logits
    agree, fp32 1e-5."""
    input_ids, _ = batch(1, seq_len)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, cut:] = 0
    attention_mask[2, 5:] = 0
    with torch.no_grad():
        mine = ours(input_ids, attention_mask=attention_mask).logits
        theirs = hf(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=1e-5, rtol=1e-5)


def with_nontrivial_vectors(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with N(0, 0.1) added to every 1-d parameter (biases and norms,
    which init leaves trivial), so that a mapping that drops or swaps one shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()
