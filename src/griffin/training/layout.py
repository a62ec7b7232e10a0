"""``griffin train --tp N --dp-shard N --dp-replicate N --cp N``: the trainer's side of :mod:`griffin.parallel`
(Section 4.1).

With tp = dp_shard = cp = 1 nothing here is used: one process trains as it always did, and under torchrun the run is
data parallel with DistributedDataParallel (``griffin.training.distributed``). Otherwise the processes form a
``dp_replicate × dp_shard × cp × tp`` mesh: the model is split by tensor parallelism over tp, each sequence into cp
contiguous shards (:mod:`griffin.parallel.context_parallel`), and sharded by FSDP over dp_shard × cp (replicated over
dp_replicate), each data-parallel rank reads its own batches (``--batch-size`` stays per data-parallel rank),
checkpoints are sharded (every rank writes its part) and load back on any layout, and the sample at the end is drawn
from the model gathered on rank 0."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from griffin.config import ModelConfig
from griffin.interop import CheckpointError
from griffin.model import CausalLM
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.parallel import (
    ParallelDims,
    ParallelOptions,
    build_mesh,
    build_model,
    check_context_parallel,
    check_tensor_parallel,
    clip_grad_norm_,
    full_model,
    is_sharded,
    load_sharded,
    save_sharded,
)
from griffin.training.checkpoint import verify_checkpoint
from griffin.training.config import TrainConfig


def wants_layout(cfg: TrainConfig) -> bool:
    """Whether the run needs the device mesh (tensor parallelism or sharded data parallelism) rather than plain
    data parallelism."""
    return cfg.tp > 1 or cfg.dp_shard > 1 or cfg.cp > 1


@dataclass
class Layout:
    """The mesh and options of a run laid out over ``dims``."""

    dims: ParallelDims
    mesh: DeviceMesh
    options: ParallelOptions
    rank: int

    @classmethod
    def create(cls, cfg: TrainConfig, rank: int, world_size: int, device: torch.device,
               autocast: torch.dtype | None, model_config: ModelConfig) -> Layout:
        """The layout ``cfg`` asks for on ``world_size`` processes; a ValueError names any value that cannot run
        (the product of the sizes, a tp that does not divide the model's heads, widths, gate blocks or vocabulary,
        a sequence length sequence parallelism cannot split)."""
        dims = ParallelDims.resolve(world_size, cfg.tp, cfg.dp_shard, cfg.dp_replicate, cfg.cp)
        check_tensor_parallel(model_config, dims.tp)
        check_context_parallel(model_config, dims.cp, cfg.seq_len)
        if cfg.sequence_parallel and cfg.seq_len % dims.tp:
            raise ValueError(f"sequence parallelism splits seq_len={cfg.seq_len} over tp={dims.tp} devices: it must "
                             "be a multiple of tp")
        fsdp = dims.dp * dims.cp > 1
        options = ParallelOptions(sequence_parallel=cfg.sequence_parallel,
                                  activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                                  param_dtype=autocast if fsdp else None, cpu_offload=cfg.cpu_offload)
        return cls(dims, build_mesh(dims, device.type), options, rank)

    @property
    def autocast(self) -> bool:
        """Whether the trainer keeps autocasting: FSDP's mixed precision replaces it (bf16 compute, fp32 reduce)."""
        return self.options.param_dtype is None

    def build_model(self, config: ModelConfig, device: torch.device, seed: int) -> CausalLM:
        model = build_model(config, self.mesh, self.dims, device, self.options, seed)
        model.train()
        return model

    def describe(self, batch_size: int) -> str:
        extras = [name for name, on in (("sequence parallel", self.options.sequence_parallel),
                                        ("activation checkpointing", self.options.activation_checkpointing),
                                        ("compiled blocks", self.options.compile),
                                        ("bf16 compute / fp32 reduction", self.options.param_dtype is not None),
                                        ("CPU offload", self.options.cpu_offload)) if on]
        return (f"layout {self.dims} over {self.dims.world_size} processes: {self.dims.dp} data-parallel ranks of "
                f"{batch_size} sequences"
                + (f", each split into {self.dims.cp} shards of the sequence" if self.dims.cp > 1 else "")
                + (f"; {', '.join(extras)}" if extras else ""))

    def clip(self, model: CausalLM, max_norm: float) -> Tensor:
        return clip_grad_norm_(model.parameters(), max_norm)

    def save(self, path: Path, model: CausalLM, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             extra_files: dict[str, Path]) -> Path:
        layout = {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard, "tp": self.dims.tp,
                  "cp": self.dims.cp}
        return save_sharded(path, model, optimizer, state, layout, extra_files)

    def gather(self, model: CausalLM) -> CausalLM | None:
        """The whole model on rank 0, for the sample (a collective; None on the other ranks)."""
        return full_model(model)


Loader = Callable[[Path, CausalLM, torch.optim.Optimizer], dict[str, Any]]


def load_any(path: Path, model: CausalLM, optimizer: torch.optim.Optimizer, layout: Layout | None,
             load_single: Loader, make_optimizer: Callable[[CausalLM], torch.optim.Optimizer]) -> dict[str, Any]:
    """Load a checkpoint of either kind into the run's model and optimizer, whatever layout wrote it: a sharded
    one (any layout, or one process), or griffin's single-file one (``load_single``: into one process as it is;
    spread over the layout's ranks by way of a plain copy built with ``make_optimizer``)."""
    path = Path(path)
    if is_sharded(path):
        verify_checkpoint(path)
        return load_sharded(path, model, optimizer)
    if layout is None:
        return load_single(path, model, optimizer)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # every rank reads the whole checkpoint into a plain copy, then keeps its shards (matched by parameter name)
    plain = CausalLM(model.config)
    plain_opt = make_optimizer(plain)
    state = load_single(path, plain, plain_opt)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, plain.state_dict(), options=full)
    set_optimizer_state_dict(model, optimizer, get_optimizer_state_dict(plain, plain_opt, options=full), options=full)
    return state


def even_share(batches: list, rank: int, world: int) -> list:
    """This data-parallel rank's share of the evaluation batches, padded to the same count on every rank with
    batches whose targets are all ignored (they add nothing to the loss): under FSDP and tensor parallelism every
    rank must run the same forward passes, since their collectives pair up."""
    mine = list(batches[rank::world])
    first = batches[0]
    while len(mine) < -(-len(batches) // world):
        mine.append(type(first)(first.input_ids, first.positions, torch.full_like(first.targets, IGNORE_INDEX)))
    return mine


def translate_loader_state(state: dict[str, Any], batch_size: int, world_size: int,
                           windows_per_rank: int) -> dict[str, Any]:
    """The loader state of a run with the same global batch on ``world_size`` data-parallel ranks of
    ``batch_size`` (each with ``windows_per_rank`` windows per epoch): the windows the saved ranks had consumed in
    the epoch, shared out again. Exact within an epoch (the ranks' shares of an epoch differ in size when the world
    size does not divide its windows)."""
    old_batch, old_world = state["batch_size"], state["world_size"]
    if (old_batch, old_world) == (batch_size, world_size):
        return state
    if old_batch * old_world != batch_size * world_size:
        raise CheckpointError(f"cannot resume: the checkpoint read {old_batch} sequences × {old_world} data-parallel "
                              f"ranks = {old_batch * old_world} per step, this run reads {batch_size} × {world_size} "
                              f"= {batch_size * world_size}")
    consumed = state["index"] * old_world
    if consumed % world_size:
        warnings.warn(f"the checkpoint's data position ({consumed} windows into epoch {state['epoch']}) does not "
                      f"split over {world_size} ranks; resuming {consumed % world_size} windows earlier",
                      stacklevel=2)
    epoch, index = state["epoch"], consumed // world_size
    if index >= windows_per_rank:
        epoch, index = epoch + 1, 0
    return {**state, "batch_size": batch_size, "world_size": world_size, "epoch": epoch, "index": index}


__all__ = ["Layout", "even_share", "load_any", "translate_loader_state", "wants_layout"]
