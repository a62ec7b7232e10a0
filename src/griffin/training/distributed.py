"""Data parallelism, applied from outside the model: ``torchrun --nproc_per_node N -m griffin.cli train ...``.

Every rank builds the same model (same seed), reads its own share of each epoch's windows
(``PackedLoader(rank=, world_size=)``) and its share of the validation batches; gradients are averaged by
``DistributedDataParallel``; rank 0 alone writes logs, checkpoints, plots and the sample. Without torchrun's
environment (``WORLD_SIZE`` unset or 1) nothing here does anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1  # tensor-parallel ranks per model replica (griffin.training.layout): they share their batches
    cp: int = 1  # context-parallel ranks per model replica: they share their batches, each holding a shard of the
    # sequence (griffin.parallel.context_parallel)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own batches."""
        return self.world_size // (self.tp * self.cp)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    @property
    def cp_rank(self) -> int:
        """Which contiguous shard of each sequence this rank holds."""
        return (self.rank // self.tp) % self.cp

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the data-parallel and context-parallel ranks (``value`` itself on one process);
        the tp ranks of a replica hold the same value, counted once."""
        if self.enabled:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            if self.tp > 1:
                value = value / self.tp if value.is_floating_point() else value // self.tp
        return value

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(device: str) -> tuple[Distributed, str]:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); return it and this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    elif device == "auto":
        device = "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    return Distributed(rank, world_size, local_rank), device
