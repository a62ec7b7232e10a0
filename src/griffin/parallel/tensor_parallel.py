"""Megatron tensor parallelism for MQA, Hawk and Griffin (Section 4.1), applied from outside the model with
``parallelize_module`` (DTensor).

Per residual block, over the ``tp`` devices of a model replica:

- gated MLP: the two D -> M·D branches split by columns, the M·D -> D layer by rows (one all-reduce forward, one
  backward);
- recurrent block: the two D -> D_RNN branches by columns, the output layer by rows; the Conv1D and the RG-LRU
  (its decay Λ, and its block-diagonal gates split by block) run on each device's own D_RNN / tp channels as plain
  tensors, with no communication, so the fused CPU and Triton kernels run unchanged;
- attention: the query heads by columns, the output by rows; a single key/value head (MQA) cannot be split, so its
  projections are replicated: each device computes the keys and values, and since only its own query heads use
  them, each device's weight gradient is a partial sum that is all-reduced over tp in the backward pass (without
  it, each device would update the shared head with its own heads' share only); several key/value heads are split
  with the query heads when tp divides them;
- embedding and tied output layer: split by vocabulary rows, with the vocabulary-parallel loss of
  :mod:`griffin.parallel.loss` (whole or chunked), so no device holds a (tokens, vocab) logit matrix;
- optional sequence parallelism: the norms and the residual stream split along time between the blocks
  (all-gather before a block, reduce-scatter after, instead of the all-reduce).

Every parameter becomes a DTensor on the tp mesh (sharded, or replicated), so that FSDP, the optimizer, gradient
clipping and torch.distributed.checkpoint see one consistent model. Counts tp cannot split are refused up front.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from griffin.config import ModelConfig
from griffin.model import CausalLM
from griffin.parallel.loss import VocabParallelLoss, sum_grad


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming every count of ``config`` that ``tp`` devices cannot split."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if tp == 1:
        return
    problems = []
    recurrent = "recurrent" in config.block_types
    attention = any(kind != "recurrent" for kind in config.block_types)
    counts = [("vocab_size", config.vocab_size), ("mlp_width", config.mlp_width)]
    if recurrent:
        counts += [("rnn_width (D_RNN)", config.rnn_width), ("gate_blocks", config.gate_blocks)]
    if attention:
        counts.append(("num_heads", config.num_heads))
    problems += [f"{name}={value}" for name, value in counts if value % tp]
    if attention and config.num_kv_heads > 1 and config.num_kv_heads % tp:
        problems.append(f"num_kv_heads={config.num_kv_heads} (neither 1, which is replicated, nor a multiple of tp)")
    if recurrent and config.complex_lru:
        problems.append("complex_lru=True (the CG-LRU pairs channel i with channel i + D_RNN/2, which a contiguous "
                        "split separates)")
    if problems:
        raise ValueError(f"tensor parallelism over tp={tp} devices cannot split " + ", ".join(problems))


# Parallel styles ---------------------------------------------------------------------------------------------------
class LocalShard(ParallelStyle):
    """Parameters split along the given dims (``None``: replicated), and the module's forward run on plain local
    tensors: during the forward each parameter reads as this device's shard (``DTensor.to_local``), so the module
    computes on the channels it holds with no communication, and gradients land on the shard.

    ``sum_grads``: the module's computation sees only part of what its (replicated) parameters act on (the
    key/value projections seen by a share of the query heads; a norm under sequence parallelism), so their
    gradients are summed over the tp devices in the backward pass; its DTensor inputs' gradients are partial too.
    """

    def __init__(self, dims: dict[str, int | None], sum_grads: bool = False) -> None:
        super().__init__()
        self.dims = dict(dims)
        self.sum_grads = sum_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = sorted(set(self.dims) - set(module._parameters))
        if missing:
            raise ValueError(f"{type(module).__name__} has no parameters {missing}")
        for name, dim in self.dims.items():  # this module's own parameters only (its children have their styles)
            param = module._parameters[name]
            placement = Replicate() if dim is None else Shard(dim)
            dist = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(functools.partial(_use_local, tuple(self.dims), self.sum_grads))
        module.register_forward_hook(functools.partial(_drop_local, tuple(self.dims)), always_call=True)
        return module


def _use_local(names: tuple[str, ...], sum_grads: bool, module: nn.Module, args: tuple) -> tuple:
    for name in names:
        param = module._parameters[name]  # FSDP's unsharded parameter during its forward, if wrapped
        local = param.to_local() if isinstance(param, DTensor) else param
        if sum_grads and isinstance(param, DTensor):
            local = sum_grad(local, param.device_mesh)
        module.__dict__[name] = local  # shadows the parameter for attribute reads until the forward ends
    if sum_grads:
        args = tuple(a.to_local(grad_placements=[Partial()]) if isinstance(a, DTensor) else a for a in args)
    return args


def _drop_local(names: tuple[str, ...], module: nn.Module, args: tuple, output: object) -> None:
    for name in names:
        module.__dict__.pop(name, None)


class VocabParallelOutput(ParallelStyle):
    """The tied output layer (the embedding's vocabulary-split matrix, no parameter of its own): logits computed
    for this device's vocabulary rows, then gathered (for generation and evaluation without targets; the training
    loss never gathers them)."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.input_layout = Shard(1) if sequence_parallel else Replicate()

    def _input(self, module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        x = DTensor.from_local(args[0], mesh, [self.input_layout], run_check=False)
        return (x.redistribute(placements=[Replicate()]), *args[1:])

    @staticmethod
    def _output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
        return output.redistribute(placements=[Replicate()]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._input, self._output)


# The plan ----------------------------------------------------------------------------------------------------------
def tensor_parallel_plan(config: ModelConfig, tp: int, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of ``CausalLM(config)`` over ``tp`` devices (module name -> style)."""
    check_tensor_parallel(config, tp)
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    block_in = dict(input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None),
                    use_local_output=False)
    norm = LocalShard({"scale": None}, sum_grads=sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "final_norm": norm,
    }
    if config.tie_embeddings:
        plan["lm_head"] = VocabParallelOutput(sequence_parallel)
    else:
        plan["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    split_kv = config.num_kv_heads % tp == 0
    for i, kind in enumerate(config.block_types):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.temporal_pre_norm": norm,
            f"{b}.channel_pre_norm": norm,
            f"{b}.mlp_block": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                                 use_local_output=False),
            f"{b}.mlp_block.gate_proj": ColwiseParallel(),
            f"{b}.mlp_block.up_proj": ColwiseParallel(),
            f"{b}.mlp_block.down_proj": RowwiseParallel(output_layouts=stream),
            f"{b}.temporal_block": PrepareModuleInput(**block_in),
        })
        t = f"{b}.temporal_block"
        if kind == "recurrent":
            plan.update({
                f"{t}.linear_y": ColwiseParallel(),
                f"{t}.linear_x": ColwiseParallel(),
                f"{t}.conv_1d": LocalShard({"w": 1, "b": 0}),
                f"{t}.rg_lru": LocalShard({"a_param": 0}),
                f"{t}.rg_lru.input_gate": LocalShard({"w": 0, "b": 0}),
                f"{t}.rg_lru.a_gate": LocalShard({"w": 0, "b": 0}),
                f"{t}.linear_out": RowwiseParallel(output_layouts=stream),
            })
        else:
            kv = ColwiseParallel() if split_kv else LocalShard({"weight": None}, sum_grads=True)
            plan.update({
                f"{t}.proj_q": ColwiseParallel(),
                f"{t}.proj_k": kv,
                f"{t}.proj_v": kv,
                f"{t}.proj_final": RowwiseParallel(output_layouts=stream),
            })
    return plan


def parameter_shard_dims(config: ModelConfig, tp: int, sequence_parallel: bool = False,
                         model: CausalLM | None = None) -> dict[str, int | None]:
    """Each parameter's tensor-parallel split under :func:`tensor_parallel_plan`: the dimension split over the tp
    devices, or None where every device holds it whole (what the planner counts; no device needed). ``model``: the
    config's model if already built (on the meta device, say)."""
    plan = tensor_parallel_plan(config, tp, sequence_parallel) if tp > 1 else {}
    if model is None:
        with torch.device("meta"):
            model = CausalLM(config)
    dims: dict[str, int | None] = {}
    for module_name, module in model.named_modules():
        style = plan.get(module_name)
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            dim: int | None = None
            if isinstance(style, ColwiseParallel):
                dim = 0
            elif isinstance(style, RowwiseParallel):
                dim = 0 if isinstance(module, nn.Embedding) else (1 if param_name == "weight" else None)
            elif isinstance(style, LocalShard):
                dim = style.dims[param_name]
            dims[name] = dim if param.dim() else None
    return dims


def _refuse_inference(tp: int, sequence_parallel: bool, module: nn.Module, args: tuple, kwargs: dict) -> None:
    input_ids = args[0] if args else kwargs.get("input_ids")
    cache = args[2] if len(args) > 2 else kwargs.get("cache")
    if cache is not None:
        raise ValueError("a tensor-parallel model trains and evaluates; for generation with a cache, gather it into "
                         "one model (griffin.parallel.full_model)")
    if sequence_parallel:
        T = input_ids.shape[1]
        if T % tp:
            raise ValueError(f"sequence parallelism splits the T={T} tokens of each sequence over tp={tp} devices; "
                             "T must be a multiple of tp")
        keep = args[3] if len(args) > 3 else kwargs.get("logits_to_keep")
        if keep is not None:
            raise ValueError("logits_to_keep is not supported with sequence parallelism")


def apply_tensor_parallel(model: CausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> CausalLM:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (every rank must hold the same weights, as after seeding
    the same initialisation) and swap its loss for the vocabulary-parallel one; returns it."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"apply_tensor_parallel expects a griffin CausalLM, got {type(model).__name__}")
    tp = tp_mesh.size()
    if tp == 1:
        return model
    plan = tensor_parallel_plan(model.config, tp, sequence_parallel)
    parallelize_module(model, tp_mesh, plan)
    missed = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if missed:  # a parameter the plan does not place would silently diverge between the tp ranks
        raise RuntimeError(f"the tensor-parallel plan does not cover the parameters {missed}")
    model.loss = VocabParallelLoss(model.config.logits_soft_cap, tp_mesh, sequence_parallel)
    model.register_forward_pre_hook(functools.partial(_refuse_inference, tp, sequence_parallel), with_kwargs=True)
    return model


__all__ = ["LocalShard", "VocabParallelOutput", "apply_tensor_parallel", "check_tensor_parallel",
           "parameter_shard_dims", "tensor_parallel_plan"]
