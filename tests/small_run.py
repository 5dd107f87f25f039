"""The `--set` options of a seconds-long `mlm-pipeline run tiny` on the repository's small
French sample, shared by the tests that run the installed command in a fresh environment
(the wheel, the dependency floors)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def small_run_args(work_dir: str | Path, experiment: str) -> list[str]:
    """`["--set", "KEY=VALUE", ...]`: tiny_fr.txt, a 128-piece vocabulary, a 2 x 32 model,
    4 fp32 steps, no probes, the model logged, in `work_dir` and MLflow `experiment`."""
    overrides = {
        "work_dir": str(work_dir),
        "ingest.sources": json.dumps([str(ROOT / "tests" / "assets" / "tiny_fr.txt")]),
        "ingest.validation_fraction": "0.1",
        "tokenizer.vocab_size": "128", "shards.seq_len": "32",
        "model.hidden_size": "32", "model.num_layers": "2", "model.num_heads": "2",
        "model.intermediate_size": "64",
        "train.micro_batch_size": "4", "train.max_steps": "4", "train.log_every": "1",
        "train.precision": "fp32",
        "eval.batch_size": "8", "eval.probes": "[]", "linear_probe.enabled": "false",
        "tracking.log_model": "true", "tracking.experiment_name": experiment,
    }
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
