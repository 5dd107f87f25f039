"""Stage 5, training: `train(cfg, model, masking, shards, tokenizer, out_dir) -> TrainManifest`.

`train()` builds the Stateful parts of the loop (`loop.Parts`) from its config sections,
hands them to a `Checkpointer`, resumes from the newest checkpoint in its output directory
if there is one, runs `loop.run_steps`, saves the final checkpoint and writes the
manifest. Metrics go to `out_dir/metrics.jsonl` and to the sink it is given (the loop
never talks to MLflow itself).

Under `torchrun` (`WORLD_SIZE` > 1) `train()` joins the process group, wraps the model (DDP,
or FSDP2) and gives each rank its strided part of the row order; only rank 0 writes
`metrics.jsonl`, checkpoints and the manifest and feeds `sink`. Resuming needs the world
size the checkpoint was written with.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from mlm_pipeline import store
from mlm_pipeline.config import SEP_ID, MaskingConfig, ModelConfig, TrainConfig, resolve_lr
from mlm_pipeline.manifest import (ShardManifest, Stopwatch, TokenizerManifest, TrainManifest,
                                   compute_digest, write_manifest)
from mlm_pipeline.masking.keyed import exact_k
from mlm_pipeline.masking.maskers import Masker, build_masker
from mlm_pipeline.shards import shard_special_ids
from mlm_pipeline.shards.format import verify_shards
from mlm_pipeline.sinks import JsonlSink, MetricsSink, MultiSink
from mlm_pipeline.tokenizer import Tokenizer
from mlm_pipeline.train.checkpoint import Checkpointer, RngState
from mlm_pipeline.train.data import PrecomputedShardDataset, RowCursor, ShardDataset
from mlm_pipeline.train.distributed import FsdpModelState, FsdpOptimizerState, World, init_world
from mlm_pipeline.train.hf import hf_class_name
from mlm_pipeline.train.loop import Evaluator, Parts, StopSignal, TrainState, run_steps
from mlm_pipeline.train.meter import Meter
from mlm_pipeline.train.model import BertMLM
from mlm_pipeline.train.perf import (COMPILE_RECOMPILE_LIMIT, adamw_impl, compile_model,
                                     peak_flops, resolve_compile, resolve_device,
                                     resolve_precision)
from mlm_pipeline.train.schedule import build_lr_scheduler
from mlm_pipeline.train.verified import latest_intact_checkpoint
from mlm_pipeline.train.warm_start import parent_of_run

logger = logging.getLogger(__name__)


def build_train_masker(masking: MaskingConfig, shards: ShardManifest,
                       tokenizer: TokenizerManifest, max_steps: int | None = None) -> Masker:
    """`build_masker` for this run: the shards' special ids, the masked copies' reader in
    precomputed mode, the tokenizer's word boundaries (bool (V,) `word_starts`, and
    `word_ends` for byte-level BPE) with `masking.whole_word`, and `max_steps` (the span of
    a masking-rate schedule).

    Raises:
        ValueError: the shards' special ids are not the tokenizer's; `build_masker`'s.
    """
    special_ids = shard_special_ids(shards, tokenizer)
    copies = PrecomputedShardDataset(shards) if masking.mode == "precomputed" else None
    word_starts = word_ends = None
    if masking.whole_word and masking.mode == "dynamic":
        tok = Tokenizer.load(tokenizer)
        word_starts, word_ends = tok.word_starts(), tok.word_ends()
    return build_masker(masking, shards.vocab_size, shards, word_starts=word_starts,
                        copies=copies, max_steps=max_steps, special_ids=special_ids,
                        word_ends=word_ends)


def train_digest(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig,
                 shards: ShardManifest, tokenizer: TokenizerManifest, run_key: str,
                 init: dict[str, Any] | None = None) -> str:
    """Identity of one training run: configs, inputs, run key and the warm start's parent
    digest (`init`: `InitSource.record()`), so runs from different parents differ. An unset
    `init_from` is left out and the model hashed as `ModelConfig.digest_record` gives it,
    so digests made before those fields existed still hold."""
    unset = {"init_from"} if cfg.init_from is None else set()
    # `phase_of` names the chain a run belongs to, `init_required` guards a config's
    # use: neither is what the run trains
    train = cfg.model_dump(mode="json", exclude={"trust_unverified_checkpoint", "phase_of",
                                                   "init_required", *unset})
    inputs = {"shards": shards.digest, "tokenizer": tokenizer.digest, "run": run_key}
    if init is not None:
        inputs["init"] = init["digest"]
    return compute_digest("train", {"model": model.digest_record(cfg.document_attention),
                                    "train": train, "masking": masking}, inputs)


def build_parts(cfg: TrainConfig, model_cfg: ModelConfig, masking: MaskingConfig,
                shards: ShardManifest, tokenizer: TokenizerManifest,
                world: World | None = None,
                init_state: dict[str, torch.Tensor] | None = None) -> Parts:
    """Seed torch with `cfg.seed` and build every part of the loop on the resolved device
    (on CUDA, GPU `LOCAL_RANK` of `world`); with several ranks the model is wrapped before
    the optimizer is built.

    The order is fixed: the model's initialization and then the CPU peak-FLOP/s
    measurement (`perf.peak_flops` draws random matrices) consume the global RNG, and a
    checkpoint's RNG state is restored only after both. `init_state` (a warm start's
    parent weights) replaces the initial weights (the global RNG is drawn all the same).

    Raises:
        ValueError: fewer training rows than one micro-batch; precomputed masking without
            matching copies.
        RuntimeError: CUDA or bf16 requested but unavailable; `compile=on` without a C++
            compiler on CPU.
    """
    world = world or World.single()
    device = world.device(resolve_device(cfg.device))
    precision = resolve_precision(cfg.precision, device)
    if cfg.num_threads and device.type == "cpu":
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    dataset = ShardDataset(shards, "train")
    model = BertMLM(model_cfg, shards.vocab_size, shards.seq_len).to(device)
    if init_state is not None:
        model.load_state_dict(init_state)
    # Forward passes go through `forward_model`; checkpoints save `model`, whose
    # state_dict keys carry no `_orig_mod.` prefix.
    compiled = resolve_compile(cfg.compile, device)
    wrapped = world.wrap(model, device)  # fsdp2 shards `model` in place: before AdamW
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr,
                                  betas=cfg.betas, eps=cfg.eps, **adamw_impl(device))
    fsdp = world.distributed and world.strategy == "fsdp2"
    return Parts(
        model=model,
        forward_model=(compile_model(wrapped, device, recompile_limit=COMPILE_RECOMPILE_LIMIT)
                       if compiled else wrapped),
        world=world,
        state_parts=({"model": FsdpModelState(model),
                      "optimizer": FsdpOptimizerState(model, optimizer)} if fsdp else {}),
        optimizer=optimizer, lr_scheduler=build_lr_scheduler(optimizer, cfg), dataset=dataset,
        cursor=RowCursor(len(dataset), cfg.micro_batch_size, cfg.seed, world.rank,
                         world.world_size),
        masker=build_train_masker(masking, shards, tokenizer, cfg.max_steps),
        meter=Meter(device, cfg.micro_batch_size * cfg.grad_accum_steps * world.world_size
                    * shards.seq_len,
                    model.flops_per_token(shards.seq_len, _mean_rate(masking, cfg.max_steps)),
                    _all_ranks_peak(peak_flops(device, precision), world)),
        train_state=TrainState(), rng=RngState(), device=device, precision=precision,
        autocast=(torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                  else contextlib.nullcontext()),
        document_attention=cfg.document_attention,
        sep_id=tokenizer.special_tokens.get("[SEP]", SEP_ID),
        # Inductor builds C++/Triton code at the first step; a missing or broken toolchain
        # surfaces there, deep in a long traceback (empty tuple: nothing to catch).
        compile_errors=(torch._dynamo.exc.BackendCompilerFailed,) if compiled else (),
        # exact_k selects at most exact_k(L, p) tokens a row (whole words too): a static
        # head size, so the compiled forward neither breaks its graph at `nonzero` nor
        # recompiles as the masked count changes (tests/integration/test_compile_recompiles.py).
        masked_per_row=(exact_k(shards.seq_len, masking.peak_probability)
                        if compiled and masking.selection == "exact_k" else None),
        recompile_limit=COMPILE_RECOMPILE_LIMIT if compiled else None,
    )


def _mean_rate(masking: MaskingConfig, max_steps: int) -> float:
    """The masking rate averaged over the run's steps: the share MFU counts the head at."""
    if not masking.scheduled:
        return masking.mlm_probability
    return sum(masking.mlm_probability_at(s, max_steps) for s in range(max_steps)) / max_steps


def _all_ranks_peak(peak: float | None, world: World) -> float | None:
    """The MFU denominator: one device's peak FLOP/s times the ranks."""
    return peak * world.world_size if peak else peak


def checkpoint_meta(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig,
                    shards: ShardManifest, tokenizer: TokenizerManifest) -> dict[str, Any]:
    """What makes a checkpoint self-describing: the `model`, `train` and `masking` configs,
    `vocab_size`, `seq_len` (tokens), the tokenizer and shard digests, `special_ids` (as
    JSON), and `hf_class`: the `transformers` class the weights map onto one to one
    (`hf.hf_class_name`: `BertForMaskedLM`, `ModernBertForMaskedLM`, or None)."""
    return {"config": _configs(cfg, model, masking), "hf_class": hf_class_name(model),
            "vocab_size": shards.vocab_size, "seq_len": shards.seq_len,
            "tokenizer_digest": tokenizer.digest, "shards_digest": shards.digest,
            "special_ids": shards.special_ids.model_dump(mode="json")}


def _configs(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig) -> dict[str, Any]:
    """The `model`, `train` and `masking` sections as JSON."""
    return {"model": model.model_dump(mode="json"), "train": cfg.model_dump(mode="json"),
            "masking": masking.model_dump(mode="json")}


def _truncate_metrics_log(path: Path, step: int) -> None:
    """Drop records logged after `step` (the resumed run logs those steps again); a line
    cut short by a kill (not valid JSON) is dropped with a warning. In the mirror of a URL work directory the store's copy is used when it holds more records up
    to `step` (a run resumed on another machine, or on one whose copy is older)."""
    texts = [path.read_text()] if path.is_file() else []
    if (remote := store.read_remote(path)) is not None:
        texts.append(remote.decode("utf-8", "replace"))
    if not texts:
        return
    kept = max((_records_upto(path, text, step) for text in texts), key=len)
    path.write_text("".join(line + "\n" for line in kept))


def _records_upto(path: Path, text: str, step: int) -> list[str]:
    """The lines of `text` (of `path`) with a step <= `step`, incomplete ones dropped."""
    kept = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            logger.warning("%s:%d: incomplete record (the run was killed while writing it) "
                           "dropped", path, number)
            continue
        if record["step"] <= step:
            kept.append(line)
    return kept


def train(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig, shards: ShardManifest,
          tokenizer: TokenizerManifest, out_dir: str | Path, sink: MetricsSink | None = None,
          evaluator: Evaluator | None = None, init_checkpoint: Path | None = None,
          stop: StopSignal | None = None) -> TrainManifest:
    """Pretrain a `BertMLM` on the training shards (dynamic or precomputed masking).

    Args:
        cfg: the `train` section (`lr: auto` is resolved from `model`, `config.lr_auto`).
        model: the encoder's shape (`model` section).
        masking: the `masking` section (its `seed` keys the masks).
        shards: packed training rows.
        tokenizer: the tokenizer the shards were encoded with (recorded in checkpoints).
        out_dir: this run's directory (`checkpoints/`, `metrics.jsonl`, `manifest.json`);
            if it already holds a checkpoint, training resumes from it.
        sink: receives one metrics dict per log interval (besides `metrics.jsonl`); not
            closed here.
        evaluator: periodic held-out evaluation (`loop.Evaluator`); its metrics go to the
            same sinks. It does not change what is trained.
        init_checkpoint: the local checkpoint an MLflow `cfg.init_from` was fetched to
            (None: a local path, or unset); used at a fresh start only.
        stop: the run's stop request (`loop.StopSignal`): once set, the step reached is
            checkpointed and `TrainingInterrupted` raised; None: never.

    Returns:
        The `TrainManifest` (also written as `out_dir/manifest.json`).

    Raises:
        ValueError: when the training split has fewer rows than one micro-batch, with
            precomputed masking, the shards hold no copies made with this masking and seed,
            (`cfg.verify_shards`) a shard is missing or its sha256 differs from the manifest
            (the file is named), or the checkpoint resumed from was written with another
            data order or masking (the masker's or cursor's state differs); a warm start
            (`cfg.init_from`) whose parent is not a checkpoint, is damaged, or differs from
            this run in architecture, vocabulary or `seq_len` (every field named).
        RuntimeError: when CUDA or bf16 is requested but unavailable, when `cfg.compile=on`
            cannot compile (no C++ compiler on CPU, or the first compiled step fails to
            build), or the loss becomes non-finite (the step is named).
    """
    watch = Stopwatch()
    cfg = resolve_lr(cfg, model)  # `lr: auto` of a TrainConfig passed on its own
    out = Path(out_dir).expanduser().resolve()
    world = init_world(cfg.distributed, resolve_device(cfg.device))
    try:
        return _train(cfg, model, masking, shards, tokenizer, out, sink, evaluator, world,
                      watch, init_checkpoint, stop)
    finally:
        world.close()


def refuse_fsdp2_evaluation(distributed: bool, strategy: str) -> None:
    """Refuse periodic evaluation during a several-rank FSDP2 run: the evaluator runs on
    rank 0 alone, while each FSDP2 rank holds only a shard of the parameters.

    Args:
        distributed: the run has several ranks.
        strategy: `train.distributed.strategy` (`ddp` or `fsdp2`).

    Raises:
        ValueError: `distributed` and `strategy` is `fsdp2`.
    """
    if distributed and strategy == "fsdp2":
        raise ValueError("eval.every_steps: periodic evaluation during training runs on "
                         "rank 0 alone, which FSDP2's sharded parameters do not allow: use "
                         "train.distributed.strategy ddp or turn periodic evaluation off")


def _train(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig, shards: ShardManifest,
           tokenizer: TokenizerManifest, out: Path, sink: MetricsSink | None,
           evaluator: Evaluator | None, world: World, watch: Stopwatch,
           init_checkpoint: Path | None = None,
           stop: StopSignal | None = None) -> TrainManifest:
    """`train` once the process group (if any) is up: rank 0 alone writes files."""
    if evaluator is not None:
        refuse_fsdp2_evaluation(world.distributed, world.strategy)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.verify_shards:
            verify_shards(shards)
    world.barrier()
    # Rank 0 picks the checkpoint; every rank loads it (the work directory must be shared).
    resume_from = world.broadcast(
        latest_intact_checkpoint(out / "checkpoints", cfg.trust_unverified_checkpoint)
        if world.is_main else None)
    init_record, init_state = parent_of_run(cfg, model, shards, tokenizer, resume_from,
                                            init_checkpoint)
    parts = build_parts(cfg, model, masking, shards, tokenizer, world, init_state)
    parts.evaluator = evaluator if world.is_main else None
    meta = checkpoint_meta(cfg, model, masking, shards, tokenizer)
    checkpointer = Checkpointer(out / "checkpoints", parts.stateful(),
                                {**meta, "init": init_record} if init_record else meta,
                                keep_last=cfg.keep_last_checkpoints,
                                is_writer=world.is_main, barrier=world.barrier,
                                trust_unverified=cfg.trust_unverified_checkpoint)
    if resume_from is not None:
        checkpointer.load(resume_from, map_location=parts.device)
        logger.info("resuming at step %d (%d tokens seen)", parts.train_state.step,
                    parts.train_state.tokens_seen)
    if world.is_main:
        # From a checkpoint: the records after its step go; from step 0 (no checkpoint,
        # or every one damaged) all of a killed process's records go, as it trains again.
        _truncate_metrics_log(out / "metrics.jsonl",
                              parts.train_state.step if resume_from is not None else -1)
    jsonl = JsonlSink(out / "metrics.jsonl", append=True) if world.is_main else None
    logger.info(
        "training %s parameters on %s (%s%s%s%s): %d steps of %d tokens, %d training rows",
        f"{parts.model.num_parameters():,}", parts.device, parts.precision,
        ", compiled" if parts.forward_model is not parts.model else "",
        ", document attention" if cfg.document_attention else "",
        f", rank {world.rank} of {world.world_size} ({world.strategy})"
        if world.distributed else "", cfg.max_steps,
        parts.meter.tokens_per_step, len(parts.dataset),
    )
    try:
        sinks = MultiSink(*(s for s in (jsonl, sink) if s is not None and world.is_main))
        last_metrics, stop_reason = run_steps(parts, cfg, checkpointer, sinks, stop)
        sinks.flush()
        final = checkpointer.save(parts.train_state.step)
    finally:
        if jsonl is not None:
            jsonl.close()
    return _write_train_manifest(cfg, model, masking, shards, tokenizer, out, watch, final,
                                 parts, last_metrics, stop_reason, init_record)


def _write_train_manifest(cfg: TrainConfig, model: ModelConfig, masking: MaskingConfig,
                          shards: ShardManifest, tokenizer: TokenizerManifest, out: Path,
                          watch: Stopwatch, final: Path, parts: Parts,
                          last_metrics: dict[str, float], stop_reason: str,
                          init: dict[str, Any] | None = None) -> TrainManifest:
    """Write and return the manifest of a finished run (`final`: its last checkpoint)."""
    meter = parts.meter
    manifest = TrainManifest(
        stage="train",
        digest=train_digest(cfg, model, masking, shards, tokenizer, out.name, init),
        output_dir=str(out), config=_configs(cfg, model, masking),
        inputs={"shards": shards.digest, "tokenizer": tokenizer.digest,
                **({"init": init["digest"]} if init else {})},
        created_at=watch.created_at, wall_time_s=watch.elapsed,
        checkpoint_dir=str(final.relative_to(out)),
        steps=parts.train_state.step, tokens_seen=parts.train_state.tokens_seen,
        final_metrics=last_metrics, metrics_log="metrics.jsonl",
        stopped_early=stop_reason != "max_steps", stop_reason=stop_reason,
        device=parts.device.type, precision=parts.precision,
        train_time_s=meter.train_time_s(),
        peak_tflops=meter.peak_flops / 1e12 if meter.peak_flops else None,
        peak_source=meter.peak_source, compile_fallback=parts.compile_fallback, init=init,
    )
    if parts.world.is_main:  # checkpoints are in the store already (a URL work directory)
        write_manifest(manifest, changed_only=True)
    return manifest
