"""Weight-only int8 for a whole model (Section 5: a decode step reads every weight once, so its time is about the
weights' bytes over the memory bandwidth; int8 halves bfloat16's bytes), as module swaps from outside the model.

:func:`quantize_int8` replaces every ``nn.Linear`` (the MLP's, the recurrent block's, attention's projections),
the embedding and the output layer (tied to it or not) by their int8 versions (:mod:`griffin.layers.quantized`).
What stays in the model's dtype: the RG-LRU (its decay Λ and block-diagonal gates, which set the recurrence's time
scales: docs/performance.md measures quantising them too), the Conv1D, the norms and every bias. A quantised model
is still a :class:`griffin.model.CausalLM`: its forward pass dequantises (the reference), and
:class:`griffin.inference.Decoder` decodes with the CPU kernel that reads the int8 weights directly. Its state dict
is the float model's names (int8 ``weight`` tensors) plus a float32 ``.weight_scale`` per quantised matrix, which is
how a checkpoint says it is quantised (:func:`quantization_of_state`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from griffin.layers import BlockDiagonalLinear
from griffin.layers.quantized import Int8Embedding, Int8Linear, Int8TiedOutput
from griffin.model import CausalLM, TiedOutput
from griffin.ops.matvec import check_group_size
from griffin.ops.matvec import quantize_int8 as quantize_matrix

METHODS = ("int8",)
SCALE_SUFFIX = ".weight_scale"


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


def _check(model: CausalLM, group_size: int, gates: bool) -> None:
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
            elif gates and isinstance(child, BlockDiagonalLinear):
                check_group_size(group_size, child.w.shape[1], full)


def quantize_int8(model: CausalLM, group_size: int = 0, inplace: bool = False, gates: bool = False) -> CausalLM:
    """The model with int8 weights (see the module docstring): a copy that shares the parameters kept in float
    (``inplace=True``: ``model`` itself, whose float weights are then freed). ``group_size``: 0 for one scale per
    output channel, or a multiple of 8 dividing every quantised layer's input width (one scale per group of
    inputs). ``gates=True`` also rounds the RG-LRU's block-diagonal gate weights to int8 values (kept in the model's
    dtype, for measuring what that costs). The model must be a float model on the CPU."""
    _check(model, group_size, gates)
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
                    rounded = []
                    for w in child.w:  # (blocks, in, out): each block's (out, in) matrix rounded
                        q, s = quantize_matrix(w.T, group_size)
                        rounded.append((q.float() * s.repeat_interleave(q.shape[1] // s.shape[1], 1)).T)
                    child.w = nn.Parameter(torch.stack(rounded).to(child.w.dtype), requires_grad=False)
    return model.eval()


def int8_structure_(model: CausalLM, group_size: int) -> CausalLM:
    """Replace ``model``'s layers (on the meta device) by empty int8 ones, to load a quantised state dict into."""
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
    return model


def float32_scales_(model: nn.Module) -> None:
    """Keep int8 layers' scales in float32 after ``model.to(dtype)`` (which casts every floating buffer)."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            module.weight_scale = module.weight_scale.float()


__all__ = ["METHODS", "SCALE_SUFFIX", "float32_scales_", "int8_structure_", "quantization_of",
           "quantization_of_state", "quantize_int8"]
