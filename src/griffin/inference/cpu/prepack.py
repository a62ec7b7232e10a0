"""The weight matmuls of a decode step on CPU, with weights laid out once for oneDNN (Section 5), applied from outside
the model as a module swap.

A decode step multiplies a few rows (the batch) by every weight matrix of the model, so on CPU most of its time is
spent in small matmuls whose cost is dominated by re-reading and re-blocking the weights. :class:`PackedLinear`
re-lays a matrix out once in oneDNN's blocked format (what ``torch.compile``'s weight freezing does), then runs
``x W^T + b`` from it (docs/performance.md, "Inference"). Results differ from ``F.linear`` by rounding only. Under
``torch.compile`` the matmul is the opaque operator ``griffin::prepacked_linear``, so that a compiled decode step
fuses the elementwise work and keeps these matmuls. :func:`prepacked` swaps every linear layer of a copy of the model
for one (as gpt-fast swaps modules for quantisation); the model itself is not touched.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.model import TiedOutput


def can_prepack(weight: Tensor) -> bool:
    """Whether :class:`PackedLinear` can hold ``weight``: a float32 CPU matrix, or a bfloat16 one where oneDNN has a
    bfloat16 path on this CPU (AVX-512 or AVX-NE-CONVERT), PyTorch with oneDNN."""
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# An opaque operator for ``torch.compile`` (inductor cannot lower oneDNN's packed matmul with a weight that is an
# input, so it calls this as it is). Defined with ``torch.library.Library`` rather than ``custom_op``, whose
# per-call output checks, on the dozens of matmuls of a step, made the compiled decode step slower
# (docs/performance.md, "Inference").
_LIB = torch.library.Library("griffin", "FRAGMENT")
_LIB.define("prepacked_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def prepacked_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` from a weight packed by ``torch.ops.mkldnn._reorder_linear_weight`` (shape (out, in))."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_LIB.impl("prepacked_linear", prepacked_linear, "MkldnnCPU")  # the packed weight is a oneDNN tensor


@torch.library.register_fake("griffin::prepacked_linear", lib=_LIB)
def _(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` from a copy of ``weight`` laid out for oneDNN for about ``batch_size`` rows, made
    here (as much memory as the weight); ``weight`` and ``bias`` are the replaced layer's own (shared). Inputs of
    another dtype than the weight go through ``F.linear``."""

    def __init__(self, weight: Tensor, bias: Tensor | None, batch_size: int) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.griffin.prepacked_linear.default(x, self.packed, self.bias)
        return prepacked_linear(x, self.packed, self.bias)


def prepacked(model: nn.Module, batch_size: int) -> nn.Module:
    """A copy of ``model`` that shares its parameters, in which every linear layer (and the tied output layer) whose
    weight oneDNN can hold runs from a :class:`PackedLinear`. The packed weights are made now: later changes to the
    model's weights are not seen (make a new copy after training it)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, TiedOutput)) and can_prepack(child.weight):
                setattr(module, name, PackedLinear(child.weight, getattr(child, "bias", None), batch_size))
    return clone
