"""One call that lays a model over a ``dp_replicate × dp_shard × cp × tp`` mesh (Section 4.1), in torchtitan's order:
context parallelism, tensor parallelism, activation checkpointing, ``torch.compile`` per block, then FSDP (over
``dp_shard × cp``: the cp ranks of a replica hold the same weights and reduce their gradients like data-parallel
ranks); and the helpers a training
loop needs on such a model (gradient norm over DTensors, the whole model gathered back)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from griffin.config import ModelConfig
from griffin.model import CausalLM
from griffin.parallel.context_parallel import apply_context_parallel, check_context_parallel
from griffin.parallel.fsdp import apply_activation_checkpointing, apply_compile, apply_fsdp
from griffin.parallel.mesh import ParallelDims
from griffin.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel


@dataclass(frozen=True)
class ParallelOptions:
    """What to apply besides the layout: sequence parallelism (needs tp > 1), activation checkpointing per block,
    ``torch.compile`` per block, FSDP mixed precision (``param_dtype``, e.g. bfloat16: compute in it, reduce
    gradients in float32), and FSDP's CPU offload of the sharded state."""

    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    param_dtype: torch.dtype | None = None
    cpu_offload: bool = False


def dp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh | None:
    """The mesh FSDP shards over: ``dp_shard`` (ZeRO-3), ``dp_replicate × dp_shard`` (HSDP, or plain replication
    when dp_shard is 1), or None without data parallelism. With cp > 1, ``dp_shard × cp`` flattened into one dim
    (``dp_shard_cp``) takes the place of ``dp_shard``: the cp ranks' gradients are partial sums, reduced with the
    data-parallel ones."""
    if dims.dp * dims.cp == 1:
        return None
    if dims.cp == 1:
        return mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if dims.dp_replicate == 1:
        return flat
    with warnings.catch_warnings():  # (PyTorch's notice that slicing a flattened dim will change; it is the way now)
        warnings.simplefilter("ignore", UserWarning)
        return mesh["dp_replicate", "dp_shard_cp"]


def parallelize(model: CausalLM, mesh: DeviceMesh, dims: ParallelDims,
                options: ParallelOptions = ParallelOptions()) -> CausalLM:
    """Apply the layout to ``model`` in place (every rank built it with the same weights, or on the meta device) and
    return it. Refuses, with the values named, a tp that cannot split the model and options it cannot combine."""
    check_tensor_parallel(model.config, dims.tp)
    check_context_parallel(model.config, dims.cp)
    if options.sequence_parallel and dims.tp == 1:
        raise ValueError("sequence parallelism splits the sequence over the tp devices: it needs tp > 1")
    if options.compile and dims.cp > 1:
        raise ValueError(f"compiled blocks (compile=True) with context parallelism (cp={dims.cp}) are not supported: "
                         "the carry, halo and key/value exchanges are not traced; drop --compile")
    if options.sequence_parallel and dims.cp > 1:
        raise ValueError(f"sequence parallelism (over tp={dims.tp}) with context parallelism (cp={dims.cp}) is not "
                         "supported: cp already splits the sequence; drop --sequence-parallel")
    if options.cpu_offload and dims.dp * dims.cp == 1:
        raise ValueError("cpu_offload moves FSDP's sharded state to the CPU: it needs data parallelism (dp > 1)")
    if options.cpu_offload and mesh.device_type == "cpu":
        raise ValueError("cpu_offload moves FSDP's sharded state from GPU memory to the CPU; this model already "
                         "trains on the CPU")
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"].get_group())
    apply_tensor_parallel(model, mesh["tp"], options.sequence_parallel)
    if options.activation_checkpointing:
        apply_activation_checkpointing(model)
    if options.compile:
        apply_compile(model)
    shard_mesh = dp_mesh(mesh, dims)
    if shard_mesh is not None:
        apply_fsdp(model, shard_mesh, options.param_dtype, cpu_offload=options.cpu_offload)
    return model


def build_model(config: ModelConfig, mesh: DeviceMesh, dims: ParallelDims, device: torch.device,
                options: ParallelOptions = ParallelOptions(), seed: int = 0) -> CausalLM:
    """A parallelized ``CausalLM(config)``. On the CPU every rank initialises the whole model from ``seed`` and keeps
    its shards, so the weights are those of one process (what the tests compare). On GPUs the model is built on the
    meta device and each rank initialises only its shards (a 7B model never exists whole on one device); the
    weights follow the same distributions, drawn through DTensor's RNG, not one process's."""
    torch.manual_seed(seed)
    if device.type == "cpu":
        return parallelize(CausalLM(config), mesh, dims, options)
    with torch.device("meta"):
        model = CausalLM(config)
    parallelize(model, mesh, dims, options)
    model.to_empty(device=device)
    with torch.no_grad():
        init_weights(model)
    return model


def init_weights(model: nn.Module) -> None:
    """Run every module's ``reset_parameters``, children before parents (a block's own initialisation overrides
    the defaults of the ``nn.Linear`` s inside it)."""
    for module in reversed(list(model.modules())):
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def grad_norm(parameters: Iterable[Tensor]) -> Tensor:
    """The L2 norm of the whole gradient of a model laid out over the process group (DTensor or plain gradients),
    each element counted once: every rank adds the squares of its shards, divided by the number of ranks holding
    the same shard, and one all-reduce sums them. The same value on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        copies = world
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            copies = world // mesh.size()
            for dim, placement in enumerate(g.placements):
                if placement.is_replicate():
                    copies *= mesh.size(dim)
                elif placement.is_partial():
                    raise RuntimeError("a gradient is still a partial sum; reduce it before taking its norm")
            g = g.to_local()
        total += g.detach().double().square().sum() / copies
    if world > 1:
        on_gpu = dist.get_backend() == "nccl"  # NCCL reduces GPU tensors only (gradients may be offloaded to the CPU)
        reduced = total.to(torch.device("cuda", torch.cuda.current_device())) if on_gpu else total
        dist.all_reduce(reduced)
        total = reduced.to(total.device)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a laid-out model: scale the gradients so that their whole norm
    (:func:`grad_norm`) is at most ``max_norm``; returns the norm before clipping (float64, on every rank)."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params)
    norm = float(total)
    scale = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_ does
    if math.isfinite(norm) and scale < 1.0:
        with torch.no_grad():
            for p in params:
                p.grad.mul_(scale)
    return total


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights as plain CPU tensors on rank 0 (an empty dict on the other ranks); a collective,
    every rank must call it."""
    # DTensor warns, for every 2-D (dp_shard x tp) parameter, that it gathers one mesh dimension after the other
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    finally:
        quiet.setLevel(level)


def full_model(model: CausalLM) -> CausalLM | None:
    """A plain single-device copy of a parallelized model on the CPU, in its parameters' dtype, on rank 0 (None on
    the other ranks); a collective."""
    state = full_state_dict(model)
    if not state:
        return None
    plain = CausalLM(model.config).to(state["embed.weight"].dtype)
    plain.load_state_dict(state)
    return plain


__all__ = ["ParallelOptions", "build_model", "clip_grad_norm_", "dp_mesh", "full_model", "full_state_dict",
           "grad_norm", "init_weights", "parallelize"]
