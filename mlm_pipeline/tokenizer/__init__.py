"""Stage 2, the tokenizer: SentencePiece trained on a seeded sample of the training split
(`stage`), or the Hugging Face tokenizer of a published model adopted as it is
(`pretrained`); `Tokenizer` (`base`) is what later stages use of either, loaded from the
stage's manifest (`Tokenizer.load`); `SentencePieceTokenizer` (`tokenizer`) loads, checks and
encodes with a trained model, and `hf_files` writes it as Hugging Face `tokenizers` /
`transformers` files.
"""

from mlm_pipeline.tokenizer.base import Tokenizer
from mlm_pipeline.tokenizer.pretrained import (
    PretrainedTokenizer, adopt_pretrained_tokenizer, pretrained_tokenizer_digest)
from mlm_pipeline.tokenizer.stage import adopt_tokenizer, tokenizer_digest, train_tokenizer
from mlm_pipeline.tokenizer.tokenizer import SentencePieceTokenizer

__all__ = ["PretrainedTokenizer", "SentencePieceTokenizer", "Tokenizer",
           "adopt_pretrained_tokenizer", "adopt_tokenizer", "pretrained_tokenizer_digest",
           "tokenizer_digest", "train_tokenizer"]
