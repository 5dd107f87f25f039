"""`export_tokenizer` on tokenizers of corpora whose characters leave a reserved piece
([PAD], [UNK], [CLS], [SEP], [MASK]) without a safe cut (no capitals, no brackets, digits
only, CJK): the export succeeds and `AutoTokenizer` on it gives our ids on the corpus and
on texts holding the special names. Corpora are generated here (seeded), vocabularies
small."""

from __future__ import annotations

import random

import pytest

from mlm_pipeline.config import TokenizerConfig
from mlm_pipeline.tokenizer import Tokenizer, train_tokenizer
from mlm_pipeline.tokenizer.hf_files import export_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = ("le chat dort sur la table pendant que il pleut dehors une maison verte "
         "avec des fenêtres et un jardin où les enfants jouent au ballon").split()
CJK = "我们今天去公园散步天气很好东京大学的学生在图书馆看书山川草木花鸟风月"


def _paragraphs(kind: str, n: int = 150, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "digits":
            text = " ".join(str(rng.randrange(10 ** rng.randint(1, 5))) for _ in range(12))
        elif kind == "cjk":
            text = "".join(rng.choice(CJK) for _ in range(rng.randint(10, 30))) + "。"
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
            if kind == "no_brackets":  # capitals, but never a bracket
                words[0] = words[0].capitalize()
                words = [w.upper() if rng.random() < 0.1 else w for w in words]
            text = " ".join(words) + "."
        out.append(text)
    return out


@pytest.fixture(scope="module", params=["no_capitals", "no_brackets", "digits", "cjk"])
def exported(request, make_corpus_manifest, tmp_path_factory):
    paragraphs = _paragraphs(request.param)
    corpus = make_corpus_manifest(tmp_path_factory.mktemp("corpus"), paragraphs)
    # room for every character: 46 CJK ones; capitals double the Latin alphabet
    vocab_size = {"cjk": 80, "no_brackets": 72}.get(request.param, 40)
    manifest = train_tokenizer(TokenizerConfig(vocab_size=vocab_size, character_coverage=1.0),
                               corpus, tmp_path_factory.mktemp("work"))
    out = tmp_path_factory.mktemp("hf")
    export_tokenizer(manifest, out, model_max_length=64)  # raised AttributeError before
    return Tokenizer.load(manifest), transformers.AutoTokenizer.from_pretrained(out), paragraphs


def test_the_corpus_encodes_as_ours(exported):
    ours, hf, paragraphs = exported
    got = hf(paragraphs, split_special_tokens=True)["input_ids"]
    assert [g for g, w in zip(got, ours.encode(paragraphs)) if g != [2, *w, 3]] == []


def test_special_names_in_text(exported):
    ours, hf, paragraphs = exported
    texts = [f"{paragraphs[0][:8]} [MASK] {paragraphs[1][:8]}", "[MASK]", "x[MASK]y",
             "[PAD] [UNK] [CLS] [SEP]", "<0x41>"]
    plain = hf(texts, split_special_tokens=True)["input_ids"]
    assert plain == [[2, *ids, 3] for ids in ours.encode(texts)]
    for text in texts[:4]:  # a literal name is its id, as in our fill-mask probes
        assert hf(text)["input_ids"] == [2, *ours.encode_with_mask(text), 3]
