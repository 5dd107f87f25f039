"""Continuing the pretraining of a published encoder: `mlm-pipeline run tiny --set
train.init_from=<a save_pretrained BertForMaskedLM directory>` in a fresh process.

The parent is a small random `BertForMaskedLM` (nonzero token-type row 0) whose tokenizer
is a real WordPiece `tokenizer.json` trained with `tokenizers` on the test corpus and saved
beside it (`tests.adopted_tokenizers`). The run takes its model section from the parent's
`config.json` (params and log say so), adopts its tokenizer, trains a few steps from its
weights (the first step's loss is transformers' own loss of the parent on that batch and
masks), records the parent (directory, digest computed here, class) as MLflow tags, and
exports back to a `BertForMaskedLM` that `pipeline("fill-mask")` loads. A `--set model.*`
that disagrees with the parent is one error naming the field, before any flow runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlm_pipeline.manifest import ShardManifest, TokenizerManifest, read_manifest
from tests.adopted_tokenizers import build_bert_wordpiece
from tests.conftest import TINY_FR

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "mlm-pipeline"
SEQ_LEN, STEPS, BATCH, SEED = 32, 3, 4, 7


def make_parent(out: Path) -> tuple[Path, object]:
    """A random `BertForMaskedLM` over a WordPiece vocabulary of the test corpus, both
    saved into `out` by `save_pretrained`; (out, the model in eval mode)."""
    import transformers

    build_bert_wordpiece(TINY_FR, out)
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(out)))
    torch.manual_seed(3)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa"))
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.normal_()
    model.save_pretrained(out)
    return out, model.eval()


def test_a_conflicting_model_override_is_one_error_naming_it(tmp_path, monkeypatch, capsys):
    from mlm_pipeline.cli import main

    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "config.json").write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 200,
        "max_position_embeddings": 64}))
    monkeypatch.chdir(tmp_path)
    calls = []
    rc = main(["run", "tiny", "--set", f"train.init_from={parent}", "--set",
               "model.hidden_size=64"], run_flow=lambda *a, **k: calls.append(a))
    err = capsys.readouterr().err
    assert rc == 2 and calls == []
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "--set model.hidden_size=64 (config.json: 32)" in lines[0]
    assert "BertForMaskedLM" in lines[0]


@pytest.mark.slow  # a tiny pipeline run through Prefect in a child process: about a minute
def test_run_continues_a_published_bert(tmp_path, prefect_api_url):
    import transformers
    from mlflow.tracking import MlflowClient

    parent, hf = make_parent(tmp_path / "parent")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    work = tmp_path / "work"
    summary = tmp_path / "summary.json"
    overrides = [f"work_dir={work}", f"ingest.sources=[{TINY_FR}]",
                 "ingest.validation_fraction=0.15", f"shards.seq_len={SEQ_LEN}",
                 f"train.init_from={parent}", "model.dropout=0.0",
                 "train.document_attention=false", f"train.max_steps={STEPS}",
                 "train.warmup_steps=1", f"train.micro_batch_size={BATCH}",
                 f"train.seed={SEED}", "train.log_every=1", "train.precision=fp32",
                 "train.compile=off", "eval.max_rows=20", "eval.every_steps=null",
                 "eval.probes=[]", "linear_probe.enabled=false", "tracking.log_model=false",
                 f"tracking.tracking_uri={uri}", "tracking.experiment_name=hf-parent"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "MLFLOW_DISABLE_TELEMETRY": "true"}
    args = [str(CLI), "run", "tiny", "--summary-json", str(summary)]
    for item in overrides:
        args += ["--set", item]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(summary.read_text())

    # The parent's config.json is the model section: params and log say so.
    run = MlflowClient(tracking_uri=uri).get_run(result["mlflow_run_id"])
    params, tags = run.data.params, run.data.tags
    assert params["mlm.model_from"] == f"{parent / 'config.json'} (BertForMaskedLM)"
    assert (params["model.preset"], params["model.hidden_size"], params["model.num_layers"],
            params["model.num_heads"], params["model.intermediate_size"]) == (
        "bert", "32", "2", "2", "64")
    assert params["tokenizer.adopt_from"] == str(parent)
    log = "".join(p.read_text() for p in (work / "logs").glob("*.log"))
    assert "is a Hugging Face BertForMaskedLM: its config.json replaces the model" in log
    # The lineage: directory, digest of every file read, class.
    files = sorted(p for p in parent.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    lines = "".join(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
    assert tags["mlm.init_digest"] == hashlib.sha256(lines.encode()).hexdigest()
    assert tags["mlm.init_checkpoint"] == str(parent.resolve())
    assert tags["mlm.init_hf_class"] == "BertForMaskedLM" and tags["mlm.init_step"] == "0"

    # Step 1 trained from the parent's weights: its loss is transformers' own on that batch.
    from mlm_pipeline.train.data import RowCursor, ShardDataset
    from mlm_pipeline.train.stage import build_train_masker

    from mlm_pipeline.config_files import load_config

    cfg = load_config("tiny", overrides)
    (shards_manifest,) = (work / "shards").glob("*/manifest.json")
    shards = read_manifest(shards_manifest, ShardManifest)
    (tok_manifest,) = (work / "tokenizer").glob("*/manifest.json")
    tokenizer = read_manifest(tok_manifest, TokenizerManifest)
    assert tokenizer.vocab_size == hf.config.vocab_size
    dataset = ShardDataset(shards, "train")
    rows, epoch = RowCursor(len(dataset), BATCH, SEED).next_batch()
    masker = build_train_masker(cfg.masking, shards, tokenizer, STEPS)
    input_ids, labels = masker(dataset.get(rows), torch.from_numpy(rows), epoch)
    with torch.no_grad():
        want = float(hf(input_ids=input_ids, labels=labels).loss)
    train_dir = Path(result["checkpoint"]).parents[1]
    first = json.loads((train_dir / "metrics.jsonl").read_text().splitlines()[0])
    print(f"transformers' loss of the parent on the first batch {want:.6f}, "
          f"the run's first step {first['train/loss']:.6f}")
    assert first["step"] == 1 and first["train/loss"] == pytest.approx(want, rel=1e-5)

    # Before vs after: the final evaluation scored the parent on its own rows and fixed
    # masks; transformers' own loss of the parent on those rows is the same figure.
    from mlm_pipeline.evaluate.stage import eval_masking
    from mlm_pipeline.tokenizer import Tokenizer

    validation = ShardDataset(shards, "validation")
    index = torch.arange(min(cfg.eval.max_rows, len(validation)))
    masks = eval_masking(cfg.eval, cfg.masking, shards, Tokenizer.load(tokenizer))
    input_ids, labels = masks(validation.get(index.numpy()), index, 0)
    with torch.no_grad():
        before = float(hf(input_ids=input_ids, labels=labels).loss)
    metrics = result["metrics"]
    print(f"transformers' loss of the parent on the eval rows {before:.6f}, the run's "
          f"eval/parent_loss {metrics['eval/parent_loss']:.6f}, eval/loss "
          f"{metrics['eval/loss']:.6f}")
    assert metrics["eval/parent_loss"] == pytest.approx(before, rel=1e-5)
    assert metrics["eval/parent_loss"] != metrics["eval/loss"]

    # Exported back as a BertForMaskedLM that fill-mask loads.
    from mlm_pipeline.train.export import export_checkpoint

    out = export_checkpoint(Path(result["checkpoint"]), tmp_path / "exported")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out))
    answers = fill(f"Le chat dort sur la {fill.tokenizer.mask_token}.")
    assert len(answers) == 5 and all(a["token_str"] for a in answers)
    back = transformers.AutoModelForMaskedLM.from_pretrained(out)
    assert type(back) is transformers.BertForMaskedLM
