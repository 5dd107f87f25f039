"""`tokenizer.hf_files`: `AutoTokenizer` on the exported directory gives exactly our ids.

Every combination of unigram / BPE, with and without byte fallback, NFC and NFKC corpora,
on every document of the tiny corpus (the validation split and the training split), a
hostile list and a seeded sample of random strings:

- `split_special_tokens=True` (no special name matched in text) equals
  `[CLS] + Tokenizer.encode(text) + [SEP]`, the ids of our shards, for every text;
- the default call equals `[CLS] + Tokenizer.encode_with_mask(text) + [SEP]` (a literal
  special name is its id, as for our fill-mask probes) for every text;
- `decode`, with and without `skip_special_tokens`, gives the same string on both sides,
  for ids holding [UNK] and the other special ids too.
"""

from __future__ import annotations

import random
import re
import unicodedata

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from mlm_pipeline.config import SPECIAL_TOKENS, TokenizerConfig
from mlm_pipeline.tokenizer import SentencePieceTokenizer, Tokenizer, train_tokenizer
from mlm_pipeline.tokenizer.hf_files import (
    build_hf_tokenizer,
    charsmap_rules,
    export_tokenizer,
    read_model_proto,
)

transformers = pytest.importorskip("transformers")

#: Inputs SentencePiece's normalizer and the HF pipeline could treat differently.
HOSTILE = [
    "", " ", "\t", "\n", "\r\n", "▁", " ▁a", "▁a", "a▁", "a ▁", "▁ ",
    "Le    chat     dort", "   Le chat", "Le chat   ", "  Le chat  ",
    "a\n b", "a \n\n  b", "Le\tchat\t\tdort", "\tLe chat\t",
    "Le\u00a0chat", "Il a 12\u00a0%", "Quoi\u202f?", "a\u3000b\u2028c\u2029d\u0085e",
    "\u00a0\u0301a", "a \u0301b", "e\u0301te\u0301", "café cafe\u0301",
    "3,0", "3.0", "3,0 et 3.0", "12 345,67 €", "1er 2e 3ème", "0x41", "2028",
    "emoji 😀🎉 ok", "👍🏽 et 👨\u200d👩\u200d👧", "❤\ufe0f",
    "龍", "Le 龍𝔘 dort", "龍龍龍", "ﬁ ½ ¨ Ω Å K ²",
    "[MASK]", "Le [MASK] dort.", " [MASK] ", "x[MASK]y", "[MASK][MASK]", "[ MASK ]",
    "l'[MASK]s", "［ＭＡＳＫ］", "[mask]", "<0x41>", "<0x3C>x", "a<0x41>b",
    "[CLS] a [SEP]", "[PAD]x", "[UNK]",
]
VARIANTS = [
    ("unigram", False, "NFC"), ("unigram", True, "NFC"), ("bpe", False, "NFC"),
    ("bpe", True, "NFC"), ("unigram", False, "NFKC"), ("unigram", True, "NFKC"),
    ("bpe", False, "NFKC"), ("bpe", True, "NFKC"),
]


def _documents(corpus) -> list[str]:
    texts = []
    for entry in [*corpus.validation, *corpus.train]:  # validation first: the required set
        texts += pq.read_table(corpus.file(entry.path)).column("text").to_pylist()
    return texts


def _random_texts(paragraphs: list[str], n: int, seed: int) -> list[str]:
    """Strings mixing the corpus's characters with spaces, marks, unseen characters and
    special names, plus random slices of the corpus."""
    text = "\n\n".join(paragraphs)
    atoms = sorted(set(text)) + list(" \t\n\u00a0\u202f\u3000\u0301\u0308▁[]<>龍😀\ufe0f\uff21ﬁ")
    atoms += ["[MASK]", "<0x41>", "  ", "\u00a0\u0301"]
    rng = random.Random(seed)
    out = ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 30))) for _ in range(n)]
    starts = [rng.randrange(len(text)) for _ in range(n)]
    out += [text[i:i + rng.randint(1, 80)] for i in starts]
    return out


@pytest.fixture(scope="module")
def corpora(tiny_corpus_manifest, make_corpus_manifest, tiny_paragraphs, tmp_path_factory):
    """The tiny corpus as ingested with NFC (the fixture) and with NFKC."""
    nfkc = [unicodedata.normalize("NFKC", p) for p in tiny_paragraphs]
    m = make_corpus_manifest(tmp_path_factory.mktemp("nfkc-corpus"), nfkc)
    m = m.model_copy(update={"config": {**m.config, "normalization": "NFKC"}})
    return {"NFC": tiny_corpus_manifest, "NFKC": m}


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(
    (v[0], "bytes" if v[1] else "nobytes", v[2])))
def exported(request, corpora, tmp_path_factory):
    """(our Tokenizer, the AutoTokenizer of its export, the corpus) for one variant."""
    model_type, byte_fallback, form = request.param
    cfg = TokenizerConfig(model_type=model_type, byte_fallback=byte_fallback,
                          vocab_size=400 if byte_fallback else 128)
    manifest = train_tokenizer(cfg, corpora[form], tmp_path_factory.mktemp("work"))
    assert manifest.normalization == form
    ours = Tokenizer.load(manifest)
    out = tmp_path_factory.mktemp("hf-tokenizer")
    written = export_tokenizer(manifest, out, model_max_length=64)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in written}
    return ours, transformers.AutoTokenizer.from_pretrained(out), corpora[form]


def _mismatches(ours: Tokenizer, hf, texts: list[str]) -> list[str]:
    """Texts whose ids differ, with both id lists (empty when all match)."""
    bad = []
    got_plain = hf(texts, split_special_tokens=True)["input_ids"]
    got_default = hf(texts)["input_ids"]
    for text, want, plain, default in zip(texts, ours.encode(texts), got_plain, got_default):
        if plain != [2, *want, 3]:
            bad.append(f"{text!r} split_special_tokens: ours {want} hf {plain}")
        want_masked = [2, *ours.encode_with_mask(text), 3]
        if default != want_masked:
            bad.append(f"{text!r} default: ours {want_masked} hf {default}")
    return bad


def test_special_tokens(exported):
    ours, hf, _ = exported
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.pad_token, hf.unk_token, hf.cls_token, hf.sep_token, hf.mask_token) == tuple(
        SPECIAL_TOKENS)
    assert [hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id,
            hf.mask_token_id] == [0, 1, 2, 3, 4]
    assert len(hf) == ours.vocab_size and hf.model_max_length == 64
    assert hf.convert_ids_to_tokens(list(range(ours.vocab_size))) == [
        ours.id_to_piece(i) for i in range(ours.vocab_size)]
    assert hf("chat").keys() == {"input_ids", "attention_mask"}


def test_documents_match(exported):
    ours, hf, corpus = exported
    docs = _documents(corpus)
    assert corpus.documents_validation >= 2 and len(docs) == corpus.documents_kept
    assert _mismatches(ours, hf, docs) == []


def test_hostile_inputs_match(exported):
    ours, hf, _ = exported
    assert _mismatches(ours, hf, HOSTILE) == []


def test_random_inputs_match(exported, tiny_paragraphs):
    ours, hf, _ = exported
    assert _mismatches(ours, hf, _random_texts(tiny_paragraphs, 150, seed=3)) == []


#: Texts writing the special names: alone, inside words, at the edges, side by side, next
#: to spaces and punctuation, in other cases and widths (not names: ordinary text).
LITERAL_NAMES = [
    *SPECIAL_TOKENS, "Le [SEP] chat", "[CLS] Le chat dort. [SEP]", "x[CLS]y", "[PAD][PAD]x",
    "Le chat [UNK]", "[UNK]chat", "a [MASK] b [SEP] c", "l'[MASK]s[SEP]", " [SEP] ",
    "[SEP][CLS][MASK][UNK][PAD]", "[sep] [Sep] [ SEP ]", "［ＳＥＰ］ et ［ＭＡＳＫ］", "[[SEP]]",
]


def _sp_ids(ours: Tokenizer, text: str, names: bool) -> list[int]:
    """The ids SentencePiece itself gives `text` (NFC/NFKC first, as our corpus), with
    [CLS] and [SEP] around; with `names`, each special name written in the text is its id
    and the text between names is encoded piece by piece (the exported default)."""
    sp = spm.SentencePieceProcessor(model_file=str(ours.path))
    form = ours.normalization

    def enc(part: str) -> list[int]:
        return sp.encode(unicodedata.normalize(form, part) if form else part)

    if not names:
        return [2, *enc(text), 3]
    pattern = "(" + "|".join(re.escape(n) for n in SPECIAL_TOKENS) + ")"
    ids = [2]
    for part in re.split(pattern, text):
        ids += [SPECIAL_TOKENS[part]] if part in SPECIAL_TOKENS else enc(part)
    return [*ids, 3]


def test_literal_special_names(exported):
    # Each name written in a probe is its special id on both sides; in documents
    # (`split_special_tokens=True`, `Tokenizer.encode`) it is ordinary text on both sides.
    ours, hf, _ = exported
    for text in LITERAL_NAMES:
        want = _sp_ids(ours, text, names=True)
        assert [2, *ours.encode_with_mask(text), 3] == want, text
        assert hf(text)["input_ids"] == want, text
        plain = _sp_ids(ours, text, names=False)
        assert not {0, 2, 3, 4} & set(plain[1:-1]), text  # never a control id from text
        assert [2, *ours.encode([text])[0], 3] == plain, text
        assert hf(text, split_special_tokens=True)["input_ids"] == plain, text
    # Written out: the names' ids, and text between them encoded on its own.
    assert hf("[SEP]")["input_ids"] == [2, 3, 3]
    assert hf("[CLS][UNK][PAD][MASK]")["input_ids"] == [2, 2, 1, 0, 4, 3]
    assert ours.encode_with_mask("x[CLS]y") == [*ours.encode(["x"])[0], 2,
                                                 *ours.encode(["y"])[0]]
    assert 3 not in _sp_ids(ours, "［ＳＥＰ］", names=True)[1:-1]  # NFKC makes no name


def test_decode_matches(exported):
    ours, hf, corpus = exported
    for ids in ours.encode(_documents(corpus)):
        assert hf.decode(ids) == ours.decode(ids)
        assert (hf.decode([2, *ids, 3], skip_special_tokens=True)
                == ours.decode([2, *ids, 3], skip_special_tokens=True))


def _has_bytes(ours: Tokenizer) -> bool:
    return ours.piece_to_id("<0x41>") != ours.unk_id


#: Texts with a character the tiny French corpus never holds (no piece: [UNK] without
#: byte fallback, one run of unknown characters giving one [UNK]).
UNKNOWN = ["Le 龍 dort", "chat龍", "龍", "龍龍 et 龍", "Le chat dort 龍龍."]


def _joined(ours: Tokenizer, ids: list[int]) -> str:
    """SentencePiece's decoding of normal pieces, written out from the pieces themselves:
    joined, "\u2581" as a space, no space before the first character."""
    sp = spm.SentencePieceProcessor(model_file=str(ours.path))
    return "".join(sp.id_to_piece(i) for i in ids).replace("\u2581", " ").lstrip(" ")


def test_decode_of_unk_is_the_same_string(exported):
    ours, hf, _ = exported
    for text in UNKNOWN:
        ids = ours.encode([text])[0]
        assert (1 in ids) != _has_bytes(ours), (text, ids)
        # Written as the name (the transformers convention), left out when skipping.
        want = text if _has_bytes(ours) else re.sub("龍+", "[UNK]", text)
        assert ours.decode(ids) == hf.decode(ids) == want, text
        # Skipped: the other pieces as SentencePiece joins them.
        skipped = text if _has_bytes(ours) else _joined(ours, [i for i in ids if i != 1])
        assert (ours.decode(ids, skip_special_tokens=True)
                == hf.decode(ids, skip_special_tokens=True) == skipped), text
    # Ids a model may predict: [UNK] and the other special ids among ordinary pieces.
    sp = spm.SentencePieceProcessor(model_file=str(ours.path))
    chat = ours.encode(["Le chat"])[0]
    for ids, want, skipped in [
        ([1], "[UNK]", ""), ([1, 1], "[UNK][UNK]", ""),
        ([2, *chat, 1, 4, 3, 0], "[CLS] " + sp.decode(chat) + "[UNK][MASK][SEP][PAD]",
         sp.decode(chat)),
        ([*chat, 1, *chat], sp.decode(chat) + "[UNK] " + sp.decode(chat),
         sp.decode(chat) + " " + sp.decode(chat)),
    ]:
        assert ours.decode(ids) == hf.decode(ids) == want, ids
        assert (ours.decode(ids, skip_special_tokens=True)
                == hf.decode(ids, skip_special_tokens=True) == skipped), ids


def test_rule_table_is_our_whitespace_map(tiny_tokenizer_manifest):
    proto = read_model_proto(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path))
    rules = charsmap_rules(proto.normalizer_spec.precompiled_charsmap)
    assert rules == {chr(c): " " for c in range(0x110000) if chr(c).isspace() and c != 0x20}
    assert charsmap_rules(proto.normalizer_spec.precompiled_charsmap, limit=5) is None


def test_unsupported_options_are_refused(tiny_tokenizer_manifest, tmp_path):
    path = tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path)
    proto = read_model_proto(path)
    proto.trainer_spec.treat_whitespace_as_suffix = True
    changed = tmp_path / "spm.model"
    changed.write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match="treat_whitespace_as_suffix"):
        build_hf_tokenizer(SentencePieceTokenizer(changed, "NFC"))
