"""Adopting a Hugging Face tokenizer (`tokenizer.adopt_from`): a BERT WordPiece vocabulary
(special ids 0, 100-103) and a ModernBERT-like byte-level BPE (special tokens added after
the vocabulary), built locally and saved by `transformers`; then the shards, masking,
whole-word masking, fill-mask and export with their ids.

Expected values come from the tokenizers themselves through `transformers` (their ids,
encodings, word ids and offsets), never from the pipeline's code.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from mlm_pipeline.config import MaskingConfig, ModelConfig, PipelineConfig, ShardConfig
from mlm_pipeline.evaluate.stage import eval_masking, fill_mask
from mlm_pipeline.manifest import TokenizerManifest, read_manifest
from mlm_pipeline.shards import shard_special_ids, write_shards
from mlm_pipeline.shards.format import open_shard
from mlm_pipeline.shards.parallel import partitioned_encoder
from mlm_pipeline.tokenizer import (
    PretrainedTokenizer,
    Tokenizer,
    adopt_pretrained_tokenizer,
    pretrained_tokenizer_digest,
)
from mlm_pipeline.tokenizer.hf_files import export_tokenizer
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.stage import build_train_masker
from tests.adopted_tokenizers import build_bert_wordpiece, build_modernbert_bpe
from tests.conftest import TINY_FR

KINDS = ["bert", "modern"]
TEXT = "Le chat dort sur la table.\nLa maison, blanche, est grande; les enfants jouent."


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"bert": build_bert_wordpiece(TINY_FR, root / "bert"),
            "modern": build_modernbert_bpe(TINY_FR, root / "modern")}


@pytest.fixture(scope="module")
def hf(sources):
    """The `transformers` view of each tokenizer: the oracle."""
    return {k: transformers.AutoTokenizer.from_pretrained(str(d)) for k, d in sources.items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def adopted(sources, work):
    return {k: adopt_pretrained_tokenizer(d, work) for k, d in sources.items()}


@pytest.fixture(scope="module")
def shards(adopted, tiny_corpus_manifest, work):
    cfg = ShardConfig(seq_len=32, rows_per_shard=64, encode_batch_size=3)
    return {k: write_shards(cfg, tiny_corpus_manifest, m, work) for k, m in adopted.items()}


def hf_special_ids(tok) -> set[int]:
    """Every id the tokenizer flags special: its named special tokens and added tokens
    with `special` set."""
    added = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return set(tok.all_special_ids) | added


@pytest.mark.parametrize("kind", KINDS)
def test_manifest_records_files_sha256_and_the_tokenizers_ids(kind, adopted, sources, hf):
    m, tok = adopted[kind], hf[kind]
    assert m.kind == "pretrained" and m.source == str(sources[kind])
    read = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sources[kind].iterdir()}
    assert m.inputs == read  # every file read, by sha256
    assert {e.path: e.sha256 for e in m.tokenizer_files()} == read  # the copies
    ids = m.special_ids
    assert (ids.pad_id, ids.unk_id, ids.cls_id, ids.sep_id, ids.mask_id) == (
        tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
        tok.mask_token_id)
    assert set(ids.all_special_ids) == hf_special_ids(tok)
    assert m.vocab_size == len(tok)
    if kind == "bert":
        assert (ids.pad_id, ids.unk_id, ids.cls_id, ids.sep_id, ids.mask_id) == (
            0, 100, 101, 102, 103)
        assert m.word_boundary == "continuation:##" and m.model_type == "wordpiece"
    else:
        assert ids.cls_id > 400 and m.word_boundary == "byte_level"
        assert {tok.convert_tokens_to_ids(t) for t in ("<|padding|>", "<|endoftext|>")} <= set(
            ids.all_special_ids)
        assert tok.convert_tokens_to_ids("|||IP_ADDRESS|||") not in ids.all_special_ids


def test_identity_is_the_files_content(sources, adopted, tmp_path, work):
    copy = shutil.copytree(sources["bert"], tmp_path / "elsewhere")
    assert pretrained_tokenizer_digest(copy) == adopted["bert"].digest
    again = adopt_pretrained_tokenizer(copy, work)
    assert again.digest == adopted["bert"].digest and again.output_dir == adopted["bert"].output_dir
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    assert pretrained_tokenizer_digest(copy) != adopted["bert"].digest


def test_refuses_what_cannot_be_adopted(sources, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        adopt_pretrained_tokenizer(tmp_path, tmp_path / "w")
    broken = shutil.copytree(sources["bert"], tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a Hugging Face tokenizers"):
        adopt_pretrained_tokenizer(broken, tmp_path / "w")
    nameless = shutil.copytree(sources["bert"], tmp_path / "nameless")
    config = json.loads((nameless / "tokenizer_config.json").read_text())
    del config["mask_token"]
    (nameless / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mask_token is not named"):
        adopt_pretrained_tokenizer(nameless, tmp_path / "w")


def test_a_changed_stage_file_is_refused(adopted, tmp_path):
    copy = shutil.copytree(adopted["bert"].output_dir, tmp_path / "stage")
    m = read_manifest(copy / "manifest.json", TokenizerManifest)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match="sha256"):
        Tokenizer.load(m.model_copy(update={"output_dir": str(copy)}))


@pytest.mark.parametrize("kind", KINDS)
def test_encoding_is_the_tokenizers_own(kind, adopted, hf):
    tok, theirs = Tokenizer.load(adopted[kind]), hf[kind]
    assert isinstance(tok, PretrainedTokenizer) and tok.vocab_size == len(theirs)
    # Documents: special names are plain text; probes: "[MASK]" is the mask token.
    doc = TEXT + " [MASK] [SEP]"
    assert tok.encode([doc]) == [theirs(doc, add_special_tokens=False,
                                        split_special_tokens=True)["input_ids"]]
    probe = "La [MASK] est grande."
    assert tok.encode_with_mask(probe) == theirs(probe, add_special_tokens=False)["input_ids"]
    assert theirs.mask_token_id in tok.encode_with_mask(probe)
    encoder = tok.batch_encoder()
    assert [a.tolist() for a in encoder([doc.encode()])] == tok.encode([doc])


@pytest.mark.parametrize("kind", KINDS)
def test_shards_are_written_with_the_tokenizers_ids(kind, shards, adopted, hf,
                                                    tiny_corpus_manifest):
    m, theirs = shards[kind], hf[kind]
    assert m.special_ids == adopted[kind].special_ids and m.dtype == "uint16"
    stream = []
    for entry in tiny_corpus_manifest.train:
        for text in pq.read_table(tiny_corpus_manifest.file(entry.path)).column("text").to_pylist():
            stream += theirs(text, add_special_tokens=False,
                             split_special_tokens=True)["input_ids"] + [theirs.sep_token_id]
    body = m.seq_len - 1
    expected = [[theirs.cls_token_id, *stream[i * body:(i + 1) * body]]
                for i in range(len(stream) // body)]
    rows = np.concatenate([open_shard(m.file(e.path)) for e in m.train.shards])
    assert rows.astype(np.int64).tolist() == expected


def test_partitioned_encoding_gives_the_same_shards(adopted, shards, tiny_corpus_manifest,
                                                    tmp_path):
    encode = partitioned_encoder(Tokenizer.load(adopted["modern"]),
                                 ShardConfig(seq_len=32, rows_per_shard=64), map, 4)
    again = write_shards(ShardConfig(seq_len=32, rows_per_shard=64), tiny_corpus_manifest,
                         adopted["modern"], tmp_path, encode=encode)
    assert [e.sha256 for e in again.train.shards] == [
        e.sha256 for e in shards["modern"].train.shards]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("selection", ["bernoulli", "exact_k"])
def test_training_masks_never_touch_special_ids(kind, selection, shards, adopted, hf):
    m = shards[kind]
    masking = MaskingConfig(mlm_probability=0.5, mask_replace_prob=0.5,
                            random_replace_prob=0.5, selection=selection)
    masker = build_train_masker(masking, m, adopted[kind])
    rows = torch.from_numpy(np.concatenate([open_shard(m.file(e.path))
                                            for e in m.train.shards]).astype(np.int64))
    corrupted, labels = masker(rows, torch.arange(len(rows)), 0)
    special = torch.tensor(sorted(hf_special_ids(hf[kind])))
    is_special = torch.isin(rows, special)
    assert bool(is_special[:, 0].all()) and bool((labels[is_special] == -100).all())
    assert torch.equal(corrupted[is_special], rows[is_special])
    selected = labels != -100
    assert selected.sum() > 0.4 * (~is_special).sum()
    masked = corrupted[selected] == hf[kind].mask_token_id
    assert 0.4 < masked.float().mean() < 0.6  # the tokenizer's [MASK], not id 4
    drawn = corrupted[selected][~masked]
    assert len(drawn) > 100 and not bool(torch.isin(drawn, special).any())


def bert_words(tok, text):
    """Word index of each token: `transformers`' own `word_ids` (BERT's pre-tokenizer
    words, which "##" continues)."""
    return tok(text, add_special_tokens=False).word_ids()


def whitespace_words(tok, text):
    """Word index of each token from the offsets: a token begins a word when it begins
    the text, is preceded by whitespace, or itself begins with whitespace."""
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    words, n = [], -1
    for start, _ in offsets:
        if start == 0 or text[start - 1].isspace() or text[start].isspace():
            n += 1
        words.append(n)
    return words


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("selection", ["bernoulli", "exact_k"])
def test_whole_words_follow_the_tokenizers_word_boundaries(kind, selection, adopted, hf):
    tok, theirs = Tokenizer.load(adopted[kind]), hf[kind]
    ids = theirs(TEXT, add_special_tokens=False)["input_ids"]
    words = (bert_words if kind == "bert" else whitespace_words)(theirs, TEXT)
    assert len(set(words)) < len(words)  # some words have several pieces
    row = torch.tensor([[theirs.cls_token_id, *ids, theirs.sep_token_id]] * 64)
    from mlm_pipeline.masking import keyed_masking

    masking = keyed_masking(MaskingConfig(whole_word=True, selection=selection,
                                          mlm_probability=0.3), tok)
    _, labels = masking(row, torch.arange(64), 0)
    selected = (labels[:, 1:-1] != -100).numpy()
    whole = np.array(words)
    for r in range(64):
        for w in set(words):
            assert len(set(selected[r, whole == w])) == 1, (r, w)
    # ... and the words are apart: each pair of neighbours differs in some row.
    first = [words.index(w) for w in sorted(set(words))]
    for a, b in zip(first, first[1:]):
        assert (selected[:, a] != selected[:, b]).any(), (a, b)
    assert 0 < selected.mean() < 1


def test_evaluation_masks_and_fill_mask_use_the_tokenizer(shards, adopted, hf,
                                                          tiny_model_config):
    tok, m, theirs = Tokenizer.load(adopted["modern"]), shards["modern"], hf["modern"]
    masking = eval_masking(PipelineConfig().eval, MaskingConfig(), m, tok)
    assert masking.special_ids == m.special_ids
    torch.manual_seed(0)
    model = BertMLM(tiny_model_config, tok.vocab_size, m.seq_len).eval()
    special = sorted(hf_special_ids(theirs))
    with torch.no_grad():  # make every special id the model's favourite
        model.head.decoder.bias[special] = 50.0
    [result] = fill_mask(model, tok, ["La [MASK] est grande."], seq_len=m.seq_len, top_k=10)
    tokens = [p["token"] for p in result["predictions"][0]]
    assert len(result["predictions"]) == 1  # the one [MASK], found by the tokenizer's id
    assert not set(tokens) & set(theirs.convert_ids_to_tokens(special))


def test_masking_refuses_shards_of_another_tokenizer(shards, adopted, tiny_tokenizer_manifest):
    with pytest.raises(ValueError, match="special ids"):
        shard_special_ids(shards["bert"], tiny_tokenizer_manifest)
    with pytest.raises(ValueError, match="special ids"):
        build_train_masker(MaskingConfig(), shards["modern"], adopted["bert"])


@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_the_tokenizer_back_as_it_came(kind, adopted, hf, tmp_path):
    export_tokenizer(adopted[kind], tmp_path, model_max_length=32)
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    theirs = hf[kind]
    assert type(back) is type(theirs) and back.model_max_length == 32
    assert back.get_vocab() == theirs.get_vocab()
    assert back(TEXT)["input_ids"] == theirs(TEXT)["input_ids"]
    assert back.all_special_ids == theirs.all_special_ids


def test_config_key_and_exclusions():
    cfg = PipelineConfig.model_validate({"tokenizer": {"adopt_from": "/models/bert"}})
    assert cfg.tokenizer.adopt_from == "/models/bert"
    with pytest.raises(ValueError, match="exclusive"):
        PipelineConfig.model_validate({"tokenizer": {"adopt_from": "/m", "from_init": True},
                                       "train": {"init_from": "/m"}})
    assert ModelConfig()  # the model section is untouched by the tokenizer's


def test_a_run_on_adopted_shards_exports_with_the_tokenizers_ids(shards, adopted, hf, work):
    from mlm_pipeline.config import TrainConfig
    from mlm_pipeline.evaluate.hf_fill_mask import fill_mask_hf
    from mlm_pipeline.train import train
    from mlm_pipeline.train.checkpoint import load_model
    from mlm_pipeline.train.export import export_checkpoint

    m, theirs = shards["modern"], hf["modern"]
    model = ModelConfig(preset="modern", hidden_size=32, num_layers=2, num_heads=2,
                        intermediate_size=64)
    cfg = TrainConfig(micro_batch_size=4, max_steps=4, warmup_steps=1, lr=3e-3,
                      checkpoint_every=4, precision="fp32", seed=3)
    trained = train(cfg, model, MaskingConfig(whole_word=True), m, adopted["modern"],
                    work / "train" / "adopted")
    checkpoint = trained.file(trained.checkpoint_dir)
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["special_ids"] == m.special_ids.model_dump(mode="json")
    out = export_checkpoint(checkpoint, work / "exported")
    config = json.loads((out / "config.json").read_text())
    assert (config["pad_token_id"], config["cls_token_id"], config["sep_token_id"]) == (
        theirs.pad_token_id, theirs.cls_token_id, theirs.sep_token_id)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).get_vocab() == theirs.get_vocab()
    text = ["La [MASK] est grande."]
    ours = fill_mask(load_model(checkpoint, "cpu"), Tokenizer.load(adopted["modern"]), text,
                     seq_len=m.seq_len)
    exported = fill_mask_hf(out, text)
    assert ([p["token"] for p in ours[0]["predictions"][0]]
            == [p["token"] for p in exported[0]["predictions"][0]])
