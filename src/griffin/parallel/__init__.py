"""Scale-out training (Section 4.1): Megatron tensor parallelism, ZeRO-3 (FSDP2) over a ``dp_replicate × dp_shard ×
cp × tp`` device mesh, context parallelism over sequence shards, sharded checkpoints that load on any layout, and the
cluster planner; all on PyTorch's own distributed engine (DTensor, ``fully_shard``, ``torch.distributed.checkpoint``),
applied from outside the model."""

from griffin.parallel.checkpoint import is_sharded, load_sharded, load_sharded_model, save_sharded
from griffin.parallel.context_parallel import apply_context_parallel, check_context_parallel, shard_sequence
from griffin.parallel.mesh import MESH_DIMS, ParallelDims, build_mesh
from griffin.parallel.parallelize import (
    ParallelOptions,
    build_model,
    clip_grad_norm_,
    full_model,
    full_state_dict,
    parallelize,
)
from griffin.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

__all__ = ["MESH_DIMS", "ParallelDims", "ParallelOptions", "apply_context_parallel", "apply_tensor_parallel",
           "build_mesh", "build_model", "check_context_parallel", "check_tensor_parallel", "clip_grad_norm_",
           "full_model", "full_state_dict", "is_sharded", "load_sharded", "load_sharded_model", "parallelize",
           "save_sharded", "shard_sequence"]
