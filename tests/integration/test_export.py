"""`train.export` and `mlm-pipeline export`: checkpoints of both presets as `transformers`
model directories that compute what ours computes (`bert` -> `BertForMaskedLM`, `modern` ->
`ModernBertForMaskedLM`).

A tiny model of each preset is trained for a few steps (sequences of 64 tokens, so the
fill-mask probes fit) in one work directory, evaluated, and exported:

- the checkpoint records the class (`hf_class`), and `config.json` names it;
- `AutoModelForMaskedLM` loads it with no missing, unexpected or mismatched weights (so
  none newly initialised) and gives our logits at masked positions within 1e-4 (fp32,
  eval mode);
- `pipeline("fill-mask")` gives the top-5 tokens of our `fill_mask` on the probes;
- the CLI (`cli.main`; `export` in a fresh process is in test_checkpoint_verified.py's
  slow tier) accepts a checkpoint or a run directory and answers a bad SOURCE with one
  line and status 1 (bert run only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlm_pipeline import cli
from mlm_pipeline.config import (
    EvalConfig,
    MaskingConfig,
    ModelConfig,
    ShardConfig,
    TokenizerConfig,
    TrainConfig,
)
from mlm_pipeline.evaluate import evaluate
from mlm_pipeline.evaluate.stage import fill_mask
from mlm_pipeline.masking.maskers import build_masker
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.tokenizer import Tokenizer, train_tokenizer
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import load_model
from mlm_pipeline.train.data import ShardDataset
from mlm_pipeline.train.export import export_checkpoint

transformers = pytest.importorskip("transformers")

SEQ_LEN = 64
STEPS = 8
HF_CLASS = {"bert": "BertForMaskedLM", "modern": "ModernBertForMaskedLM"}


@pytest.fixture(scope="module")
def make_run(tmp_path_factory, tiny_corpus_manifest):
    """`make_run(preset)`: a trained, evaluated run of that preset, (work_dir, tokenizer,
    shards, train manifest, eval manifest), made once; the presets share one work
    directory (tokenizer, shards) and train in `train/<preset>`."""
    work = tmp_path_factory.mktemp("export-work")
    tok = train_tokenizer(TokenizerConfig(vocab_size=128), tiny_corpus_manifest, work)
    shards = write_shards(ShardConfig(seq_len=SEQ_LEN, rows_per_shard=64, encode_batch_size=4),
                          tiny_corpus_manifest, tok, work)
    runs = {}

    def make(preset: str):
        if preset not in runs:
            model = ModelConfig(preset=preset, hidden_size=32, num_layers=2, num_heads=2,
                                intermediate_size=64)
            cfg = TrainConfig(micro_batch_size=4, max_steps=STEPS, warmup_steps=2, lr=3e-3,
                              checkpoint_every=STEPS // 2, precision="fp32", seed=3)
            trained = train(cfg, model, MaskingConfig(), shards, tok, work / "train" / preset)
            evaluated = evaluate(EvalConfig(), trained, shards, tok, work)
            runs[preset] = work, tok, shards, trained, evaluated
        return runs[preset]

    return make


@pytest.fixture(scope="module", params=sorted(HF_CLASS))
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def run(make_run, preset):
    return make_run(preset)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    _, _, _, trained, _ = run
    return export_checkpoint(trained.file(trained.checkpoint_dir),
                             tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def bert_run(make_run):
    return make_run("bert")


@pytest.fixture(scope="module")
def bert_exported(bert_run, tmp_path_factory) -> Path:
    _, _, _, trained, _ = bert_run
    return export_checkpoint(trained.file(trained.checkpoint_dir),
                             tmp_path_factory.mktemp("hf-bert") / "model")


def test_directory_and_model_card(exported, run, preset, tiny_corpus_manifest):
    _, tok, shards, trained, evaluated = run
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= names
    state = json.loads((trained.file(trained.checkpoint_dir) / "state.json").read_text())
    assert state["hf_class"] == HF_CLASS[preset]
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [HF_CLASS[preset]] and config["vocab_size"] == 128
    assert config["max_position_embeddings"] == SEQ_LEN
    if preset == "modern":
        assert config["layer_types"] == ["full_attention", "sliding_attention"]
        assert config["rope_parameters"]["full_attention"]["rope_theta"] == 10000.0
    card = (exported / "README.md").read_text()
    for fact in (tiny_corpus_manifest.digest, tok.digest, shards.digest,
                 f"Steps: {STEPS}", f"tokens seen: {trained.tokens_seen:,}",
                 f"{evaluated.metrics['eval/loss']:.4f}", "pipeline_tag: fill-mask"):
        assert fact in card
    assert not list(exported.parent.glob(".model.tmp-*"))


def test_loads_with_every_weight(exported, preset):
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(
        exported, output_loading_info=True)
    assert type(model).__name__ == HF_CLASS[preset]
    assert {"missing_keys", "unexpected_keys", "mismatched_keys"} <= set(info)
    assert {k: v for k, v in info.items() if v} == {}  # missing, unexpected, mismatched


def test_logits_match_at_masked_positions(exported, run, preset):
    _, _, shards, trained, _ = run
    ours = load_model(trained.file(trained.checkpoint_dir))
    hf = transformers.AutoModelForMaskedLM.from_pretrained(exported).eval()
    dataset = ShardDataset(shards, "validation")
    rows = torch.arange(len(dataset))
    input_ids, labels = build_masker(MaskingConfig(seed=7), shards.vocab_size)(
        dataset.get(rows.numpy()), rows, 0)
    assert (labels != -100).sum() > 10
    with torch.no_grad():
        mine = ours(input_ids, labels=labels).logits
        theirs = hf(input_ids=input_ids).logits[labels != -100]
    assert mine.dtype == theirs.dtype == torch.float32 and mine.shape == theirs.shape
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert type(hf).__name__ == HF_CLASS[preset]


def test_fill_mask_pipeline_top5(exported, run):
    _, tok_manifest, _, trained, _ = run
    probes = [p.text for p in EvalConfig().probes]
    ours = fill_mask(load_model(trained.file(trained.checkpoint_dir)),
                     Tokenizer.load(tok_manifest), probes, seq_len=SEQ_LEN, top_k=5)
    fill = transformers.pipeline("fill-mask", model=str(exported))
    for probe, mine in zip(probes, ours):
        theirs = fill(probe, top_k=5)
        pieces = fill.tokenizer.convert_ids_to_tokens([c["token"] for c in theirs])
        assert pieces == [c["token"] for c in mine["predictions"][0]], probe


@pytest.mark.parametrize("model, hf_class, expect", [
    ({"preset": "modern", "activation": "gelu"}, None,
     "not Hugging Face ModernBertForMaskedLM compatible: model.activation='gelu'"),
    ({"preset": "bert", "norm": "pre"}, None, "BertForMaskedLM needs 'post'"),
    ({"preset": "modern"}, "BertForMaskedLM", "records hf_class 'BertForMaskedLM'"),
])
def test_unmappable_model_is_refused(model, hf_class, expect, bert_run, tmp_path):
    _, _, _, trained, _ = bert_run
    fake = tmp_path / "step-00000001"
    fake.mkdir()
    state = json.loads((trained.file(trained.checkpoint_dir) / "state.json").read_text())
    state["config"]["model"] = ModelConfig(**model).model_dump(mode="json")
    state["hf_class"] = hf_class
    (fake / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=expect):
        export_checkpoint(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizer_outside_the_work_dir(bert_run, tmp_path):
    _, tok, _, trained, _ = bert_run
    moved = tmp_path / "step-copy"
    shutil.copytree(trained.file(trained.checkpoint_dir), moved)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        export_checkpoint(moved, tmp_path / "a")
    out = export_checkpoint(moved, tmp_path / "b", tokenizer=tok.output_dir)
    assert (out / "tokenizer.json").is_file()


def test_cli_exports_newest_checkpoint_of_a_run(bert_run, tmp_path, capsys):
    # In this process: `export` in a fresh one is test_checkpoint_verified.py's (slow tier).
    work = bert_run[0]
    out = tmp_path / "from-run"
    capsys.readouterr()
    status = cli.main(["export", str(work / "train" / "bert"), str(out)])
    stdout, stderr = capsys.readouterr()
    assert status == 0, stderr
    summary = json.loads(stdout)
    assert Path(summary["checkpoint"]).name == f"step-{STEPS:08d}"
    assert (work / "train" / "bert" / "checkpoints" / f"step-{STEPS // 2:08d}").is_dir()
    assert set(summary["files"]) == {p.name for p in out.iterdir()}
    assert transformers.AutoTokenizer.from_pretrained(out).mask_token_id == 4


@pytest.mark.parametrize("case", ["missing", "empty", "mlflow", "garbage", "exists"])
def test_cli_bad_source_is_one_line(case, bert_run, bert_exported, tmp_path, capsys):
    work = bert_run[0]
    (tmp_path / "empty").mkdir()
    source, out, expect = {
        "missing": (tmp_path / "nope", tmp_path / "o", "not a checkpoint directory"),
        "empty": (tmp_path / "empty", tmp_path / "o", "holds no complete checkpoint"),
        "mlflow": ("models:/tiny@champion", tmp_path / "o", "no MLflow database at"),
        "garbage": ("not-a-source", tmp_path / "o", "an MLflow run id (32 hex digits) or a "
                    "models:/NAME@ALIAS URI"),
        "exists": (work / "train" / "bert", bert_exported, "exists and is not empty"),
    }[case]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # no database there: not created
    assert cli.main(["export", str(source), str(out), "--tracking-uri", uri]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlm-pipeline: error: ") and expect in err
    assert str(source) in err or str(out) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists()
