"""The device layout of Section 4.1: ``dp_replicate × dp_shard × cp × tp`` devices as one ``DeviceMesh``.

- ``tp``: tensor (Megatron) parallelism inside each model replica (:mod:`griffin.parallel.tensor_parallel`);
- ``dp_shard``: ZeRO-3 data parallelism, parameters, gradients and optimizer states sharded
  (:mod:`griffin.parallel.fsdp`);
- ``dp_replicate``: plain data parallelism across groups of ``dp_shard`` (HSDP when both are above 1);
- ``cp``: context parallelism, each sequence split into cp contiguous shards (:mod:`griffin.parallel.context_parallel`);
  the cp ranks of a model replica read the same batches, and FSDP shards over ``dp_shard × cp`` (as torchtitan does).

Rank r sits at ``(r // (dp_shard · cp · tp), (r // (cp · tp)) % dp_shard, (r // tp) % cp, r % tp)``: the tp ranks
of a replica are neighbours, so they share a node (NVLink) whenever tp divides the GPUs per node, and the cp ranks
next (their carries and halos are small, their key/value gathers are not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """How many devices each kind of parallelism spans; any of them may be 1. ``world_size`` is their product."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @classmethod
    def resolve(cls, world_size: int, tp: int = 1, dp_shard: int = 1, dp_replicate: int = 0,
                cp: int = 1) -> ParallelDims:
        """The layout for ``world_size`` processes; ``dp_replicate`` 0 takes the devices the others leave. Raises a
        ValueError naming the values when their product is not the world size."""
        for name, value in (("tp", tp), ("dp_shard", dp_shard), ("cp", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        cp_text = f" × cp={cp}" if cp > 1 else ""
        if dp_replicate == 0:
            if world_size % (tp * dp_shard * cp):
                raise ValueError(f"tp={tp} × dp_shard={dp_shard}{cp_text} = {tp * dp_shard * cp} does not divide the "
                                 f"world size {world_size}")
            dp_replicate = world_size // (tp * dp_shard * cp)
        dims = cls(dp_replicate, dp_shard, tp, cp)
        if dims.world_size != world_size:
            raise ValueError(f"dp_replicate={dp_replicate} × dp_shard={dp_shard}{cp_text} × tp={tp} = "
                             f"{dims.world_size} devices, but the world size is {world_size}")
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: model replicas, each reading its own batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Whether data parallelism runs through FSDP (any data parallelism beside tensor parallelism, or ZeRO)."""
        return self.dp_shard > 1 or (self.dp_replicate > 1 and self.tp > 1)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_replicate, dp_shard, cp, tp) index of a global rank."""
        return (rank // (self.dp_shard * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.dp_shard,
                (rank // self.tp) % self.cp, rank % self.tp)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of a global rank: which share of the batches it reads."""
        return rank // (self.cp * self.tp)

    def cp_rank(self, rank: int) -> int:
        """Which shard of each sequence a global rank holds."""
        return (rank // self.tp) % self.cp

    def __str__(self) -> str:
        cp = f" × cp={self.cp}" if self.cp > 1 else ""
        return f"dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard}{cp} × tp={self.tp}"


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The 4-D mesh (``MESH_DIMS``) over the default process group, which must span ``dims.world_size`` ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dims.world_size:
        raise ValueError(f"the layout {dims} needs {dims.world_size} processes, the process group has {world}")
    return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                            mesh_dim_names=MESH_DIMS)


__all__ = ["MESH_DIMS", "ParallelDims", "build_mesh"]
