"""RMSNorm (Zhang & Sennrich, 2019) as used by every residual block (Section 2.1)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + scale); computed in at least float32, scale initialised at zero."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(width))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.scale)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32  # promote to >= fp32
        xf = x.to(dtype)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.scale.to(dtype))).type_as(x)
