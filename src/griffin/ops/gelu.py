"""GeLU (Section 2.2's gated MLP and the recurrent block's GeLU branch), with a form the CPU compiler computes fast.

The released models use the tanh approximation, gelu(x) = 0.5 x (1 + tanh z) with z = sqrt(2/pi) (x + 0.044715 x^3).
Since 0.5 (1 + tanh z) = sigmoid(2 z), the same function is x sigmoid(2 z) (:func:`gelu_tanh_by_sigmoid`).
Inductor's CPU code computes tanh by a slow vector routine and sigmoid by one exp, so under ``torch.compile`` on a
CPU :func:`gelu` takes that form, forward and backward; eager calls, the exact (erf) GeLU and other devices keep
:func:`torch.nn.functional.gelu`, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


def gelu_tanh_by_sigmoid(x: Tensor) -> Tensor:
    """The tanh-approximated GeLU as x sigmoid(2 z), computed in float32 (or wider) and returned in x's dtype."""
    acc = x.to(torch.promote_types(x.dtype, torch.float32))
    z = SQRT_2_OVER_PI * (acc + GELU_CUBIC * acc * acc * acc)
    return (acc * torch.sigmoid(2.0 * z)).to(x.dtype)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(x, approximate=approximate)``; the tanh approximation by :func:`gelu_tanh_by_sigmoid` where a CPU
    step is being compiled."""
    if approximate == "tanh" and x.device.type == "cpu" and torch.compiler.is_compiling():
        return gelu_tanh_by_sigmoid(x)
    return F.gelu(x, approximate=approximate)


__all__ = ["gelu", "gelu_tanh_by_sigmoid"]
