"""Data-parallel training inside one `torchrun` worker: the process group, the model
wrapper and the collectives the loop needs.

`torchrun` (`torch.distributed.run`) starts one process per rank and sets `RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; `init_world` reads them and
joins the process group (`nccl` on CUDA, `gloo` on CPU). Without them (or with
`WORLD_SIZE=1`) it returns `World.single()`, whose collectives are no-ops.

How N ranks compute what one process computes on the same rows:

- each rank reads `micro_batch_size` rows per micro-batch from its strided slice of the
  shared row order (`data.RowCursor`), so a step covers `micro_batch_size *
  grad_accum_steps * world_size` rows: the rows one process reads with a micro-batch
  `world_size` times larger; masks are keyed by global row index, not by rank;
- the loss of every micro-batch is weighted by its masked tokens over the step's global
  masked-token count (an `all_reduce` of the count) and multiplied by `world_size`, since
  DDP and FSDP2 average gradients over ranks (PyTorch DDP docs, "gradients are averaged");
- gradient synchronization is skipped on non-final micro-batches (DDP `no_sync`, FSDP2
  `set_requires_gradient_sync(False)`);
- the reported loss and token counts are `all_reduce` sums, identical on every rank.

FSDP2 (`torch.distributed.fsdp.fully_shard`, Zhao et al. 2023 "PyTorch FSDP") shards the
parameters; checkpoints still hold the full, unsharded state, gathered with
`torch.distributed.checkpoint.state_dict` (`FsdpModelState`, `FsdpOptimizerState`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from mlm_pipeline.config.stages import DistributedConfig


@dataclass
class World:
    """This process's place among the ranks of a data-parallel run.

    Attributes:
        rank: global rank (0 = the rank that logs, checkpoints and writes the manifest).
        local_rank: rank on this node (the CUDA device index).
        world_size: number of ranks.
        strategy: `ddp` or `fsdp2`.
        wrapped: the `DistributedDataParallel` wrapper (`ddp`) or the `fully_shard`ed model
            (`fsdp2`) once `wrap` ran with several ranks; None before and with one rank.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    strategy: str = "ddp"
    wrapped: torch.nn.Module | None = None

    @classmethod
    def single(cls) -> World:
        """One process: collectives are no-ops, the model is not wrapped."""
        return cls()

    @property
    def distributed(self) -> bool:
        """True with more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """The device of this rank: `cuda:LOCAL_RANK` on CUDA, `device` otherwise."""
        if device.type == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return device

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks in place (no-op with one rank); returns it."""
        if self.distributed:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def any(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Element-wise OR of `flags` over ranks, so every rank takes the same decision
        (a time budget or a stop request seen by one rank)."""
        if not self.distributed:
            return flags
        t = torch.tensor([int(f) for f in flags], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; small objects only)."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (no-op with one rank)."""
        if self.distributed:
            torch.distributed.barrier()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module the forward passes go through: `DistributedDataParallel(model)` with
        `ddp`, `model` itself sharded in place by `fully_shard` with `fsdp2`, `model` with
        one rank. `model` keeps the parameters (DDP) or their shards (FSDP2)."""
        if not self.distributed:
            return model
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:  # one all-gather per block (torchtitan's layout)
                fully_shard(layer)
            self.wrapped = fully_shard(model)
        else:
            self.wrapped = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        return self.wrapped

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Run a forward and backward pass with (`enabled`) or without gradient
        synchronization across ranks: off for the non-final micro-batches of a step."""
        if self.wrapped is None:
            yield
        elif self.strategy == "fsdp2":
            self.wrapped.set_requires_gradient_sync(enabled)
            yield
        elif enabled:
            yield
        else:
            with self.wrapped.no_sync():
                yield

    def close(self) -> None:
        """Destroy the process group (no-op with one rank)."""
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_world(cfg: DistributedConfig, device: torch.device) -> World:
    """Join the process group `torchrun` set up, or stay a single process.

    Args:
        cfg: `train.distributed`.
        device: the resolved training device type (`cpu` or `cuda`).

    Returns:
        The `World` of this process (`World.single()` when `WORLD_SIZE` is unset or 1).

    Raises:
        ValueError: `WORLD_SIZE` differs from `nproc_per_node * nnodes` (or is unset while
            they ask for several processes), or `nccl` is asked for on CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != cfg.world_size and "WORLD_SIZE" not in os.environ:
        raise ValueError(f"train.distributed asks for {cfg.world_size} processes but this one "
                         "was not started by torchrun (no WORLD_SIZE): launch it with "
                         "mlm_pipeline.train.launch.run_torchrun (the flow does)")
    if world_size == 1:
        return World.single()
    if world_size != cfg.world_size:
        raise ValueError(f"torchrun started {world_size} ranks but train.distributed asks for "
                         f"{cfg.world_size} (nproc_per_node {cfg.nproc_per_node} x nnodes "
                         f"{cfg.nnodes})")
    backend = cfg.backend if cfg.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("train.distributed.backend=nccl needs train.device cuda")
    world = World(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                  world_size=world_size, strategy=cfg.strategy)
    if device.type == "cuda":
        torch.cuda.set_device(world.local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=timedelta(minutes=30))
    return world


class FsdpModelState:
    """The full (unsharded) `state_dict` of an FSDP2 model as a Stateful part: gathered on
    every rank (a collective) and offloaded to the CPU of rank 0 when saving; loaded from
    the full state on every rank."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """Full tensors keyed like the plain model's `state_dict` (empty off rank 0)."""
        from torch.distributed.checkpoint import state_dict as dcp

        return dcp.get_model_state_dict(
            self.model, options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Shard a full `state_dict` onto this rank's parameters."""
        from torch.distributed.checkpoint import state_dict as dcp

        dcp.set_model_state_dict(self.model, state,
                                 options=dcp.StateDictOptions(full_state_dict=True))


class FsdpOptimizerState:
    """The full optimizer state of an FSDP2 model (keyed by parameter name), gathered like
    `FsdpModelState`. Checkpoints of `fsdp2` runs therefore resume only under `fsdp2`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state (empty off rank 0)."""
        from torch.distributed.checkpoint import state_dict as dcp

        return dcp.get_optimizer_state_dict(
            self.model, self.optimizer,
            options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Shard a full optimizer state onto this rank."""
        from torch.distributed.checkpoint import state_dict as dcp

        dcp.set_optimizer_state_dict(self.model, self.optimizer, state,
                                     options=dcp.StateDictOptions(full_state_dict=True))


def local_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """`clip_grad_norm_`'s result as a plain tensor (FSDP2 returns a DTensor: the global
    norm, replicated, read with `full_tensor`)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
