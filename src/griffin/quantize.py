"""Weight-only int8 for a whole model (Section 5: a decode step reads every weight once, so its time is about the
weights' bytes over the memory bandwidth; int8 halves bfloat16's bytes), as module swaps from outside the model.

:func:`quantize_int8` replaces every ``nn.Linear`` (the MLP's, the recurrent block's, attention's projections),
the embedding and the output layer (tied to it or not) by their int8 versions (:mod:`griffin.layers.quantized`).
The RG-LRU's block-diagonal gates become int8 too (:class:`griffin.layers.quantized.Int8BlockDiagonalLinear`, one
scale per block and output column) unless ``gates=False`` (their effect on the held-out loss:
benchmarks/quantize_quality.py, docs/performance.md). What stays in the model's dtype: the RG-LRU's
decay Λ (it sets the recurrence's time scales), the Conv1D, the norms and every bias. A quantised model is still a
:class:`griffin.model.CausalLM`: its forward pass dequantises (the reference), and :class:`griffin.inference.Decoder`
decodes with the CPU kernels that read the int8 weights directly. Its state dict is the float model's names (int8
``weight`` and gate ``w`` tensors) plus a float32 ``.weight_scale`` per quantised matrix (which is how a checkpoint
says it is quantised, :func:`quantization_of_state`) and a ``.w_scale`` per int8 gate (:func:`int8_gates_of_state`;
checkpoints written before the gates were quantised have none, and load with float gates).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from griffin.layers import BlockDiagonalLinear
from griffin.layers.quantized import Int8BlockDiagonalLinear, Int8Embedding, Int8Linear, Int8TiedOutput
from griffin.model import CausalLM, TiedOutput
from griffin.ops.matvec import check_group_size

METHODS = ("int8",)
SCALE_SUFFIX = ".weight_scale"
GATE_SCALE_SUFFIX = ".w_scale"


def quantization_of(model: nn.Module) -> dict[str, Any] | None:
    """``{"method": "int8", "group_size": g}`` for a model with int8 layers, else None."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            return {"method": "int8", "group_size": module.group_size}
    return None


def quantization_of_state(state: Mapping[str, Tensor]) -> dict[str, Any] | None:
    """The quantisation a state dict holds (from its ``.weight_scale`` tensors), or None."""
    for name, scale in state.items():
        if name.endswith(SCALE_SUFFIX):
            weight = state.get(name.removesuffix("_scale"))
            if weight is None or weight.dtype != torch.int8 or scale.dim() != 2:
                raise ValueError(f"{name} is not the scale of an int8 matrix {name.removesuffix('_scale')}")
            groups = scale.shape[1]
            return {"method": "int8", "group_size": 0 if groups == 1 else weight.shape[1] // groups}
    return None


def int8_gates_of_state(state: Mapping[str, Tensor]) -> set[str]:
    """The names of the block-diagonal gates a state dict holds in int8 (those with a ``.w_scale``)."""
    gates = set()
    for name, scale in state.items():
        if name.endswith(GATE_SCALE_SUFFIX):
            gate = name.removesuffix(GATE_SCALE_SUFFIX)
            weight = state.get(f"{gate}.w")
            if weight is None or weight.dtype != torch.int8 or weight.dim() != 3 or scale.shape != (
                    weight.shape[0], weight.shape[2]):
                raise ValueError(f"{name} is not the scale of int8 block-diagonal gates {gate}.w")
            gates.add(gate)
    return gates


def _check(model: CausalLM, group_size: int) -> None:
    if not isinstance(model, CausalLM):
        raise TypeError(f"quantize_int8 takes a griffin CausalLM, got {type(model).__name__}")
    done = quantization_of(model)
    if done is not None:
        raise ValueError(f"the model is already quantised ({done['method']}, group_size={done['group_size']}): "
                         "quantise the float checkpoint instead")
    check_group_size(group_size)
    if model.device.type != "cpu":
        raise ValueError(f"int8 weights have a decode kernel on CPU only; the model is on {model.device}: quantise "
                         "it on the CPU and decode there, or decode this device's model in bfloat16")
    for pname, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{pname}.{name}".lstrip(".")
            if isinstance(child, nn.Linear):
                check_group_size(group_size, child.in_features, full)
            elif isinstance(child, nn.Embedding):
                check_group_size(group_size, child.embedding_dim, full)


def quantize_int8(model: CausalLM, group_size: int = 0, inplace: bool = False, gates: bool = True) -> CausalLM:
    """The model with int8 weights (see the module docstring): a copy that shares the parameters kept in float
    (``inplace=True``: ``model`` itself, whose float weights are then freed). ``group_size``: 0 for one scale per
    output channel, or a multiple of 8 dividing every quantised linear layer's and the embedding's input width (one
    scale per group of inputs; the gates have one per output column either way). ``gates=False`` keeps the RG-LRU's
    block-diagonal gates in the model's dtype. The model must be a float model on the CPU."""
    _check(model, group_size)
    if not inplace:
        memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        model = copy.deepcopy(model, memo)
    embed = model.embed
    q_embed = Int8Embedding.from_float(embed, group_size, "embed")
    with torch.no_grad():
        for pname, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                full = f"{pname}.{name}".lstrip(".")
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear.from_float(child, group_size, full))
                elif child is embed:
                    setattr(parent, name, q_embed)
                elif isinstance(child, TiedOutput):
                    setattr(parent, name, Int8TiedOutput(q_embed))
                elif gates and isinstance(child, BlockDiagonalLinear):
                    setattr(parent, name, Int8BlockDiagonalLinear.from_float(child))
    return model.eval()


def int8_structure_(model: CausalLM, group_size: int, gates: Collection[str] = ()) -> CausalLM:
    """Replace ``model``'s layers (on the meta device) by empty int8 ones, to load a quantised state dict into: the
    linear layers, the embedding and the output layer, and the block-diagonal gates named in ``gates``
    (:func:`int8_gates_of_state`)."""
    embed = model.embed
    q_embed = Int8Embedding(embed.num_embeddings, embed.embedding_dim, group_size, device="meta")
    for pname, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{pname}.{name}".lstrip(".")
            if isinstance(child, nn.Linear):
                check_group_size(group_size, child.in_features, full)
                setattr(parent, name, Int8Linear(child.in_features, child.out_features, child.bias is not None,
                                                 group_size, child.weight.dtype, "meta"))
            elif child is embed:
                setattr(parent, name, q_embed)
            elif isinstance(child, TiedOutput):
                setattr(parent, name, Int8TiedOutput(q_embed))
            elif full in gates and isinstance(child, BlockDiagonalLinear):
                H, Din, Dout = child.w.shape
                setattr(parent, name, Int8BlockDiagonalLinear(H, H * Din, H * Dout, child.w.dtype, "meta"))
    missing = set(gates) - {name for name, m in model.named_modules() if isinstance(m, Int8BlockDiagonalLinear)}
    if missing:
        raise ValueError(f"int8 gates {sorted(missing)} are not block-diagonal gates of this model")
    return model


def float32_scales_(model: nn.Module) -> None:
    """Keep int8 layers' scales in float32 after ``model.to(dtype)`` (which casts every floating buffer)."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            module.weight_scale = module.weight_scale.float()
        elif isinstance(module, Int8BlockDiagonalLinear):
            module.w_scale = module.w_scale.float()


__all__ = ["GATE_SCALE_SUFFIX", "METHODS", "SCALE_SUFFIX", "float32_scales_", "int8_gates_of_state", "int8_structure_",
           "quantization_of", "quantization_of_state", "quantize_int8"]
