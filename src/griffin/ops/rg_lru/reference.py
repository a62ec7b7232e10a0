"""The RG-LRU's equations (Section 2.4, Appendix A) in plain PyTorch: the gates, the bounded-gradient square root and
the reference operator that every fused kernel is tested against. See :mod:`griffin.ops.rg_lru` for the operator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from griffin.ops.scan.reference import accumulation_dtype, linear_scan_ref

MAX_SQRT_GRADIENT = 1000.0


class SqrtBoundDerivative(torch.autograd.Function):
    """sqrt(x) whose derivative is clipped at MAX_SQRT_GRADIENT (stable in bfloat16 as a_t -> 1)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad_output / torch.sqrt(torch.clip(4.0 * x, min=1.0 / MAX_SQRT_GRADIENT**2))


def sqrt_bound_derivative(x: Tensor) -> Tensor:
    return SqrtBoundDerivative.apply(x)


def rg_lru_gates(
    x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor, c: float, reset: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The scan coefficients (a_t, b_t) of the RG-LRU, in the accumulation dtype (at least float32, like the fused
    kernels): a_t near 1 rounded to bfloat16 (steps of 2^-8) would change the decay it encodes, and a decode step
    (one token, this path) would drift from the forward over the same tokens."""
    acc = accumulation_dtype(x.dtype)
    log_a = -c * torch.sigmoid(gate_a.to(acc)) * F.softplus(a_param.to(acc))
    a = torch.exp(log_a)
    multiplier = sqrt_bound_derivative(1.0 - torch.exp(2.0 * log_a))
    if reset is not None:
        multiplier = torch.where(reset[..., None], torch.ones_like(multiplier), multiplier)
    b = x.to(acc) * torch.sigmoid(gate_x.to(acc)) * multiplier
    return a, b


def check_rg_lru_inputs(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"rg_lru: x must have shape (batch, time, width), got {tuple(x.shape)}")
    for name, t in (("gate_x", gate_x), ("gate_a", gate_a)):
        if t.shape != x.shape:
            raise ValueError(f"rg_lru: {name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    if a_param.shape != x.shape[-1:]:
        raise ValueError(f"rg_lru: a_param must have shape ({x.shape[-1]},), got {tuple(a_param.shape)}")


def rg_lru_ref(
    x: Tensor,
    gate_x: Tensor,
    gate_a: Tensor,
    a_param: Tensor,
    c: float = 8.0,
    h0: Tensor | None = None,
    reset: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference RG-LRU: PyTorch gate math and the reference Python-loop scan. Returns (y, h_last)."""
    check_rg_lru_inputs(x, gate_x, gate_a, a_param)
    a, b = rg_lru_gates(x, gate_x, gate_a, a_param, c, reset)
    y, h_last = linear_scan_ref(a, b, h0, reset)
    return y.to(x.dtype), h_last
