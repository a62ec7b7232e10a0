"""Fused CPU RG-LRU: gates, log-space decay, sqrt(1 - a^2) and the scan in one pass (Section 2.4, 4.2).

The unfused path (PyTorch gate math, then the scan) streams the (B, T, D) activations through memory some
thirty times in forward and backward together. Here the forward reads x and the two gate pre-activations once
and writes y once; the backward recomputes the gates, runs the reverse scan and writes the three input
gradients once, reducing the gradient of the decay parameter per (batch, channel block) without races.

Each time step is one loop over a block of channels that LLVM vectorises (AVX2/AVX-512); only the recurrence is
sequential, in time. That needs an exp it can vectorise: numba calls libm's scalar exp for ``math.exp``, which
made the kernel compute-bound, so the kernels use :func:`expm1_typed` (docs/performance.md, "Fused RG-LRU on CPU").

Numerics follow :func:`griffin.ops.rg_lru.rg_lru_ref`, including the clipped derivative of the square root, in the
accumulation dtype: float32 arithmetic and state for 16/32-bit inputs (as the Triton kernel and the reference), float64
for float64 inputs. 1 - a_t^2 comes from expm1, so it keeps its digits where a_t is near 1.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import prange
from torch import Tensor

from griffin.ops.jit import expm1_typed, kernel, parallel_ready, prefetch_span, sigmoid_typed
from griffin.ops.rg_lru.reference import MAX_SQRT_GRADIENT
from griffin.ops.scan.cpu import channel_chunk, empty_like_hugepages, steps_ahead
from griffin.ops.scan.reference import accumulation_dtype

# float32 constants: with float32 inputs the arithmetic stays float32, with float64 inputs numba widens them (1, 2 and
# 0 exactly; the gradient bound by 3e-11 of itself)
_ZERO, _ONE, _TWO = np.float32(0.0), np.float32(1.0), np.float32(2.0)
_MIN_2U = np.float32(1.0 / MAX_SQRT_GRADIENT)  # d sqrt(u)/du = 1 / max(2 sqrt(u), _MIN_2U), as sqrt_bound_derivative
# fastmath=False, FMA contraction included: with fastmath={"contract"} the forward ran 1.2-1.35x faster on one thread,
# but in a full test run a process's results then differed from another's in the 7th digit (a resumed run's losses
# from step 1 on, tests/training/test_preemption.py), which the uncontracted kernels keep bit-identical


@kernel(parallel=True, fastmath=False)
def _forward_kernel(x, gx, ga, log_a_max, h0, reset, chunk, y, h_last):
    """h_t = a_t h_{t-1} + sqrt(1 - a_t^2) sigmoid(gx_t) x_t with log a_t = log_a_max sigmoid(ga_t), where
    log_a_max = -c softplus(Lambda) (a^c at r_t = 1); at a document start h_t = sigmoid(gx_t) x_t. y_t = h_t.
    a_t = 1 + m_t and 1 - a_t^2 = -m_t (2 + m_t) from m_t = expm1(log a_t): exact also where a_t is near 1."""
    batch, steps, dim = x.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        state = h0[n, lo:hi].copy()
        lmax = log_a_max[lo:hi]
        for t in range(steps):
            xt, gxt, gat, yt = x[n, t, lo:hi], gx[n, t, lo:hi], ga[n, t, lo:hi], y[n, t, lo:hi]
            if reset[n, t]:
                for j in range(hi - lo):
                    s = xt[j] * sigmoid_typed(gxt[j])
                    state[j] = s
                    yt[j] = s
            else:
                for j in range(hi - lo):
                    m = expm1_typed(lmax[j] * sigmoid_typed(gat[j]))
                    s = (m + _ONE) * state[j] + np.sqrt(-m * (_TWO + m)) * (xt[j] * sigmoid_typed(gxt[j]))
                    state[j] = s
                    yt[j] = s
        h_last[n, lo:hi] = state


@kernel(parallel=True, fastmath=False)
def _backward_kernel(x, gx, ga, log_a_max, h0, reset, h, g, g_last, chunk, ahead, dx, dgx, dga, dlog_a_max, dh0):
    """Reverse scan with the gate derivatives; dlog_a_max[n, d] is batch row n's share of d/d log_a_max[d]. The rows
    of step t - ahead are prefetched at step t (the hardware prefetcher does not follow rows read backwards)."""
    batch, steps, dim = x.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        carry = g_last[n, lo:hi].copy()  # a_{t+1} dh_{t+1}
        acc = np.zeros(hi - lo, dtype=x.dtype)
        lmax = log_a_max[lo:hi]
        for t in range(steps - 1, -1, -1):
            if t > ahead:
                row = (n * steps + t - ahead) * dim + lo  # flat index of [n, t - ahead, lo]
                for arr in (x, gx, ga, g, dx, dgx, dga):
                    prefetch_span(arr, row, hi - lo)
                prefetch_span(h, row - dim, hi - lo)
            xt, gxt, gat, gt = x[n, t, lo:hi], gx[n, t, lo:hi], ga[n, t, lo:hi], g[n, t, lo:hi]
            dxt, dgxt, dgat = dx[n, t, lo:hi], dgx[n, t, lo:hi], dga[n, t, lo:hi]
            if reset[n, t]:  # h_t = i_t x_t: nothing flows to h_{t-1} or through a_t
                for j in range(hi - lo):
                    i = sigmoid_typed(gxt[j])
                    dh = gt[j] + carry[j]
                    dxt[j] = dh * i
                    dgxt[j] = dh * xt[j] * i * (_ONE - i)
                    dgat[j] = _ZERO
                    carry[j] = _ZERO
                continue
            prev = h0[n, lo:hi] if t == 0 else h[n, t - 1, lo:hi]
            for j in range(hi - lo):
                r = sigmoid_typed(gat[j])
                i = sigmoid_typed(gxt[j])
                dh = gt[j] + carry[j]
                m = expm1_typed(lmax[j] * r)
                a = m + _ONE
                a2 = a * a
                mult = np.sqrt(-m * (_TWO + m))  # sqrt(u), u = 1 - a^2
                dxt[j] = dh * i * mult
                dgxt[j] = dh * xt[j] * mult * i * (_ONE - i)
                d_u = dh * xt[j] * i / max(_TWO * mult, _MIN_2U)
                d_log_a = dh * prev[j] * a - d_u * _TWO * a2
                dgat[j] = d_log_a * lmax[j] * r * (_ONE - r)
                acc[j] += d_log_a * r
                carry[j] = a * dh
        dh0[n, lo:hi] = carry
        dlog_a_max[n, lo:hi] = acc


def _prep(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(dtype).contiguous()


# Two custom operators, opaque to torch.compile (numba cannot be traced): the model compiles with fullgraph=True and
# the kernels run as they are. The forward returns the float32 states as a third output for 16-bit inputs (the
# backward recomputes from them rather than from the rounded y); for float32/float64 inputs y is those states.
@torch.library.custom_op("griffin::rg_lru_cpu_fwd", mutates_args=(), device_types="cpu")
def rg_lru_cpu_fwd(x: Tensor, gate_x: Tensor, gate_a: Tensor, log_a_max: Tensor, h0: Tensor | None,
                   reset: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """y, h_last and (16-bit inputs only, else empty) the accumulation-dtype states, for log a_t = log_a_max r_t."""
    acc = accumulation_dtype(x.dtype)
    batch, steps, dim = x.shape
    xs, gxs, gas, lmax = (_prep(t, acc) for t in (x, gate_x, gate_a, log_a_max))
    h0_ = torch.zeros(batch, dim, dtype=acc) if h0 is None else _prep(h0, acc)
    reset_ = torch.zeros(batch, steps, dtype=torch.bool) if reset is None else reset.contiguous()
    h = empty_like_hugepages(xs)
    h_last = torch.empty_like(h0_)
    parallel_ready()
    _forward_kernel(xs.numpy(), gxs.numpy(), gas.numpy(), lmax.numpy(), h0_.numpy(), reset_.numpy(),
                    channel_chunk(batch, dim), h.numpy(), h_last.numpy())
    if acc == x.dtype:
        return h, h_last, h.new_empty(0)
    return h.to(x.dtype), h_last, h


@rg_lru_cpu_fwd.register_fake
def _(x, gate_x, gate_a, log_a_max, h0, reset):
    acc = accumulation_dtype(x.dtype)
    states = x.new_empty(x.shape, dtype=acc) if acc != x.dtype else x.new_empty(0, dtype=acc)
    return torch.empty_like(x), x.new_empty(x.shape[0], x.shape[2], dtype=acc), states


@torch.library.custom_op("griffin::rg_lru_cpu_bwd", mutates_args=(), device_types="cpu")
def rg_lru_cpu_bwd(x: Tensor, gate_x: Tensor, gate_a: Tensor, log_a_max: Tensor, h0: Tensor | None,
                   reset: Tensor | None, h: Tensor, grad_y: Tensor, grad_h_last: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for x, gate_x, gate_a, log_a_max (summed over the batch) and h0, from the forward's states h."""
    acc = accumulation_dtype(x.dtype)
    batch, steps, dim = x.shape
    xs, gxs, gas, lmax, hs = (_prep(t, acc) for t in (x, gate_x, gate_a, log_a_max, h))
    h0_ = torch.zeros(batch, dim, dtype=acc) if h0 is None else _prep(h0, acc)
    reset_ = torch.zeros(batch, steps, dtype=torch.bool) if reset is None else reset.contiguous()
    g, g_last = _prep(grad_y, acc), _prep(grad_h_last, acc)
    dx, dgx, dga = empty_like_hugepages(xs), empty_like_hugepages(xs), empty_like_hugepages(xs)
    dlog_a_max, dh0 = torch.empty_like(h0_), torch.empty_like(h0_)
    parallel_ready()
    chunk = channel_chunk(batch, dim)
    _backward_kernel(xs.numpy(), gxs.numpy(), gas.numpy(), lmax.numpy(), h0_.numpy(), reset_.numpy(), hs.numpy(),
                     g.numpy(), g_last.numpy(), chunk, steps_ahead(chunk, xs.element_size()), dx.numpy(),
                     dgx.numpy(), dga.numpy(), dlog_a_max.numpy(), dh0.numpy())
    return dx.to(x.dtype), dgx.to(x.dtype), dga.to(x.dtype), dlog_a_max.sum(0), dh0


@rg_lru_cpu_bwd.register_fake
def _(x, gate_x, gate_a, log_a_max, h0, reset, h, grad_y, grad_h_last):
    acc = accumulation_dtype(x.dtype)
    state = x.new_empty(x.shape[0], x.shape[2], dtype=acc)
    return (torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[2], dtype=acc),
            state)


def _setup_context(ctx, inputs, output) -> None:
    x, gate_x, gate_a, log_a_max, h0, reset = inputs
    y, _, states = output
    ctx.mark_non_differentiable(states)
    ctx.save_for_backward(x, gate_x, gate_a, log_a_max, h0, reset, states if states.numel() else y)


def _backward(ctx, grad_y: Tensor | None, grad_h_last: Tensor | None, _grad_states: Tensor | None):
    x, gate_x, gate_a, log_a_max, h0, reset, h = ctx.saved_tensors
    acc = accumulation_dtype(x.dtype)
    grad_y = torch.zeros_like(x) if grad_y is None else grad_y
    grad_h_last = x.new_zeros(x.shape[0], x.shape[2], dtype=acc) if grad_h_last is None else grad_h_last
    dx, dgx, dga, dlog, dh0 = rg_lru_cpu_bwd(x, gate_x, gate_a, log_a_max, h0, reset, h, grad_y, grad_h_last)
    return dx, dgx, dga, dlog.to(log_a_max.dtype), None if h0 is None else dh0.to(h0.dtype), None


rg_lru_cpu_fwd.register_autograd(_backward, setup_context=_setup_context)


def rg_lru_cpu(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor, c: float = 8.0,
               h0: Tensor | None = None, reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The fused RG-LRU on CPU tensors; same contract as :func:`griffin.ops.rg_lru.rg_lru_ref`. The decay's log
    maximum -c softplus(Lambda) is computed here, so that autograd carries its gradient on to Lambda."""
    acc = accumulation_dtype(x.dtype)
    log_a_max = -c * F.softplus(a_param.to(acc))
    if torch.compiler.is_compiling():
        # 16-bit inputs widened here rather than inside the operator: the casts fuse into the kernels that produce the
        # inputs and consume y (and in backward their gradients'), instead of copies of their own. Eager calls keep
        # the operator's own widening, which saves the 16-bit inputs for backward (half the bytes)
        y, h_last, _ = rg_lru_cpu_fwd(x.to(acc), gate_x.to(acc), gate_a.to(acc), log_a_max, h0, reset)
        return y.to(x.dtype), h_last
    y, h_last, _ = rg_lru_cpu_fwd(x, gate_x, gate_a, log_a_max, h0, reset)
    return y, h_last
