"""Fill-mask with an exported `transformers` model directory (`train.export`), giving what
`evaluate.fill_mask` gives for the checkpoint it was exported from: the same encoding
(`[CLS] pieces [SEP]`, a literal `[MASK]` is the mask token, truncated to the tokenizer's
`model_max_length`), the tokenizer's special ids (`all_special_ids`) never proposed,
pieces as tokens.

Used by `mlm-pipeline fill-mask` for models that come from MLflow (a run id or a
`models:/` URI), which hold the exported directory rather than our checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fill_mask_hf(model_dir: str | Path, texts: list[str], *, top_k: int = 5
                 ) -> list[dict[str, Any]]:
    """Predict each `[MASK]` in `texts` with the model directory's model and tokenizer.

    Returns:
        One dict per text: `text`, and `predictions`, a list per mask of `top_k`
        `{"token": piece, "probability": p}` sorted by probability.

    Raises:
        ValueError: a text holds no `[MASK]` within the model's sequence length.
    """
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForMaskedLM.from_pretrained(str(model_dir)).eval()
    results = []
    for text in texts:
        # A probe's "[MASK]" is the model's mask token, however the tokenizer spells it.
        enc = tok(text.replace("[MASK]", tok.mask_token), return_tensors="pt", truncation=True)
        positions = (enc["input_ids"][0] == tok.mask_token_id).nonzero().flatten()
        if positions.numel() == 0:
            raise ValueError(f"fill-mask text has no [MASK] within {tok.model_max_length} "
                             f"tokens: {text!r}")
        with torch.no_grad():
            logits = model(**enc).logits[0, positions].float()
        logits[:, tok.all_special_ids] = float("-inf")
        top = logits.softmax(dim=-1).topk(top_k, dim=-1)
        results.append({"text": text, "predictions": [
            [{"token": tok.convert_ids_to_tokens(int(i)), "probability": float(p)}
             for p, i in zip(ps, is_)]
            for ps, is_ in zip(top.values.tolist(), top.indices.tolist())]})
    return results
