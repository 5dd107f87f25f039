"""Small Hugging Face tokenizers built locally from `tests/assets/tiny_fr.txt`, saved as
`transformers` saves a published model's tokenizer (`save_pretrained`): a BERT WordPiece
vocabulary with BERT's special ids, and a ModernBERT-like byte-level BPE whose special
tokens are added tokens after the vocabulary. No network.
"""

from __future__ import annotations

from pathlib import Path

#: BERT's special ids ([PAD] 0, [unused0..98] 1-99, [UNK] 100, [CLS] 101, [SEP] 102,
#: [MASK] 103), as in `bert-base-uncased`'s vocab.txt.
BERT_SPECIALS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def _paragraphs(text_file: Path) -> list[str]:
    text = text_file.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def build_bert_wordpiece(text_file: Path, out_dir: Path, vocab_size: int = 400) -> Path:
    """A cased WordPiece tokenizer trained on `text_file` with BERT's vocabulary layout,
    saved by `transformers.BertTokenizerFast.save_pretrained` into `out_dir`."""
    import tokenizers
    import transformers

    trainer_tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    trainer_tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=False)
    trainer_tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                   special_tokens=["[UNK]"])
    trainer_tok.train_from_iterator(_paragraphs(text_file), trainer)
    learned = [t for t, _ in sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
               if t != "[UNK]"]
    vocab = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]",
             "[MASK]", *learned]
    # BERT's tokenizer.json (as `convert_slow_tokenizer.BertConverter` builds it), over
    # this vocabulary.
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(
        {t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 101), ("[SEP]", 102)])
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    fast = transformers.BertTokenizerFast(
        tokenizer_object=tok, do_lower_case=False, unk_token="[UNK]", sep_token="[SEP]",
        pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def build_modernbert_bpe(text_file: Path, out_dir: Path, vocab_size: int = 500) -> Path:
    """A byte-level BPE tokenizer trained on `text_file`, laid out as ModernBERT's: the
    special `<|padding|>` first, `|||IP_ADDRESS|||` (added, not special), then the
    learned pieces, then the added special tokens `<|endoftext|>`, [UNK], [CLS], [SEP],
    [PAD], [MASK] ([MASK] strips the space before it), saved by
    `transformers.PreTrainedTokenizerFast.save_pretrained` into `out_dir`."""
    import tokenizers
    import transformers
    from tokenizers import AddedToken

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|padding|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_paragraphs(text_file), trainer)
    tok.add_tokens([AddedToken("|||IP_ADDRESS|||", special=False)])
    tok.add_special_tokens(["<|endoftext|>", "[UNK]", "[CLS]", "[SEP]", "[PAD]",
                            AddedToken("[MASK]", lstrip=True, special=True)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]",
        sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
        clean_up_tokenization_spaces=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir
