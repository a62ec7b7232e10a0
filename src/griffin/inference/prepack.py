"""The weight matmuls of a decode step on CPU, with weights laid out once for oneDNN (Section 5).

A decode step multiplies a few rows (the batch) by every weight matrix of the model, so on CPU most of its time is
spent in small matmuls whose cost is dominated by re-reading and re-blocking the weights. :class:`PrepackedLinear`
re-lays each matrix out once in oneDNN's blocked format (what ``torch.compile``'s weight freezing does), then
runs ``x W^T + b`` from it: at the benchmark size (D = 256, batch 16, 2 cores) all the matmuls of a Griffin step
take 2.8 ms instead of 5.4 ms with ``F.linear``. Results differ from ``F.linear`` by rounding only (float32: a
few 1e-6; bfloat16: identical in our measurements). Under ``torch.compile`` the matmuls go through the opaque
operator ``griffin::prepacked_linear``, so that a compiled decode step fuses the elementwise work and keeps these
matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

LinearFn = Callable[..., Tensor]  # (x, weight, bias=None) -> x weight^T + bias, like F.linear


def can_prepack(weight: Tensor) -> bool:
    """Whether :class:`PrepackedLinear` can hold ``weight``: a float32/bfloat16 CPU matrix, PyTorch with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# An opaque operator for ``torch.compile`` (inductor cannot lower oneDNN's packed matmul with a weight that is an
# input, so it calls this as it is). Defined with ``torch.library.Library`` rather than ``custom_op``, whose
# per-call output checks, on the 39 matmuls of a step, made the compiled decode step 13-23% slower
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


class PrepackedLinear:
    """``F.linear`` for the given weight matrices, re-laid out for oneDNN for ``batch_size`` rows; other weights
    (or any weight, if oneDNN is unavailable) go through ``F.linear``. The copies are made here, once (as much
    memory as the weights): later changes to the weights are not seen, so make one per generation (as
    :class:`griffin.inference.generate.Decoder` does).
    """

    def __init__(self, weights: Iterable[Tensor], batch_size: int) -> None:
        self.packed: dict[int, tuple[Tensor, Tensor]] = {}
        for w in weights:
            if can_prepack(w) and id(w) not in self.packed:  # (original, packed): the original keeps the id valid
                self.packed[id(w)] = (w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size))

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        entry = self.packed.get(id(weight))
        if entry is None or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return torch.ops.griffin.prepacked_linear.default(x, entry[1], bias)
        return prepacked_linear(x, entry[1], bias)
