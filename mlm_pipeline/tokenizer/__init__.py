"""Stage 2, the tokenizer: SentencePiece trained on a seeded sample of the training split
(`stage`), the `Tokenizer` that loads, checks and encodes with it (`tokenizer`), and the
same tokenizer as Hugging Face `tokenizers` / `transformers` files (`export`).
"""

from mlm_pipeline.tokenizer.stage import adopt_tokenizer, tokenizer_digest, train_tokenizer
from mlm_pipeline.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "adopt_tokenizer", "tokenizer_digest", "train_tokenizer"]
