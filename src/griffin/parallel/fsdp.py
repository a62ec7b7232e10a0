"""ZeRO-3 data parallelism with FSDP2 (``fully_shard``), per residual block and at the root (Section 4.1: "ZeRO
parallelism, distributing both optimizer states and model parameters across the batch shards"), and the two
per-block options that go under it: activation checkpointing and ``torch.compile``.

Each residual block is one FSDP unit: its parameters (already DTensors on the tp mesh under tensor parallelism,
which makes them 2-D) are split over the ``dp_shard`` devices and all-gathered just before the block runs (the
next block's gather overlaps this one's compute), then freed again; gradients are reduce-scattered, so each
device keeps 1/dp_shard of the parameters, gradients and AdamW states. Over a 2-D ``dp_replicate × dp_shard``
mesh the shards are also replicated, with an all-reduce of the sharded gradients (HSDP). The mixed-precision
policy computes in bfloat16 and reduces gradients in float32 (the paper trains in bfloat16), over float32 master
weights.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from griffin.model import CausalLM


def apply_activation_checkpointing(model: CausalLM, preserve_rng_state: bool = False) -> CausalLM:
    """Recompute each residual block in the backward pass instead of keeping its activations: only the blocks'
    inputs stay in memory, for one more forward pass of compute. Parameter names are unchanged in state dicts.
    ``preserve_rng_state``: replay the forward pass's random numbers (LoRA's dropout draws some)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             preserve_rng_state=preserve_rng_state)
    return model


def apply_compile(model: CausalLM) -> CausalLM:
    """``torch.compile`` each residual block (the blocks are alike, so one compilation serves them all); the
    block boundaries stay where FSDP gathers and frees parameters."""
    for block in model.blocks:
        block.compile()
    return model


def apply_fsdp(model: CausalLM, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, cpu_offload: bool = False) -> CausalLM:
    """``fully_shard`` every residual block, then the root (embedding, final norm), over ``dp_mesh`` (1-D: ZeRO-3;
    2-D ``dp_replicate × dp_shard``: HSDP). ``param_dtype``: the dtype blocks compute in (bfloat16 for mixed
    precision; None: the parameters' own); ``reduce_dtype``: the gradients' reduction dtype (float32 under mixed
    precision). ``cpu_offload``: sharded parameters, gradients and optimizer states live in CPU memory (the
    optimizer step runs on the CPU)."""
    if param_dtype is not None and reduce_dtype is None:
        reduce_dtype = torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # the last block's parameters are needed again at once by the backward pass: keep them gathered
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=i < last)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    return model


__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_fsdp"]
