"""Fused CPU RG-LRU: gates, log-space decay, sqrt(1 - a^2) and the scan in one pass (Section 2.4, 4.2).

The unfused path (PyTorch gate math, then the scan) streams the (B, T, D) activations through memory some
thirty times in forward and backward together. Here the forward reads x and the two gate pre-activations once
and writes y once; the backward recomputes the gates, runs the reverse scan and writes the three input
gradients once, reducing the gradient of the decay parameter per (batch, channel block) without races.

Numerics follow :func:`griffin.ops.rg_lru.rg_lru_ref` in float32 (float64 for float64 inputs), including the
clipped derivative of the square root. 16-bit inputs are computed in float32.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange
from torch import Tensor

from griffin.ops.rg_lru import MAX_SQRT_GRADIENT
from griffin.ops.scan import accumulation_dtype
from griffin.ops.scan_cpu import channel_chunk, empty_like_hugepages

_MIN_4U = 1.0 / MAX_SQRT_GRADIENT**2  # d sqrt(u)/du = 1 / sqrt(max(4u, _MIN_4U))


@numba.njit(inline="always")
def _sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


@numba.njit(parallel=True, fastmath=False, cache=True)
def _forward_kernel(x, gx, ga, softplus_lam, c, h0, reset, chunk, y, h_last):
    """y_t = h_t = a_t h_{t-1} + sqrt(1 - a_t^2) sigmoid(gx_t) x_t, log a_t = -c softplus(Lambda) sigmoid(ga_t)."""
    batch, steps, dim = x.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        state = h0[n, lo:hi].copy()
        for t in range(steps):
            start = reset[n, t]
            for j in range(hi - lo):
                d = lo + j
                log_a = -c * softplus_lam[d] * _sigmoid(ga[n, t, d])
                u = x[n, t, d] * _sigmoid(gx[n, t, d])
                if start:
                    s = u
                else:
                    s = math.exp(log_a) * state[j] + math.sqrt(1.0 - math.exp(2.0 * log_a)) * u
                state[j] = s
                y[n, t, d] = s
        h_last[n, lo:hi] = state


@numba.njit(parallel=True, fastmath=False, cache=True)
def _backward_kernel(x, gx, ga, softplus_lam, c, h0, reset, h, g, g_last, chunk,
                     dx, dgx, dga, dsoftplus, dh0):
    """Reverse scan with the gate derivatives; dsoftplus[n, d] is this batch row's share of d/d softplus(Lambda)."""
    batch, steps, dim = x.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        carry = g_last[n, lo:hi].copy()  # a_{t+1} dh_{t+1}
        acc = np.zeros(hi - lo, dtype=x.dtype)
        for t in range(steps - 1, -1, -1):
            start = reset[n, t]
            for j in range(hi - lo):
                d = lo + j
                r = _sigmoid(ga[n, t, d])
                i = _sigmoid(gx[n, t, d])
                xv = x[n, t, d]
                dh = g[n, t, d] + carry[j]
                if start:
                    dx[n, t, d] = dh * i
                    dgx[n, t, d] = dh * xv * i * (1.0 - i)
                    dga[n, t, d] = 0.0
                    carry[j] = 0.0
                    continue
                log_a = -c * softplus_lam[d] * r
                a = math.exp(log_a)
                a2 = math.exp(2.0 * log_a)
                mult = math.sqrt(1.0 - a2)
                prev = h0[n, d] if t == 0 else h[n, t - 1, d]
                dx[n, t, d] = dh * i * mult
                dgx[n, t, d] = dh * xv * mult * i * (1.0 - i)
                d_mult = dh * xv * i
                d_u = d_mult / math.sqrt(max(4.0 * (1.0 - a2), _MIN_4U))  # u = 1 - a^2
                d_log_a = dh * prev * a - d_u * 2.0 * a2
                dga[n, t, d] = d_log_a * (-c * softplus_lam[d]) * r * (1.0 - r)
                acc[j] += d_log_a * (-c * r)
                carry[j] = a * dh
        dh0[n, lo:hi] = carry
        dsoftplus[n, lo:hi] = acc


def _prep(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(dtype).contiguous()


class _RGLRUCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor, c: float,
                h0: Tensor | None, reset: Tensor | None) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        acc = accumulation_dtype(x.dtype)
        batch, steps, dim = x.shape
        xs, gxs, gas = (_prep(t, acc) for t in (x, gate_x, gate_a))
        softplus_lam = torch.nn.functional.softplus(a_param.detach().to(acc)).contiguous()
        h0_ = x.new_zeros(batch, dim, dtype=acc) if h0 is None else _prep(h0, acc)
        reset_ = torch.zeros(batch, steps, dtype=torch.bool) if reset is None else reset.detach().contiguous()
        h = empty_like_hugepages(xs)
        h_last = torch.empty_like(h0_)
        chunk = channel_chunk(batch, dim)
        _forward_kernel(xs.numpy(), gxs.numpy(), gas.numpy(), softplus_lam.numpy(), float(c), h0_.numpy(),
                        reset_.numpy(), chunk, h.numpy(), h_last.numpy())
        ctx.save_for_backward(xs, gxs, gas, softplus_lam, h0_, reset_, h, a_param)
        ctx.c, ctx.chunk, ctx.dtype, ctx.h0_dtype = float(c), chunk, x.dtype, None if h0 is None else h0.dtype
        return h.to(x.dtype), h_last

    @staticmethod
    def backward(ctx, grad_y: Tensor, grad_h_last: Tensor):  # type: ignore[override]
        xs, gxs, gas, softplus_lam, h0, reset, h, a_param = ctx.saved_tensors
        acc = xs.dtype
        g = _prep(grad_y, acc) if grad_y is not None else torch.zeros_like(xs)
        g_last = _prep(grad_h_last, acc) if grad_h_last is not None else torch.zeros_like(h0)
        dx, dgx, dga = empty_like_hugepages(xs), empty_like_hugepages(xs), empty_like_hugepages(xs)
        dsoftplus = torch.empty_like(h0)
        dh0 = torch.empty_like(h0)
        _backward_kernel(xs.numpy(), gxs.numpy(), gas.numpy(), softplus_lam.numpy(), ctx.c, h0.numpy(), reset.numpy(),
                         h.numpy(), g.numpy(), g_last.numpy(), ctx.chunk, dx.numpy(), dgx.numpy(), dga.numpy(),
                         dsoftplus.numpy(), dh0.numpy())
        d_lam = dsoftplus.sum(0) * torch.sigmoid(a_param.detach().to(acc))
        return (dx.to(ctx.dtype), dgx.to(ctx.dtype), dga.to(ctx.dtype), d_lam.to(a_param.dtype), None,
                None if ctx.h0_dtype is None else dh0.to(ctx.h0_dtype), None)


@torch.compiler.disable  # numba dispatchers cannot be traced by dynamo: run eagerly inside compiled models
def rg_lru_cpu(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor, c: float = 8.0,
               h0: Tensor | None = None, reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The fused RG-LRU on CPU tensors; same contract as :func:`griffin.ops.rg_lru.rg_lru_ref`."""
    return _RGLRUCPU.apply(x, gate_x, gate_a, a_param, c, h0, reset)
