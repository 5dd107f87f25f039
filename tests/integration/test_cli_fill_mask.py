"""`mlm-pipeline fill-mask` on a real checkpoint: run-directory lookup and one-line errors."""

import json

import pytest

from mlm_pipeline import cli
from mlm_pipeline.config import PipelineConfig, TrainConfig
from mlm_pipeline.train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_config, tiny_shard_manifest, tiny_tokenizer_manifest):
    root = tmp_path_factory.mktemp("fill-mask")
    cfg = PipelineConfig(work_dir=str(root), model=tiny_model_config, train=TrainConfig(
        micro_batch_size=4, max_steps=4, warmup_steps=0, checkpoint_every=2,
        keep_last_checkpoints=2, precision="fp32"))
    train(cfg.train, cfg.model, cfg.masking,
          tiny_shard_manifest, tiny_tokenizer_manifest, root / "run")
    return root / "run"


def test_run_directory_means_its_newest_checkpoint(run_dir, tiny_tokenizer_manifest, capsys):
    spm_model = str(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path))
    text = "Le [MASK] est là."
    assert cli.main(["fill-mask", str(run_dir), spm_model, text, "--top-k", "3"]) == 0
    from_run = json.loads(capsys.readouterr().out)
    newest = run_dir / "checkpoints" / "step-00000004"
    assert newest.is_dir() and (run_dir / "checkpoints" / "step-00000002").is_dir()
    assert cli.main(["fill-mask", str(newest), spm_model, text, "--top-k", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == from_run
    assert from_run[0]["text"] == text and len(from_run[0]["predictions"][0]) == 3
    older = run_dir / "checkpoints" / "step-00000002"
    assert cli.main(["fill-mask", str(older), spm_model, text, "--top-k", "3"]) == 0
    assert json.loads(capsys.readouterr().out) != from_run  # really a different checkpoint


def test_probe_text_is_normalized_like_the_corpus(run_dir, tiny_tokenizer_manifest, capsys):
    spm_model = str(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path))
    outputs = []
    for text in ("Le [MASK] du café.", "Le [MASK] du cafe\u0301."):  # NFC vs decomposed
        assert cli.main(["fill-mask", str(run_dir), spm_model, text, "--top-k", "5"]) == 0
        [result] = json.loads(capsys.readouterr().out)
        outputs.append(result["predictions"])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("case", ["missing", "empty", "no-mask"])
def test_bad_input_is_one_line_exit_1(case, run_dir, tiny_tokenizer_manifest, tmp_path, capsys):
    spm_model = str(tiny_tokenizer_manifest.file(tiny_tokenizer_manifest.model.path))
    path, text, expect = {
        "missing": (tmp_path / "nope", "Le [MASK].", "no such checkpoint"),
        "empty": (tmp_path, "Le [MASK].", "holds no complete checkpoint"),
        "no-mask": (run_dir, "Pas de masque.", "[MASK]"),
    }[case]
    assert cli.main(["fill-mask", str(path), spm_model, text]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlm-pipeline: error: ") and expect in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_config_prints_unicode(capsys):
    assert cli.main(["config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "\\x" not in out and "allé" in out
