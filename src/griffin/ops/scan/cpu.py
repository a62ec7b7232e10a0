"""Fast CPU linear scan h_t = a_t * h_{t-1} + b_t (paper, Section 4.2).

Section 4.2 notes that the scan does one multiply-add per element, so it is bound by memory traffic, not by
FLOPs, and that a plain sequential scan which keeps the running state in fast memory is the right kernel. This
module does the same on CPU with numba:

* forward reads a and b once and writes h once; backward (a reverse scan) reads a, g and h once and writes
  grad_a and grad_b once. The running state (forward) and carry (backward) stay in L1 cache.
* no cumulative products and no division, so any a_t in [0, 1] is stable at any length.
* work is split over the batch and, when the batch is smaller than the thread count, over blocks of channels,
  so every core streams its own slice of memory; the inner loop runs over contiguous channels and vectorises.
* float32/bfloat16/float16 inputs accumulate in float32, float64 in float64. The kernels are compiled for
  float32 and float64 only. float32/float64 inputs are scanned in place and h is saved for the backward.
  16-bit inputs are converted to float32 one time block at a time (so the copies stay in cache) and the outputs
  converted back; the float32 state entering each block is saved, and the backward recomputes the block's
  float32 h from it rather than using the rounded output.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numba
import numpy as np
import torch
from numba import prange
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from griffin.ops.jit import kernel, parallel_ready, prefetch_span
from griffin.ops.scan.reference import accumulation_dtype, check_scan_inputs

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Reverse scans prefetch the rows about this many bytes ahead of each array (steps_ahead): the hardware prefetcher
# follows rows read forwards, not backwards (docs/performance.md, "Fused RG-LRU on CPU")
AHEAD_BYTES = 2048
_LINE = 16  # float32 values per 64-byte cache line: channel blocks are multiples of this
_BLOCK_BYTES = 2 * 2**20  # 16-bit inputs are scanned in time blocks whose float32 copies stay in cache
_HUGE_PAGE = 2 * 2**20
_HUGE_PAGE_MIN_BYTES = 32 * 2**20  # glibc's largest mmap threshold: smaller freed blocks are reused from its heap
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") else None


@kernel(parallel=True, fastmath=False)
def _forward_kernel(
    a: np.ndarray, b: np.ndarray, h0: np.ndarray, reset: np.ndarray, chunk: int, h: np.ndarray, h_last: np.ndarray
) -> None:
    """h[n, t] = a[n, t] * h[n, t-1] + b[n, t] (h[n, t-1] := 0 where reset[n, t]); h_last = h[:, -1] or h0."""
    batch, steps, dim = a.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        state = h0[n, lo:hi].copy()
        for t in range(steps):
            at = a[n, t, lo:hi]
            bt = b[n, t, lo:hi]
            ht = h[n, t, lo:hi]
            if reset[n, t]:
                for d in range(hi - lo):
                    state[d] = bt[d]
                    ht[d] = bt[d]
            else:
                for d in range(hi - lo):
                    s = at[d] * state[d] + bt[d]
                    state[d] = s
                    ht[d] = s
        h_last[n, lo:hi] = state


@kernel(parallel=True, fastmath=False)
def _backward_kernel(
    a: np.ndarray,
    h: np.ndarray,
    h0: np.ndarray,
    reset: np.ndarray,
    g: np.ndarray,
    g_last: np.ndarray,
    chunk: int,
    ahead: int,
    grad_a: np.ndarray,
    grad_b: np.ndarray,
    grad_h0: np.ndarray,
) -> None:
    """Reverse scan: dh_t = g_t + a_{t+1} dh_{t+1} (+ g_last at t = T-1); grad_b = dh; grad_a = dh_t h_{t-1}. The rows
    of step t - ahead are prefetched at step t (:func:`steps_ahead`)."""
    batch, steps, dim = a.shape
    n_chunks = -(-dim // chunk)
    for task in prange(batch * n_chunks):
        n = task // n_chunks
        lo = (task % n_chunks) * chunk
        hi = min(lo + chunk, dim)
        carry = g_last[n, lo:hi].copy()  # a_{t+1} * dh_{t+1}, zero across a reset; starts as the grad of h_last
        for t in range(steps - 1, -1, -1):
            if t > ahead:
                row = (n * steps + t - ahead) * dim + lo  # flat index of [n, t - ahead, lo]
                for arr in (a, g, grad_a, grad_b):
                    prefetch_span(arr, row, hi - lo)
                prefetch_span(h, row - dim, hi - lo)
            gt = g[n, t, lo:hi]
            gbt = grad_b[n, t, lo:hi]
            gat = grad_a[n, t, lo:hi]
            if reset[n, t]:
                for d in range(hi - lo):
                    gbt[d] = gt[d] + carry[d]
                    gat[d] = 0.0
                    carry[d] = 0.0
            else:
                at = a[n, t, lo:hi]
                prev = h0[n, lo:hi] if t == 0 else h[n, t - 1, lo:hi]
                for d in range(hi - lo):
                    dh = gt[d] + carry[d]
                    gbt[d] = dh
                    gat[d] = dh * prev[d]
                    carry[d] = at[d] * dh
        grad_h0[n, lo:hi] = carry


def channel_chunk(batch: int, dim: int) -> int:
    """Channels per task: whole rows when the batch alone feeds every thread (each task then streams one contiguous
    block of memory), else the fewest cache-line-aligned channel blocks that give every thread work."""
    threads = numba.get_num_threads()
    if batch >= threads:
        return max(dim, 1)
    blocks = -(-threads // max(batch, 1))
    return max(_LINE, -(-dim // (blocks * _LINE)) * _LINE)


def steps_ahead(chunk: int, itemsize: int) -> int:
    """How many time steps ahead a reverse scan prefetches the rows of its ``chunk`` channels: about
    :data:`AHEAD_BYTES` of each array in flight, at least one step."""
    return max(1, AHEAD_BYTES // max(chunk * itemsize, 1))


def _np(x: Tensor) -> np.ndarray:
    """The numpy view numba takes (no copy)."""
    return x.detach().numpy()


def empty_like_hugepages(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A contiguous empty tensor shaped like x; a large one asks Linux to back its 2 MiB-aligned interior with
    transparent huge pages.

    A large output is fresh memory that the OS faults in and zeroes on first write, 4 KiB at a time; on the
    benchmark machine that costs several times the kernel's own write of it (docs/performance.md). With 2 MiB
    pages there are 512x fewer faults. madvise is only a hint: if it fails the pages are ordinary ones.
    """
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    if _LIBC is not None and out.numel() * out.element_size() >= _HUGE_PAGE_MIN_BYTES:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (out.data_ptr() + out.numel() * out.element_size()) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
    return out


def _to(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x detached, contiguous and in dtype: x itself if it already is, else one copy into empty_like_hugepages."""
    x = x.detach()
    if x.dtype == dtype and x.is_contiguous():
        return x
    return empty_like_hugepages(x, dtype).copy_(x)


def _time_blocks(a: Tensor) -> list[tuple[int, int]]:
    """[t0, t1) blocks for 16-bit inputs: a block's float32 copy of a (B, rows, D) takes about _BLOCK_BYTES."""
    batch, steps, dim = a.shape
    rows = max(1, _BLOCK_BYTES // max(1, batch * dim * 4))
    return [(t0, min(t0 + rows, steps)) for t0 in range(0, steps, rows)]


def _initial_state(a: Tensor, h0: Tensor | None, reset: Tensor | None) -> tuple[Tensor, Tensor]:
    """h0 (zeros if None) in the accumulation dtype and reset (all False if None), contiguous."""
    batch, steps, dim = a.shape
    acc = accumulation_dtype(a.dtype)
    h0 = torch.zeros(batch, dim, dtype=acc) if h0 is None else _to(h0, acc)
    reset = torch.zeros(batch, steps, dtype=torch.bool) if reset is None else _to(reset, torch.bool)
    return h0, reset


def _forward(a: Tensor, b: Tensor, h0: Tensor, reset: Tensor) -> tuple[Tensor, Tensor]:
    """The forward kernel on contiguous float32/float64 inputs: h and h_last (new tensors)."""
    h = empty_like_hugepages(a)
    h_last = torch.empty_like(h0)
    parallel_ready()
    _forward_kernel(_np(a), _np(b), _np(h0), _np(reset), channel_chunk(a.shape[0], a.shape[2]), _np(h), _np(h_last))
    return h, h_last


def _forward_blocked(a: Tensor, b: Tensor, h0: Tensor, reset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The forward for 16-bit a and b, one time block at a time so the float32 copies stay in cache.

    Returns h in a's dtype, the float32 h_last, and the float32 state entering each block (n_blocks, B, D),
    from which the backward recomputes each block's float32 h.
    """
    blocks = _time_blocks(a)
    h = empty_like_hugepages(a)
    states = torch.empty(len(blocks), *h0.shape)
    state = h0.clone()
    for k, (t0, t1) in enumerate(blocks):
        states[k] = state
        h_block, state = _forward(_to(a[:, t0:t1], torch.float32), _to(b[:, t0:t1], torch.float32), states[k],
                                  _to(reset[:, t0:t1], torch.bool))  # fmt: skip
        h[:, t0:t1] = h_block
    return h, state, states


def _backward(
    a: Tensor, h: Tensor, h0: Tensor, reset: Tensor, g: Tensor, g_last: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel on contiguous float32/float64 tensors: grad_a, grad_b, grad_h0 (the carry into h0)."""
    grad_a, grad_b, grad_h0 = empty_like_hugepages(a), empty_like_hugepages(a), torch.empty_like(h0)
    parallel_ready()
    chunk = channel_chunk(a.shape[0], a.shape[2])
    _backward_kernel(
        _np(a), _np(h), _np(h0), _np(reset), _np(g), _np(g_last), chunk, steps_ahead(chunk, a.element_size()),
        _np(grad_a), _np(grad_b), _np(grad_h0),
    )  # fmt: skip
    return grad_a, grad_b, grad_h0


def _backward_blocked(
    a: Tensor, b: Tensor, reset: Tensor, states: Tensor, g: Tensor, g_last: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward for 16-bit inputs, last time block first: recompute the block's float32 h from its saved
    state, then reverse-scan it; the carry a_t0 * dh_t0 it leaves is the next block's gradient into its last h."""
    grad_a, grad_b = empty_like_hugepages(a), empty_like_hugepages(a)
    carry = _to(g_last, torch.float32)
    for k, (t0, t1) in reversed(list(enumerate(_time_blocks(a)))):
        a_block, r_block = _to(a[:, t0:t1], torch.float32), _to(reset[:, t0:t1], torch.bool)
        h_block, _ = _forward(a_block, _to(b[:, t0:t1], torch.float32), states[k], r_block)
        ga, gb, carry = _backward(a_block, h_block, states[k], r_block, _to(g[:, t0:t1], torch.float32), carry)
        grad_a[:, t0:t1] = ga
        grad_b[:, t0:t1] = gb
    return grad_a, grad_b, carry


class _LinearScanCPU(torch.autograd.Function):
    """Forward scan with a hand-written reverse-scan backward (Section 4.2)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, a: Tensor, b: Tensor, h0: Tensor | None, reset: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        h0_acc, reset_ = _initial_state(a, h0, reset)
        ctx.low_precision = accumulation_dtype(a.dtype) != a.dtype
        ctx.dtype = a.dtype
        ctx.h0_dtype = None if h0 is None else h0.dtype
        if ctx.low_precision:
            # backward recomputes h in float32 from the 16-bit a, b and the block states, not the rounded output
            h, h_last, states = _forward_blocked(a, b, h0_acc, reset_)
            ctx.save_for_backward(a, b, reset_, states)
        else:
            a = _to(a, a.dtype)
            h, h_last = _forward(a, _to(b, b.dtype), h0_acc, reset_)
            ctx.save_for_backward(a, h, h0_acc, reset_)
        return h, h_last

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_h: Tensor, grad_h_last: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        if ctx.low_precision:
            a, b, reset, states = ctx.saved_tensors
            grad_a, grad_b, grad_h0 = _backward_blocked(a, b, reset, states, grad_h, grad_h_last)
        else:
            a, h, h0, reset = ctx.saved_tensors
            grad_a, grad_b, grad_h0 = _backward(a, h, h0, reset, _to(grad_h, a.dtype), _to(grad_h_last, a.dtype))
        return (
            grad_a if ctx.needs_input_grad[0] else None,
            grad_b if ctx.needs_input_grad[1] else None,
            _to(grad_h0, ctx.h0_dtype) if ctx.needs_input_grad[2] else None,
            None,
        )


@torch.compiler.disable  # numba dispatchers cannot be traced by dynamo: run eagerly inside compiled models
def linear_scan_cpu(
    a: Tensor, b: Tensor, h0: Tensor | None = None, reset: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The "cpu" backend of :func:`griffin.ops.scan.linear_scan`: same conventions, numba kernels (Section 4.2)."""
    check_scan_inputs(a, b, h0, reset)
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"linear_scan_cpu: dtype {a.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    for name, x in (("a", a), ("b", b), ("h0", h0), ("reset", reset)):
        if x is not None and x.device.type != "cpu":
            raise ValueError(f"linear_scan_cpu: {name} must be on the CPU, got {x.device}")
    tracked = (a, b) if h0 is None else (a, b, h0)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tracked):
        return _LinearScanCPU.apply(a, b, h0, reset)
    h0, reset = _initial_state(a, h0, reset)
    if accumulation_dtype(a.dtype) != a.dtype:
        return _forward_blocked(a, b, h0, reset)[:2]
    return _forward(_to(a, a.dtype), _to(b, b.dtype), h0, reset)
