"""Training under `torchrun`: the launcher the flow calls and the entry point it starts.

`run_torchrun` writes the run's inputs (the `train`, `model` and `masking` sections, the
shard and tokenizer manifests) to `<out_dir>/launch/`, starts

    python -m torch.distributed.run --nproc-per-node N --nnodes M
        (--standalone | --rdzv-backend c10d --rdzv-endpoint HOST:PORT)
        --log-dir <out_dir>/launch/torchrun-<time> -m <entry>
        --inputs <out_dir>/launch/inputs.json --out-dir <out_dir>

(what the `torchrun` command runs), hands every line of its output to a callback as it
comes, and reads back the `TrainManifest` rank 0 wrote. The entry module is `ENTRY` unless
the caller names another (`mlm_pipeline.app.torchrun_entry`, which logs to MLflow live). On
a failure it raises `DistributedTrainingError` with the root cause: the earliest error a
rank recorded in its `torch.distributed.elastic` error file (`error.json` under
`--log-dir`), naming the rank and the exception.

`main` is the entry point each rank runs: it reads the inputs and calls `stage.train`.
Metrics reach the launcher as log lines (`StdoutSink` on rank 0; `sink_line_step` reads
their step back); `metrics.jsonl` holds them all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlm_pipeline.config import MaskingConfig, ModelConfig, TrainConfig
from mlm_pipeline.errors import TransientError
from mlm_pipeline.manifest import (
    ShardManifest,
    TokenizerManifest,
    TrainManifest,
    atomic_write_text,
    read_manifest,
)

logger = logging.getLogger(__name__)

#: The module `torchrun` runs on every rank.
ENTRY = "mlm_pipeline.train.launch"


class DistributedTrainingError(RuntimeError, TransientError):
    """A `torchrun` launch failed (transient: a rank that died, a lost node; the retry
    resumes from the newest checkpoint).

    Attributes:
        rank: the global rank whose error came first (None when no rank recorded one,
            e.g. a rank killed by a signal).
        returncode: torchrun's exit status.
    """

    def __init__(self, message: str, rank: int | None, returncode: int) -> None:
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


@dataclass(frozen=True)
class LaunchInputs:
    """What every rank of a launch reads from `inputs.json`: the arguments of `stage.train`
    and the entry module's `extra` (a JSON object; for `ENTRY`, at most `init_checkpoint`:
    where the launcher fetched an MLflow `train.init_from`, `app.training_run.launch_extra`)."""

    train: TrainConfig
    model: ModelConfig
    masking: MaskingConfig
    shards: ShardManifest
    tokenizer: TokenizerManifest
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def init_checkpoint(self) -> Path | None:
        """The fetched parent checkpoint (`extra["init_checkpoint"]`), or None."""
        found = self.extra.get("init_checkpoint")
        return Path(found) if found else None


def write_launch_inputs(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig,
                        shards: ShardManifest, tokenizer: TokenizerManifest,
                        out_dir: Path, extra: Mapping[str, Any] | None = None) -> Path:
    """Write what every rank needs to `<out_dir>/launch/inputs.json` (configs and manifests
    as JSON, `extra` under its own key) and return its path.

    Raises:
        TypeError: `extra` holds a value JSON cannot represent.
    """
    path = out_dir / "launch" / "inputs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = {"train": cfg, "model": model, "masking": masking, "shards": shards,
                "tokenizer": tokenizer}
    data = {k: v.model_dump(mode="json") for k, v in sections.items()}
    atomic_write_text(path, json.dumps({**data, "extra": dict(extra or {})}, indent=2))
    return path


def read_launch_inputs(path: str | Path) -> LaunchInputs:
    """Read `inputs.json` back (`write_launch_inputs`).

    Raises:
        ValueError: the file is not JSON, or a section is missing or invalid (the file and
            the section are named).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    kinds = {"train": TrainConfig, "model": ModelConfig, "masking": MaskingConfig,
             "shards": ShardManifest, "tokenizer": TokenizerManifest}
    values: dict[str, Any] = {}
    for key, kind in kinds.items():
        if key not in data:
            raise ValueError(f"{path}: section {key!r} is missing")
        try:
            values[key] = kind.model_validate(data[key])
        except ValueError as exc:
            raise ValueError(f"{path}: section {key!r}: {exc}") from exc
    return LaunchInputs(**values, extra=dict(data.get("extra") or {}))


def torchrun_command(cfg: TrainConfig, inputs: Path, out_dir: Path, log_dir: Path,
                     entry: str = ENTRY) -> list[str]:
    """The `torch.distributed.run` command line of a launch (`train.distributed`) running
    module `entry` on every rank: one node uses `--standalone` (a free local port), several
    the c10d rendezvous at `rdzv_endpoint`."""
    dist = cfg.distributed
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(dist.nproc_per_node), "--nnodes", str(dist.nnodes),
           "--log-dir", str(log_dir)]
    cmd += (["--rdzv-backend", "c10d", "--rdzv-endpoint", dist.rdzv_endpoint]
            if dist.rdzv_endpoint else ["--standalone"])
    return [*cmd, "-m", entry, "--inputs", str(inputs), "--out-dir", str(out_dir)]


def root_cause(log_dir: Path) -> tuple[int | None, str] | None:
    """The earliest error a rank recorded under torchrun's `log_dir`: (global rank,
    message with the rank's traceback), or None when no rank wrote an error file."""
    found = []
    for path in log_dir.glob("**/error.json"):
        try:
            message = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError):
            continue
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        text = message.get("message", "") if isinstance(message, dict) else str(message)
        found.append((int(extra.get("time_ns", 0)) or int(extra.get("timestamp", 0)) * 10**9,
                      extra.get("rank"), text, extra.get("py_callstack", "")))
    if not found:
        return None
    _, rank, text, stack = min(found, key=lambda f: f[0])
    return rank, f"{text}\n{stack}".rstrip()


def run_torchrun(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig,
                 shards: ShardManifest, tokenizer: TokenizerManifest, out_dir: str | Path,
                 on_line: Callable[[str], None] = logger.info, entry: str = ENTRY,
                 extra: Mapping[str, Any] | None = None) -> TrainManifest:
    """Train with `train.distributed.nproc_per_node x nnodes` ranks under torchrun.

    Args:
        cfg, model, masking, shards, tokenizer: as for `stage.train`.
        out_dir: the run's directory (as for `stage.train`); it must be on storage every
            node shares.
        on_line: receives each line torchrun and the ranks print, as it comes.
        entry: the module every rank runs (`python -m entry --inputs ... --out-dir ...`;
            it must call `stage.train` on every rank).
        extra: what `entry` needs beyond the training inputs (JSON values), written to
            `inputs.json` under `extra` (`LaunchInputs.extra`), never on the command line.

    Returns:
        The `TrainManifest` rank 0 wrote to `out_dir/manifest.json`.

    Raises:
        DistributedTrainingError: torchrun failed; the message names the first failing
            rank and its exception (or, when no rank recorded an error, the exit status
            and the last lines of output).
    """
    out = Path(out_dir).expanduser().resolve()
    inputs = write_launch_inputs(cfg, model, masking, shards, tokenizer, out, extra)
    log_dir = out / "launch" / f"torchrun-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    cmd = torchrun_command(cfg, inputs, out, log_dir, entry)
    on_line("launching: " + " ".join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env=env) as proc:
        try:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                on_line(tail[-1])
        except BaseException:  # cancelled or interrupted: torchrun forwards it to the ranks
            proc.terminate()
            proc.wait(timeout=60)
            raise
        returncode = proc.wait()
    if returncode != 0:
        cause = root_cause(log_dir)
        if cause is None:
            raise DistributedTrainingError(
                f"torchrun exited with status {returncode} and no rank recorded an error "
                "(killed by a signal?); last output:\n" + "\n".join(tail), None, returncode)
        rank, message = cause
        raise DistributedTrainingError(f"distributed training failed on rank {rank}: "
                                       f"{message}", rank, returncode)
    return read_manifest(out / "manifest.json", TrainManifest)


#: A rank-0 `StdoutSink` line as `rank_logging` formats it: `[rank 0] INFO
#: mlm_pipeline.sinks: step 12 | train/loss 5.1 | ...`.
_SINK_LINE = re.compile(r"\[rank 0\] INFO mlm_pipeline\.sinks: step (\d+) \| ")


def sink_line_step(line: str) -> int | None:
    """The step of a metrics line rank 0's `StdoutSink` printed (`rank_logging` format),
    None for any other line (another rank's, a warning, torchrun's own): how a launcher
    follows the training's progress from its output."""
    match = _SINK_LINE.search(line)
    return int(match[1]) if match else None


def _error_handler():
    """torch's elastic `ErrorHandler`, also recording the global rank and a nanosecond
    time, so the launcher can name the first failing rank when several fail in the same
    second (torch records whole seconds)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class RankErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            now = time.time_ns()
            super().record_exception(e)
            path = self._get_error_file_path()
            if path and os.path.isfile(path):
                data = json.loads(Path(path).read_text())
                data["message"]["extraInfo"].update(
                    rank=int(os.environ.get("RANK", "0")), time_ns=now)
                Path(path).write_text(json.dumps(data))

    return RankErrorHandler()


def parse_rank_args(argv: list[str] | None, entry: str) -> argparse.Namespace:
    """The command line of an entry module `entry` (`--inputs`, `--out-dir`).

    Raises:
        SystemExit: an argument is missing (argparse's usage message).
    """
    parser = argparse.ArgumentParser(prog=f"python -m {entry}",
                                     description="one rank of a torchrun training launch")
    parser.add_argument("--inputs", required=True, help="inputs.json of write_launch_inputs")
    parser.add_argument("--out-dir", required=True, help="the run's directory")
    return parser.parse_args(argv)


def rank_logging() -> int:
    """Send this rank's log records to stdout, prefixed `[rank N]` (INFO on rank 0,
    warnings only on the others), and return the global rank (`RANK`, 0 when unset)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    return rank


def recorded(entry_main: Callable[[list[str] | None], None],
             argv: list[str] | None = None) -> None:
    """Run `entry_main(argv)` so that an exception is recorded in torchrun's error file with
    this rank and a nanosecond time (`root_cause` reads it), then raised.

    Raises:
        Exception: whatever `entry_main` raises.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    record(entry_main, error_handler=_error_handler())(argv)


def _main(argv: list[str] | None = None) -> None:
    args = parse_rank_args(argv, ENTRY)
    rank = rank_logging()
    from mlm_pipeline.sinks import StdoutSink
    from mlm_pipeline.train.stage import train

    inputs = read_launch_inputs(args.inputs)
    train(inputs.train, inputs.model, inputs.masking, inputs.shards, inputs.tokenizer,
          args.out_dir, sink=StdoutSink() if rank == 0 else None,
          init_checkpoint=inputs.init_checkpoint)


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank (`python -m mlm_pipeline.train.launch --inputs ... --out-dir
    ...`); an exception is recorded in torchrun's error file with this rank, then raised.

    Raises:
        Exception: whatever `stage.train` raises on this rank.
    """
    recorded(_main, argv)


if __name__ == "__main__":
    main()
