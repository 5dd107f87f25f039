"""A stop request at any point of training, then a second `train()` into the same
directory: the run ends bit for bit where an uninterrupted run ends (weights, and every
step's logged loss, learning rate, gradient norm and masked-token count, each step once).

The graceful cases of the CLI resume matrix (`tests/flows/test_resume_cli.py`, slow), in
this process: the run's stop request (`StopSignal.request`, what the flows' SIGINT/SIGTERM
handler calls) is made at the same points of a run, and the loop checkpoints the step it
reaches and raises `TrainingInterrupted`:

- between two checkpoints (after a step is logged; `modern` preset, and `bert` with
  dropout, so the RNG state must travel too), in the first and in the second epoch;
- right after a checkpoint is written (the checkpointer's "checkpoint saved" record;
  precomputed masking);
- while a checkpoint is being written, after its first file (where the test-only fault
  `tests/faults/mlm_faults.kill_in_checkpoint` kills a process).

A stop request is honoured at the end of the step after the one in progress when it is
made (a request made as step n is logged or checkpointed stops the run at step n + 1). What only a real kill shows (a line of
`metrics.jsonl` cut short, a half-written checkpoint directory left behind, the Prefect
API and the MLflow run of a dead process) stays with the CLI matrix's SIGKILL cases.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mlm_pipeline.config import MaskingConfig, ModelConfig, TrainConfig
from mlm_pipeline.shards.stage import write_shards
from mlm_pipeline.sinks import MetricsSink
from mlm_pipeline.train import checkpoint as checkpoint_module
from mlm_pipeline.train import train
from mlm_pipeline.train.checkpoint import (
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_model_state,
)
from mlm_pipeline.train.loop import StopSignal, TrainingInterrupted
from mlm_pipeline.train.perf import PEAK_TFLOPS_ENV

MAX_STEPS, CHECKPOINT_EVERY, MICRO_BATCH = 24, 5, 16
#: Keys whose values depend only on the computation (tokens/s and MFU depend on the clock).
EXACT_KEYS = ("train/loss", "train/lr", "train/grad_norm", "train/masked_tokens")
#: The interrupted runs' stop signal (one run at a time in this module).
STOP = StopSignal()


def _model(preset: str) -> ModelConfig:
    # the presets' own dropout: 0.1 for `bert` (the RNG state matters), 0 for `modern`
    return ModelConfig(preset=preset, hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64)


def _masking(kind: str) -> MaskingConfig:
    return (MaskingConfig(mode="precomputed", dupe_factor=2, seed=3) if kind == "precomputed"
            else MaskingConfig(seed=3))


def _train_cfg() -> TrainConfig:
    return TrainConfig(micro_batch_size=MICRO_BATCH, max_steps=MAX_STEPS, warmup_steps=3,
                       log_every=1, checkpoint_every=CHECKPOINT_EVERY, precision="fp32",
                       seed=3, keep_last_checkpoints=2, num_threads=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread_and_a_declared_peak():
    # `train.num_threads` sets torch's (process-wide) intra-op threads: one thread keeps
    # these tiny steps fast on a busy machine; the rest of the session gets its own back.
    # A declared MFU peak spares each run the matmul timing (MFU is not compared here).
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PEAK_TFLOPS_ENV, "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest,
           tiny_shard_manifest):
    """The tiny shards for dynamic masking and, with two masked copies, for precomputed."""
    work = tmp_path_factory.mktemp("precomputed")
    return {"dynamic": tiny_shard_manifest,
            "precomputed": write_shards(tiny_shard_config, tiny_corpus_manifest,
                                        tiny_tokenizer_manifest, work, _masking("precomputed"))}


def _run(out: Path, preset: str, masking: str, shards, tokenizer, sink=None, stop=None):
    return train(_train_cfg(), _model(preset), _masking(masking), shards[masking], tokenizer,
                 out, sink=sink, stop=stop)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards, tiny_tokenizer_manifest):
    """(final weights, metrics records) of the uninterrupted run of a (preset, masking),
    each computed once per module, when a case first asks for it."""
    done: dict[tuple[str, str], tuple[dict, list[dict]]] = {}

    def get(preset: str, masking: str):
        if (preset, masking) not in done:
            out = tmp_path_factory.mktemp(f"ref-{preset}-{masking}")
            m = _run(out, preset, masking, shards, tiny_tokenizer_manifest)
            assert m.steps == MAX_STEPS and not m.stopped_early
            done[(preset, masking)] = (load_model_state(m.file(m.checkpoint_dir)),
                                       _records(out))
        return done[(preset, masking)]
    return get


class _StopAfterStep(MetricsSink):
    """Requests a stop as `step` is logged: SIGINT between two checkpoints."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step == self.step:
            STOP.request()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _StopAfterCheckpoint(logging.Handler):
    """Requests a stop when the checkpointer reports checkpoint `step` saved."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.name_ = checkpoint_name(step)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("checkpoint saved") and message.endswith(self.name_):
            STOP.request()


@pytest.fixture
def stop_after_checkpoint():
    """Installs `_StopAfterCheckpoint(step)` on the checkpointer's logger (at INFO)."""
    logger = logging.getLogger(checkpoint_module.__name__)
    installed, level = [], logger.level

    def install(step: int) -> None:
        handler = _StopAfterCheckpoint(step)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        installed.append(handler)
    yield install
    for handler in installed:
        logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def stop_while_writing(monkeypatch):
    """Requests a stop while checkpoint `step` is written, just after its first file is
    synced: the point where `mlm_faults.kill_in_checkpoint` kills a process. The
    write itself is untouched (the real `_fsync` runs)."""
    real_fsync = checkpoint_module._fsync
    seen: list[Path] = []

    def install(step: int) -> None:
        prefix = f".{checkpoint_name(step)}."

        def fsync(path: Path) -> None:
            real_fsync(path)
            if path.parent.name.startswith(prefix) and not seen:
                seen.append(path)
                STOP.request()
        monkeypatch.setattr(checkpoint_module, "_fsync", fsync)
    install.seen = seen
    return install


CASES = {
    # name: (preset, masking, how the stop is requested, at which step, step it stops at)
    "between-checkpoints": ("modern", "dynamic", "after-step", 12, 13),
    "between-checkpoints-dropout": ("bert", "dynamic", "after-step", 17, 18),
    "between-checkpoints-2nd-epoch": ("modern", "dynamic", "after-step", 21, 22),
    "right-after-checkpoint-precomputed": ("modern", "precomputed", "after-checkpoint", 20, 21),
    "while-writing-a-checkpoint": ("bert", "dynamic", "while-writing", 15, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_run_resumes_bit_for_bit(case, tmp_path, shards, tiny_tokenizer_manifest,
                                          reference, stop_after_checkpoint, stop_while_writing):
    preset, masking, how, at, stops_at = CASES[case]
    ref_weights, ref_records = reference(preset, masking)
    out = tmp_path / "run"
    sink = None
    if how == "after-step":
        sink = _StopAfterStep(at)
    elif how == "after-checkpoint":
        stop_after_checkpoint(at)
    else:
        stop_while_writing(at)
    STOP.clear()
    try:
        with pytest.raises(TrainingInterrupted) as stopped:
            _run(out, preset, masking, shards, tiny_tokenizer_manifest, sink=sink, stop=STOP)
        assert not STOP.requested  # the loop clears the request it honoured
    finally:
        STOP.clear()
    if how == "while-writing":
        assert stop_while_writing.seen, "the checkpoint write was not reached"
    # The step reached is checkpointed; the log holds the steps up to it, each once.
    assert stopped.value.step == stops_at
    assert latest_checkpoint(out / "checkpoints").name == checkpoint_name(stops_at)
    assert [r["step"] for r in _records(out)] == list(range(1, stops_at + 1))
    # 273 rows in batches of 16: step 18 starts the second epoch.
    if case.endswith("2nd-epoch"):
        assert _records(out)[-1]["train/epoch"] >= 1.0

    resumed = _run(out, preset, masking, shards, tiny_tokenizer_manifest)
    assert resumed.steps == MAX_STEPS and not resumed.stopped_early
    records = _records(out)
    assert [r["step"] for r in records] == [r["step"] for r in ref_records]
    for key in EXACT_KEYS:
        assert [r[key] for r in records] == [r[key] for r in ref_records], key
    weights = load_model_state(resumed.file(resumed.checkpoint_dir))
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), name
    assert [c.name for c in list_checkpoints(out / "checkpoints")][-1] == checkpoint_name(
        MAX_STEPS)
