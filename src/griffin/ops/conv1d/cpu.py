"""Fused CPU Conv1D of the recurrent block (Section 2.3): the forward reads x once and writes y once, the backward
reads the output gradient and x once and writes the input gradient once, with the weight and bias gradients
reduced per batch row without races.

The reference (:func:`griffin.ops.conv1d.reference.conv1d_ref`) is a handful of element-wise operators over
shifted slices; under torch.compile, Inductor fuses their backward with its neighbours' into loops that gather
channel vectors element by element, which made the compiled training step slower than the eager one on an
AVX-512 CPU (docs/performance.md). As custom operators the kernels stay opaque to the compiler, like the RG-LRU's.

Document starts: an input x_u is dropped from output t when a document starts in (u, t]; :func:`kept_shifts` gives
each output the number of earlier inputs it sees, the kernels use those shifts. Float32/bfloat16/float16 inputs are
computed in float32, float64 in float64; the weight and bias gradients accumulate in float64.

The channel loops run over unsigned indices: numba wraps a negative signed index around (``x[-1]``), and that
check on every channel (a start it cannot prove non-negative) kept LLVM from vectorising the loops, which then ran
about ten times slower.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange
from torch import Tensor

from griffin.ops.jit import kernel, parallel_ready
from griffin.ops.scan.cpu import channel_chunk
from griffin.ops.scan.reference import accumulation_dtype


@kernel(parallel=True, fastmath=False)
def _forward_kernel(x, w, b, kept, offset, chunk, y):
    """y[n, t] = b + w[K-1] x[n, offset+t] + sum_{s=1}^{kept[n, t]} w[K-1-s] x[n, offset+t-s]."""
    batch, steps, dim = y.shape
    K = w.shape[0]
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n, lo = task // n_chunks, (task % n_chunks) * chunk
        lo, hi = np.uint64(lo), np.uint64(min(lo + chunk, dim))  # unsigned channels: see the module docstring
        for t in range(steps):
            u = offset + t
            yt, xu, wl = y[n, t], x[n, u], w[K - 1]
            for j in range(lo, hi):
                yt[j] = xu[j] * wl[j] + b[j]
            for s in range(1, kept[n, t] + 1):
                xs, ws = x[n, u - s], w[K - 1 - s]
                for j in range(lo, hi):
                    yt[j] += xs[j] * ws[j]


@kernel(parallel=True, fastmath=False)
def _backward_kernel(x, w, kept, offset, g, chunk, dx, dw, db):
    """dx (zeroed, like x), and per batch row dw (B, K, width) and db (B, width) (zeroed, float64)."""
    batch, steps, dim = g.shape
    K = w.shape[0]
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n, lo = task // n_chunks, (task % n_chunks) * chunk
        lo, hi = np.uint64(lo), np.uint64(min(lo + chunk, dim))
        for t in range(steps):  # indexed, not sliced: a view per (t, s) cost more than its arithmetic
            u = offset + t
            for s in range(0, kept[n, t] + 1):
                for j in range(lo, hi):
                    dw[n, K - 1 - s, j] += g[n, t, j] * x[n, u - s, j]
                    dx[n, u - s, j] += g[n, t, j] * w[K - 1 - s, j]
            for j in range(lo, hi):
                db[n, j] += g[n, t, j]


def kept_shifts(reset: Tensor | None, batch: int, steps: int, offset: int, width: int) -> Tensor:
    """(B, T) int64: how many inputs before x[n, offset + t] output t sees, at most ``width - 1``: those at or after
    the latest document start (the state's ``offset`` steps before the chunk count while no document starts)."""
    u = torch.arange(offset, offset + steps).expand(batch, steps)
    start = torch.zeros(batch, steps, dtype=torch.int64)
    if reset is not None:
        start = torch.cummax(torch.where(reset, u, 0), dim=1).values
    return (u - start).clamp(max=width - 1).contiguous()


def _prep(t: Tensor, dtype: torch.dtype, copy: bool = False) -> Tensor:
    """The array a kernel reads. The weights are copied (``copy``): numba reads tensors through ``.numpy()``, which
    makes their storage unresizable for good, and FSDP frees a gathered parameter's storage by resizing it."""
    return t.detach().to(dtype, copy=copy).contiguous()


def _out_dtype(x: Tensor, w: Tensor, b: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, w.dtype), b.dtype)


@torch.library.custom_op("griffin::conv1d_cpu_fwd", mutates_args=(), device_types="cpu")
def conv1d_cpu_fwd(x: Tensor, w: Tensor, b: Tensor, reset: Tensor | None, offset: int) -> Tensor:
    """y (B, T, width) over x (B, offset + T, width) whose first ``offset`` steps are the state before the chunk."""
    dtype = _out_dtype(x, w, b)
    acc = accumulation_dtype(dtype)
    batch, steps, dim = x.shape[0], x.shape[1] - offset, x.shape[2]
    xs, ws, bs = _prep(x, acc), _prep(w, acc, copy=True), _prep(b, acc, copy=True)
    y = torch.empty(batch, steps, dim, dtype=acc)
    parallel_ready()
    kept = kept_shifts(reset, batch, steps, offset, w.shape[0])
    _forward_kernel(xs.numpy(), ws.numpy(), bs.numpy(), kept.numpy(), offset, channel_chunk(batch, dim), y.numpy())
    return y.to(dtype)


@conv1d_cpu_fwd.register_fake
def _(x, w, b, reset, offset):
    return x.new_empty(x.shape[0], x.shape[1] - offset, x.shape[2], dtype=_out_dtype(x, w, b))


@torch.library.custom_op("griffin::conv1d_cpu_bwd", mutates_args=(), device_types="cpu")
def conv1d_cpu_bwd(x: Tensor, w: Tensor, reset: Tensor | None, offset: int, grad_y: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for x (with its state steps), w and b (float64 sums over the batch and time)."""
    acc = accumulation_dtype(grad_y.dtype)
    batch, steps, dim = grad_y.shape
    xs, ws, g = _prep(x, acc), _prep(w, acc, copy=True), _prep(grad_y, acc)
    dx = torch.zeros_like(xs)
    dw = torch.zeros(batch, w.shape[0], dim, dtype=torch.float64)
    db = torch.zeros(batch, dim, dtype=torch.float64)
    parallel_ready()
    kept = kept_shifts(reset, batch, steps, offset, w.shape[0])
    _backward_kernel(xs.numpy(), ws.numpy(), kept.numpy(), offset, g.numpy(), channel_chunk(batch, dim), dx.numpy(),
                     dw.numpy(), db.numpy())
    return dx, dw.sum(0), db.sum(0)


@conv1d_cpu_bwd.register_fake
def _(x, w, reset, offset, grad_y):
    acc = accumulation_dtype(grad_y.dtype)
    return (x.new_empty(x.shape, dtype=acc), w.new_empty(w.shape, dtype=torch.float64),
            w.new_empty(w.shape[1], dtype=torch.float64))


def _setup_context(ctx, inputs, output) -> None:
    x, w, b, reset, offset = inputs
    ctx.offset, ctx.b_dtype = offset, b.dtype
    ctx.save_for_backward(x, w, reset)


def _backward(ctx, grad_y: Tensor):
    x, w, reset = ctx.saved_tensors
    dx, dw, db = conv1d_cpu_bwd(x, w, reset, ctx.offset, grad_y)
    return dx.to(x.dtype), dw.to(w.dtype), db.to(ctx.b_dtype), None, None


conv1d_cpu_fwd.register_autograd(_backward, setup_context=_setup_context)


def conv1d_cpu(x: Tensor, w: Tensor, b: Tensor, reset: Tensor | None = None, state: Tensor | None = None) -> Tensor:
    """The fused Conv1D on CPU tensors; same contract as :func:`griffin.ops.conv1d.reference.conv1d_ref`."""
    offset = 0
    if state is not None:
        x, offset = torch.cat([state.to(x.dtype), x], dim=1), state.shape[1]
    if torch.compiler.is_compiling():
        # x widened here rather than inside the operator, y rounded after it: these casts fuse into the neighbouring
        # kernels (forward and backward) instead of running as copies of their own; eager calls keep the operator's
        # own widening, which saves the 16-bit x for backward
        dtype = _out_dtype(x, w, b)
        return conv1d_cpu_fwd(x.to(accumulation_dtype(dtype)), w, b, reset, offset).to(dtype)
    return conv1d_cpu_fwd(x, w, b, reset, offset)


__all__ = ["conv1d_cpu", "conv1d_cpu_bwd", "conv1d_cpu_fwd"]
