"""The Real-Gated Linear Recurrent Unit (Section 2.4) and its complex variant, the CG-LRU (Appendix B).

In a compiled CPU step an RG-LRU of width at most :data:`DENSE_GATES_MAX_WIDTH` computes its two block-diagonal gates
as one dense matmul (:func:`dense_gates`, the zero blocks multiplied too): at that width one small matmul costs less
than two batched matmuls over blocks of a few channels and the copies around them (benchmarks/gates_cpu.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.ops.rg_lru import rg_lru, rg_lru_gates, sqrt_bound_derivative
from griffin.ops.scan import linear_scan

# Widths up to which a compiled CPU step computes the RG-LRU's gates by dense_gates (benchmarks/gates_cpu.py;
# docs/performance.md, "Small-model training").
DENSE_GATES_MAX_WIDTH = 64


class BlockDiagonalLinear(nn.Module):
    """y = x W + b with W block-diagonal: ``blocks`` independent (in/blocks -> out/blocks) maps (Section 4.1)."""

    def __init__(self, in_width: int, out_width: int, blocks: int, w_init_variance_scale: float = 1.0) -> None:
        super().__init__()
        if in_width % blocks or out_width % blocks:
            raise ValueError(f"widths {in_width} -> {out_width} are not divisible by blocks={blocks}")
        self.blocks = blocks
        self.w_init_variance_scale = w_init_variance_scale
        self.w = nn.Parameter(torch.empty(blocks, in_width // blocks, out_width // blocks))
        self.b = nn.Parameter(torch.empty(blocks, out_width // blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # LeCun initialisation per block (Section 2.4).
        nn.init.normal_(self.w, std=math.sqrt(self.w_init_variance_scale / self.w.shape[1]))
        nn.init.zeros_(self.b)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in_width) -> (..., out_width): one batched matmul over the blocks with the bias fused in
        (``baddbmm``, faster than ``einsum`` + add). The blocks are those
        ``w`` holds: all of them, or this device's share under tensor parallelism (Section 4.1)."""
        xb = x.reshape(-1, self.w.shape[0], self.w.shape[1]).transpose(0, 1)  # (blocks, N, in/blocks)
        y = torch.baddbmm(self.b[:, None, :], xb, self.w)  # (blocks, N, out/blocks)
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1)


def dense_gates(x: Tensor, *gates: BlockDiagonalLinear) -> tuple[Tensor, ...]:
    """``gate(x)`` for each gate, from one dense matmul of x with their block-diagonal weights side by side."""
    w = torch.cat([torch.block_diag(*g.w) for g in gates], 1)
    b = torch.cat([g.b.flatten() for g in gates])
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1).chunk(len(gates), -1)


def init_a_param(a_param: Tensor, min_rad: float, max_rad: float, rule: str = "ring", c: float = 8.0,
                 eps: float = 1e-8) -> None:
    """Lambda for a = exp(-softplus(Lambda)) at initialisation (Section 2.4): ``ring`` (the released implementation)
    draws a^2 uniformly in [min_rad^2, max_rad^2]; ``paper`` draws a^c uniformly in [min_rad, max_rad], as the
    paper's text says."""
    lo, hi, power = {"ring": (min_rad**2, max_rad**2, 2.0), "paper": (min_rad, max_rad, c)}[rule]
    with torch.no_grad():
        a_param.uniform_(lo + eps, hi + eps)
        a_param.log_().div_(power)  # log a
        a_param.neg_().exp_().sub_(1.0).log_()  # softplus^-1(-log a)


class RGLRU(nn.Module):
    """r_t = sigmoid(W_a x_t + b_a); i_t = sigmoid(W_x x_t + b_x); a_t = a^(c r_t);
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), with a = sigmoid(-Lambda) computed in log space."""

    def __init__(self, width: int, gate_blocks: int, c: float = 8.0,
                 a_init_range: tuple[float, float] = (0.9, 0.999), a_init_rule: str = "ring") -> None:
        super().__init__()
        self.c = c
        self.a_init_range = a_init_range
        self.a_init_rule = a_init_rule
        self.input_gate = BlockDiagonalLinear(width, width, gate_blocks)
        self.a_gate = BlockDiagonalLinear(width, width, gate_blocks)
        self.a_param = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.input_gate.reset_parameters()
        self.a_gate.reset_parameters()
        init_a_param(self.a_param, *self.a_init_range, self.a_init_rule, self.c)

    def forward(self, x: Tensor, reset: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: (B, T, width); reset: (B, T) document starts; h0: (B, width). Returns (y, h_last)."""
        if self._dense_gates(x):
            gate_x, gate_a = dense_gates(x, self.input_gate, self.a_gate)
        else:
            gate_x, gate_a = self.input_gate(x), self.a_gate(x)
        return rg_lru(x, gate_x, gate_a, self.a_param, self.c, h0, reset)

    def _dense_gates(self, x: Tensor) -> bool:
        """Whether this forward takes its gates from :func:`dense_gates`: in a compiled CPU step, at most
        :data:`DENSE_GATES_MAX_WIDTH` wide, with both gates still float :class:`BlockDiagonalLinear` (not an int8
        version, nor a decode engine's swapped-in gate module) whose weights are plain tensors (not the DTensors
        of tensor parallelism, which a gate turns into its local shard only inside its own forward)."""
        return (torch.compiler.is_compiling() and x.device.type == "cpu" and x.shape[-1] <= DENSE_GATES_MAX_WIDTH
                and all(type(g) is BlockDiagonalLinear and type(g.w) in (Tensor, nn.Parameter)
                        and type(g.b) in (Tensor, nn.Parameter) for g in (self.input_gate, self.a_gate)))

    def decay(self, x: Tensor) -> Tensor:
        """a_t = a^(c r_t) for the inputs x (B, T, width), in the accumulation dtype: the fraction of the state each
        step keeps (Section 2.4)."""
        return rg_lru_gates(x, self.input_gate(x), self.a_gate(x), self.a_param, self.c, None)[0]


class CGLRU(nn.Module):
    """The complex-gated LRU of Appendix B: x = [x1; x2] is read as x1 + i x2, a~ = sigmoid(-Lambda) e^(i theta),
    a~_t = a~^(c r_t), h~_t = a~_t h~_{t-1} + sqrt(1 - |a~_t|^2) (i_t x~_t), y = [Re h~; Im h~]."""

    def __init__(self, width: int, gate_blocks: int, c: float = 8.0,
                 a_init_range: tuple[float, float] = (0.9, 0.999), a_init_rule: str = "ring",
                 max_phase: float = 2 * math.pi) -> None:
        super().__init__()
        if width % 2:
            raise ValueError(f"CGLRU width={width} must be even")
        self.c = c
        self.a_init_range = a_init_range
        self.a_init_rule = a_init_rule
        self.max_phase = max_phase
        half = width // 2
        self.input_gate = BlockDiagonalLinear(width, half, gate_blocks)
        self.a_gate = BlockDiagonalLinear(width, half, gate_blocks)
        self.a_param = nn.Parameter(torch.empty(half))
        self.theta = nn.Parameter(torch.empty(half))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.input_gate.reset_parameters()
        self.a_gate.reset_parameters()
        init_a_param(self.a_param, *self.a_init_range, self.a_init_rule, self.c)
        with torch.no_grad():
            self.theta.uniform_(0.0, self.max_phase)

    def forward(self, x: Tensor, reset: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: (B, T, width) real; h0: (B, width/2) complex. Returns (y real (B, T, width), complex h_last)."""
        r = torch.sigmoid(self.a_gate(x))
        gate_x = torch.sigmoid(self.input_gate(x))
        log_mod = -self.c * r * F.softplus(self.a_param)
        angle = self.c * r * self.theta
        real = torch.promote_types(x.dtype, torch.float32)  # the recurrence runs in at least fp32
        a = torch.polar(torch.exp(log_mod.to(real)), angle.to(real))
        multiplier = sqrt_bound_derivative(1.0 - torch.exp(2.0 * log_mod))
        if reset is not None:
            multiplier = torch.where(reset[..., None], torch.ones_like(multiplier), multiplier)
        x_re, x_im = x.to(real).chunk(2, dim=-1)
        scale = (gate_x * multiplier).to(real)
        b = torch.complex(x_re * scale, x_im * scale)
        h, h_last = linear_scan(a, b, h0, reset)
        return torch.cat([h.real, h.imag], dim=-1).to(x.dtype), h_last
