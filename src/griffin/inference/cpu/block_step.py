"""The work of a decode step between its weight matmuls on CPU, fused (Section 5): RMSNorm and the residual add before
it, the gated MLP's GeLU product, the whole recurrent block between its two projections (the Conv1D step, the RG-LRU's
block-diagonal gates and recurrence of Section 2.4, the product with the GeLU branch) in one parallel region, and
multi-query attention between its projections (RoPE, the key/value cache write, the attention over the cache of Section
2.3).

At one token per row these layers hold a few thousand values each, and the eager operators that compute them in the
model (about 150 per layer and step) cost more than their arithmetic. Each kernel computes what its layer's forward
computes for one token per row without document starts or padding (every decode step), from tensors in their stored
dtype (float32, or bfloat16 as its uint16 bits) in float32, and rounds to the model's dtype where the model stores a
value (the Conv1D input it keeps, the layers' outputs, the gates and the recurrence's output, which the model rounds
before using them). A residual block's whole step is one parallel region (:func:`_recurrent_block_kernel`,
:func:`_attention_block_kernel`): these kernels around its four weight matmuls
(:func:`griffin.inference.cpu.matvec.rows_task`), in one parallel region whose threads share their tasks
(:mod:`griffin.inference.cpu.tasks`); a step's whole stack of blocks is one call (:func:`stack_step`). e^x, the
sigmoid and the bfloat16 rounding are :mod:`griffin.ops.jit`'s (float64 arithmetic that LLVM vectorises, where
``np.exp`` is a scalar call).

Each numba function that computes a layer's math names, in its docstring, the layer function it mirrors ("mirrors
..."), and ``tests/inference/cpu/test_block_step.py`` compares the two on random inputs in float32 and bfloat16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload
from torch import Tensor

from griffin.inference.cpu import matvec as matvec_module
from griffin.inference.cpu.matvec import (
    PRANGE_ONLY,
    MatvecWeights,
    block_product,
    gate_arrays,
    prepare_rows,
    rows_buffers,
    rows_task,
)
from griffin.inference.cpu.tasks import claim, counters, finish, single, wait
from griffin.layers.attention import cache_slot
from griffin.ops.jit import exp_vectorizable, kernel, narrow, parallel_ready, sigmoid_vectorizable, storage, widen

STEP_DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes the kernels read and write


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _rounded(v, like):
    """v as the model holds it in ``like``'s dtype (rounded to bfloat16, or float32 as it is), widened again."""
    return widen(narrow(v, like))


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _gelu(x, exact):
    """GeLU of float32 x: exact (erf) or the tanh approximation (``F.gelu``'s "none" and "tanh"), the latter as
    x sigmoid(2 z) = 0.5 x (1 + tanh z). Mirrors :func:`torch.nn.functional.gelu` as
    :meth:`griffin.layers.GatedMLP.forward` calls it."""
    if exact:
        return np.float32(0.5) * x * np.float32(math.erfc(-x * np.float32(0.7071067811865476)))  # 1 + erf(z)
    z = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    return x * np.float32(sigmoid_vectorizable(np.float32(2.0) * z))


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _normalise(r, scale, eps, out):
    """out = r / sqrt(mean(r^2) + eps) * (1 + scale) for one row r (D,), as stored. Mirrors
    :meth:`griffin.layers.RMSNorm.forward`."""
    D = r.shape[0]
    ss = np.float32(0.0)
    for d in range(D):
        v = widen(r[d])
        ss += v * v
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
    like = out.dtype.type(0)
    for d in range(D):
        out[d] = narrow(widen(r[d]) * inv * (np.float32(1.0) + widen(scale[d])), like)


@kernel(fastmath=True, error_model="numpy")
def _rms_norm_kernel(x, scale, eps, out):
    """RMSNorm of each row of x (B, D) into out."""
    for b in range(x.shape[0]):
        _normalise(x[b], scale, eps, out[b])


@kernel(fastmath=True, error_model="numpy")
def _add_rms_norm_kernel(x, delta, scale, eps, residual, out):
    """Per row: residual = x + delta (stored in residual's dtype), out = RMSNorm(residual)."""
    B, D = x.shape
    like = residual.dtype.type(0)
    for b in range(B):
        for d in range(D):
            residual[b, d] = narrow(widen(x[b, d]) + widen(delta[b, d]), like)
        _normalise(residual[b], scale, eps, out[b])


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _gelu_rows(x, col, exact, out):
    """out (B, n) = GeLU(x[:, col : col + n]), x first rounded to out's dtype (a layer's output) and the GeLU too."""
    like = out.dtype.type(0)  # out's dtype, for the roundings (a load from out would keep LLVM from vectorising)
    n = out.shape[1]
    for b in range(out.shape[0]):
        row, out_row = x[b, col : col + n], out[b]  # (slices: LLVM sees consecutive indices)
        if exact:  # (a branch per row, not per entry)
            for m in range(n):
                out_row[m] = narrow(_gelu(_rounded(widen(row[m]), like), True), like)
        else:
            for m in range(n):
                out_row[m] = narrow(_gelu(_rounded(widen(row[m]), like), False), like)


@kernel(fastmath=True, error_model="numpy")
def _gelu_product_kernel(gate_up, exact, out):
    """out (B, M) = GeLU(gate) * up for gate_up (B, 2M) = [gate, up], both first rounded to out's dtype (the model's
    layer outputs), the GeLU too. Mirrors :meth:`griffin.layers.GatedMLP.forward` between its projections."""
    _gelu_rows(gate_up, 0, exact, out)
    like = out.dtype.type(0)
    M = out.shape[1]
    for b in range(out.shape[0]):
        up, out_row = gate_up[b, M:], out[b]
        for m in range(M):
            out_row[m] = narrow(widen(out_row[m]) * _rounded(widen(up[m]), like), like)


@kernel(fastmath=True, error_model="numpy")
def _recurrent_head(blk, y_u, conv_state, conv_w, conv_b, gx_w, gx_b, gx_s, ga_w, ga_b, ga_s, log_a_scale, h, exact, out):  # noqa: E501
    """One token of the recurrent block between its projections (Figure 2c) for the channels of gate block ``blk``,
    for y_u (B, 2R) = [y, u] the rows of its two branches: the Conv1D step on u (``conv_state`` (B, K-1, R) holds the
    previous inputs and is shifted by one), the block-diagonal gates on its output, the RG-LRU step on ``h`` (B, R)
    float32 (in place), and out (B, R) = RG-LRU output * GeLU(y). A block's channels need nothing of the others.
    Mirrors :meth:`griffin.layers.RecurrentBlock.forward` between its projections at one token:
    :meth:`griffin.layers.conv1d.CausalConv1D.forward`, :meth:`griffin.layers.BlockDiagonalLinear.forward`,
    :meth:`griffin.layers.rg_lru.RGLRU.forward`."""
    B, R = h.shape
    K = conv_w.shape[0]
    _, Din, Dout = gx_w.shape
    like = out.dtype.type(0)  # the model's dtype, for the roundings
    lo = blk * Din
    xs = np.empty((B, Din), np.float32)
    gx = np.empty((B, Dout), np.float32)
    ga = np.empty((B, Dout), np.float32)
    gelu_y = np.empty((B, Dout), out.dtype)
    w_row = np.empty(Dout, np.float32)  # a row of a gate's matrix, widened once for all rows
    _gelu_rows(y_u, lo, exact, gelu_y)
    for b in range(B):  # the Conv1D on the block's channels, channels innermost (row slices: LLVM vectorises)
        x_row, u_row, hi = xs[b], y_u[b, R + lo : R + lo + Din], lo + Din
        last, bias = conv_w[K - 1, lo:hi], conv_b[lo:hi]
        for i in range(Din):  # the model's order and roundings: (u w[K-1] + b), then + x_{t-s} w[K-1-s]
            x_row[i] = _rounded(_rounded(_rounded(widen(u_row[i]), like) * widen(last[i]), like)
                                + widen(bias[i]), like)
        for j in range(K - 2, -1, -1):  # s = K-1-j = 1, ..., K-1
            past, w_j = conv_state[b, j, lo:hi], conv_w[j, lo:hi]
            for i in range(Din):
                x_row[i] = _rounded(x_row[i] + _rounded(widen(past[i]) * widen(w_j[i]), like), like)
        for j in range(K - 2):  # the state shifts by one input
            past, newer = conv_state[b, j, lo:hi], conv_state[b, j + 1, lo:hi]
            for i in range(Din):
                past[i] = newer[i]
        if K > 1:
            past = conv_state[b, K - 2, lo:hi]
            for i in range(Din):
                past[i] = narrow(widen(u_row[i]), like)
    block_product(xs, 0, gx_w, gx_s, gx_b, blk, gx, 0, w_row)  # the gates: this block's (Din, Dout) matrices
    block_product(xs, 0, ga_w, ga_s, ga_b, blk, ga, 0, w_row)
    for b in range(B):  # the RG-LRU step (Section 2.4) and the product with the GeLU branch
        h_row, out_row, scale_row = h[b, lo : lo + Dout], out[b, lo : lo + Dout], log_a_scale[lo : lo + Dout]
        gx_row, ga_row, x_row, y_row = gx[b], ga[b], xs[b], gelu_y[b]  # (slices: LLVM sees consecutive indices)
        for o in range(Dout):
            a = exp_vectorizable(scale_row[o] * sigmoid_vectorizable(_rounded(ga_row[o], like)))  # float64
            multiplier = math.sqrt(1.0 - a * a)
            state = np.float32(a * h_row[o] + multiplier * (sigmoid_vectorizable(_rounded(gx_row[o], like))
                                                            * x_row[o]))
            h_row[o] = state
            out_row[o] = narrow(_rounded(state, like) * widen(y_row[o]), like)


@kernel(parallel=True, fastmath=True, error_model="numpy")
def _recurrent_kernel(y_u, conv_state, conv_w, conv_b, gx_w, gx_b, gx_s, ga_w, ga_b, ga_s, log_a_scale, h, exact, out):
    """:func:`_recurrent_head` of every gate block, a task each."""
    for blk in prange(gx_w.shape[0]):
        _recurrent_head(np.int64(blk), y_u, conv_state, conv_w, conv_b, gx_w, gx_b, gx_s, ga_w, ga_b, ga_s, log_a_scale,
                        h, exact, out)


def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in STEP_DTYPES or t.device.type != "cpu":
        raise ValueError(f"block_step: {name} must be a float32 or bfloat16 CPU tensor, got {t.dtype} on {t.device}")


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in STEP_DTYPES:
        raise ValueError(f"block_step: the model's dtype must be float32 or bfloat16, got {dtype}")


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _rotated(row, base, cos, sin, like, out):
    """out (d,) float32 = one head row[base : base + d] of a projection's output, rounded to the model's dtype (as the
    layer stores it), with RoPE (Section 2.3) on its first 2 half dims: pairs (i, i + half) turn by the angles of
    cos, sin (half,), each product and sum rounded as the model's element-wise operators round them. Mirrors
    :func:`griffin.layers.rope.apply_rope`."""
    half, d = cos.shape[0], out.shape[0]
    for i in range(half):
        x1, x2 = _rounded(widen(row[base + i]), like), _rounded(widen(row[base + half + i]), like)
        c, s = _rounded(widen(cos[i]), like), _rounded(widen(sin[i]), like)
        out[i] = _rounded(_rounded(x1 * c, like) - _rounded(x2 * s, like), like)
        out[half + i] = _rounded(_rounded(x2 * c, like) + _rounded(x1 * s, like), like)
    for i in range(2 * half, d):
        out[i] = _rounded(widen(row[base + i]), like)


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _attention_check(k_cache, count, local):
    """Raise if a global cache has no slot left for the new token (before anything is written)."""
    for b in range(k_cache.shape[0]):
        if not local and count[b] >= k_cache.shape[1]:
            raise ValueError("attention_step: a global attention cache is full")


@kernel(fastmath=True, error_model="numpy")
def _attention_write(qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, out):
    """The new key (with RoPE) and value of each row of qkv written to its cache slot (local: a ring of S slots,
    slot :func:`griffin.layers.attention.cache_slot`), ``count`` advanced: before any query reads the cache. Mirrors
    :meth:`griffin.layers.MultiQueryAttention.attend_ring` and ``attend_cached``'s write at one token."""
    B, S, Hk, d = k_cache.shape
    H = out.shape[1] // d
    like = out.dtype.type(0)
    key = np.empty(d, np.float32)
    for b in range(B):
        slot = cache_slot(count[b], S, local)
        for j in range(Hk):
            _rotated(qkv[b], (H + j) * d, cos[b], sin[b], like, key)
            k_row, v_row, vs = k_cache[b, slot, j], v_cache[b, slot, j], qkv[b, (H + Hk + j) * d : (H + Hk + j + 1) * d]
            for i in range(d):
                k_row[i] = narrow(key[i], like)
                v_row[i] = narrow(widen(vs[i]), like)
        seg_cache[b, slot] = segments[b]
        count[b] += 1


@numba.njit(inline="always")
def _attention_task_count(k_cache, out, per_task):
    """How many tasks :func:`_attention_task` splits the queries into."""
    Hk, d = k_cache.shape[2], k_cache.shape[3]
    return k_cache.shape[0] * Hk * -(-(out.shape[1] // d // Hk) // per_task)


@kernel(fastmath=True, error_model="numpy")
def _attention_task(task, qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots, scale, per_task, out):  # noqa: E501
    """Task ``task`` of the queries (after :func:`_attention_write`): a row b, a key/value head j and ``per_task`` of
    the query heads that share it, each (with RoPE) over the first ``slots`` slots that hold its document
    (``seg_cache`` == ``segments``), global ones up to its own: scores rounded to the model's dtype, softmax in
    float32, probabilities rounded, out (B, H d) their sum of values. Mirrors
    :meth:`griffin.layers.MultiQueryAttention.attend_ring` and ``attend_cached``'s attention at one token."""
    B, S, Hk, d = k_cache.shape
    H = out.shape[1] // d
    G = H // Hk
    like = out.dtype.type(0)
    chunks = -(-G // per_task)
    b, j, g0 = task // (Hk * chunks), (task // chunks) % Hk, (task % chunks) * per_task
    n = min(per_task, G - g0)
    last = slots - 1 if local else count[b] - 1  # the newest slot a query sees
    qs = np.empty((n, d), np.float32)
    for g in range(n):
        _rotated(qkv[b], (j * G + g0 + g) * d, cos[b], sin[b], like, qs[g])
    visible = np.empty(slots, np.int64)  # the slots this row's queries see: their document's, up to their own
    m = 0
    for s in range(min(slots, last + 1)):
        if seg_cache[b, s] == segments[b]:
            visible[m] = s
            m += 1
    rows = np.empty((4, d), np.float32)  # four key or value rows, widened once for the n queries
    probs = np.empty((n, m), np.float32)
    for s0 in range(0, m, 4):  # scores: four key rows at a time against each query
        r = min(4, m - s0)
        for t in range(r):
            k_row, w_row = k_cache[b, visible[s0 + t], j], rows[t]
            for i in range(d):
                w_row[i] = widen(k_row[i])
        for g in range(n):
            q, p_row = qs[g], probs[g]
            if r == 4:
                k0, k1, k2, k3 = rows[0], rows[1], rows[2], rows[3]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for i in range(d):
                    a0 += q[i] * k0[i]
                    a1 += q[i] * k1[i]
                    a2 += q[i] * k2[i]
                    a3 += q[i] * k3[i]
                p_row[s0], p_row[s0 + 1], p_row[s0 + 2], p_row[s0 + 3] = a0, a1, a2, a3
            else:
                for t in range(r):
                    a, k_t = np.float32(0.0), rows[t]
                    for i in range(d):
                        a += q[i] * k_t[i]
                    p_row[s0 + t] = a
    for g in range(n):  # softmax, in float32 of the scores rounded to the model's dtype; then rounded too
        p_row, high, total = probs[g], np.float32(-np.inf), np.float32(0.0)
        for s in range(m):
            p_row[s] = _rounded(np.float32(scale) * p_row[s], like)
            high = max(high, p_row[s])
        for s in range(m):
            p_row[s] = np.float32(exp_vectorizable(np.float64(p_row[s] - high)))
            total += p_row[s]
        for s in range(m):
            p_row[s] = _rounded(p_row[s] / total, like)
    acc_v = np.zeros((n, d), np.float32)
    for s0 in range(0, m, 4):  # the values: four rows at a time into each query's sum
        r = min(4, m - s0)
        for t in range(4):
            w_row = rows[t]
            if t < r:
                v_row = v_cache[b, visible[s0 + t], j]
                for i in range(d):
                    w_row[i] = widen(v_row[i])
            else:
                w_row[:] = 0.0
        v0, v1, v2, v3 = rows[0], rows[1], rows[2], rows[3]
        for g in range(n):
            p_row, a = probs[g], acc_v[g]
            p0 = p_row[s0]
            p1 = p_row[s0 + 1] if r > 1 else np.float32(0.0)
            p2 = p_row[s0 + 2] if r > 2 else np.float32(0.0)
            p3 = p_row[s0 + 3] if r > 3 else np.float32(0.0)
            for i in range(d):
                a[i] += p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i]
    for g in range(n):
        o = out[b, (j * G + g0 + g) * d : (j * G + g0 + g + 1) * d]
        for i in range(d):
            o[i] = narrow(acc_v[g, i], like)


@kernel(parallel=True, fastmath=True, error_model="numpy")
def _attention_kernel(qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots, scale, per_task, out):
    """One token of multi-query attention between its projections (Section 2.3), for qkv (B, (H + 2 H_kv) d) = [q, k,
    v] the rows of the three projections: :func:`_attention_write`, then :func:`_attention_task` of each row,
    key/value head and ``per_task`` of the query heads that share it, a task each."""
    _attention_check(k_cache, count, local)
    _attention_write(qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, out)
    for task in prange(_attention_task_count(k_cache, out, per_task)):
        _attention_task(np.int64(task), qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots,
                        scale, per_task, out)


@dataclass
class RecurrentWeights:
    """A recurrent block's weights as :func:`recurrent_step` reads them, prepared once (views, no copies): the Conv1D's
    w (K, R) and b (R,), the RG-LRU gates' block-diagonal w (H, R/H, R/H) (float, or int8 with float32 scales (H,
    R/H); float gates have an empty one) and b (H, R/H), and log_a_scale = -c softplus(Lambda) (R,) float32, so that
    log a_t = log_a_scale * r_t (Section 2.4)."""

    conv_w: np.ndarray
    conv_b: np.ndarray
    gate_x_w: np.ndarray
    gate_x_b: np.ndarray
    gate_x_s: np.ndarray
    gate_a_w: np.ndarray
    gate_a_b: np.ndarray
    gate_a_s: np.ndarray
    log_a_scale: np.ndarray
    width: int

    @classmethod
    def prepare(cls, conv_w: Tensor, conv_b: Tensor, gate_x: tuple[Tensor, ...], gate_a: tuple[Tensor, ...],
                a_param: Tensor, c: float) -> RecurrentWeights:
        """From the gates' (w, b), or (w, b, scale) for int8 w
        (:class:`griffin.layers.quantized.Int8BlockDiagonalLinear`)."""
        K, R = conv_w.shape
        tensors = {"conv_w": conv_w, "conv_b": conv_b, "gate_x_b": gate_x[1], "gate_a_b": gate_a[1]}
        for name, t in tensors.items():
            _check_dtype(name, t)
            if not t.is_contiguous():
                raise ValueError(f"recurrent_step: {name} must be contiguous")
        if gate_x[0].dtype != gate_a[0].dtype or gate_x[0].dim() != 3:
            raise ValueError(f"recurrent_step: the gates' weights must be (H, R/H, R/H) of one dtype, got "
                             f"{gate_x[0].dtype} {tuple(gate_x[0].shape)} and {gate_a[0].dtype}")
        H = gate_x[0].shape[0]
        if (conv_b.shape != (R,) or H * (R // H) != R or gate_x[0].shape != (H, R // H, R // H)
                or gate_a[0].shape != gate_x[0].shape or gate_x[1].shape != (H, R // H)
                or gate_a[1].shape != gate_x[1].shape or a_param.shape != (R,)):
            raise ValueError(f"recurrent_step: the weights do not fit width {R}: conv_b {tuple(conv_b.shape)}, gates "
                             f"{tuple(gate_x[0].shape)} / {tuple(gate_a[0].shape)} (need (H, {R}/H, {R}/H)), "
                             f"biases {tuple(gate_x[1].shape)} / {tuple(gate_a[1].shape)}, a_param "
                             f"{tuple(a_param.shape)}")
        gates = [gate_arrays(g[0], g[2] if len(g) > 2 else None) for g in (gate_x, gate_a)]
        log_a_scale = (-c * torch.nn.functional.softplus(a_param.detach().float())).contiguous()
        return cls(storage(conv_w.detach()), storage(conv_b.detach()), gates[0][0], storage(gate_x[1].detach()),
                   gates[0][1], gates[1][0], storage(gate_a[1].detach()), gates[1][1], log_a_scale.numpy(), R)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(conv_w, conv_b, gate_x_w, gate_x_b, gate_x_s, gate_a_w, gate_a_b, gate_a_s, log_a_scale), as the kernels
        take them."""
        return (self.conv_w, self.conv_b, self.gate_x_w, self.gate_x_b, self.gate_x_s, self.gate_a_w, self.gate_a_b,
                self.gate_a_s, self.log_a_scale)


def rms_norm_step(x: Tensor, scale: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """RMSNorm (:class:`griffin.layers.RMSNorm`) of rows x (B, D), or of x + delta (the residual add before it):
    returns (x + delta, or x itself; the normalised rows), in x's dtype."""
    for name, t in (("x", x), ("scale", scale)) + ((("delta", delta),) if delta is not None else ()):
        _check_dtype(name, t)
    if x.dim() != 2 or scale.shape != x.shape[1:] or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"rms_norm_step: x (B, D), scale (D,) and delta like x, got {tuple(x.shape)}, "
                         f"{tuple(scale.shape)}, {None if delta is None else tuple(delta.shape)}")
    out = torch.empty_like(x)
    if delta is None:
        _rms_norm_kernel(storage(x), storage(scale.detach()), float(eps), storage(out))
        return x, out
    residual = torch.empty_like(x)
    _add_rms_norm_kernel(storage(x), storage(delta), storage(scale.detach()), float(eps), storage(residual),
                         storage(out))
    return residual, out


def gelu_product_step(gate_up: Tensor, approximation: str, dtype: torch.dtype) -> Tensor:
    """GeLU(gate) * up (the gated MLP's, Section 2.2) for gate_up (B, 2M) = [gate, up], the rows of its two branches
    as the matmuls give them (float32 or the model's dtype): (B, M) in ``dtype``."""
    _check_dtype("gate_up", gate_up)
    _check_out_dtype(dtype)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gelu_product_step: gate_up must be (B, 2M), got {tuple(gate_up.shape)}")
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=dtype)
    _gelu_product_kernel(storage(gate_up.contiguous()), _exact(approximation), storage(out))
    return out


def _check_recurrent(name: str, y_u_shape: tuple[int, ...], conv_state: Tensor, h: Tensor, weights: RecurrentWeights,
                     dtype: torch.dtype) -> None:
    """The recurrent kernel's inputs: its projections' rows y_u (B, 2R), the block's cache ``conv_state`` (B, K-1, R)
    in ``dtype`` and ``h`` (B, R) float32."""
    B, R, K = y_u_shape[0], weights.width, weights.conv_w.shape[0]
    if y_u_shape != (B, 2 * R) or conv_state.shape != (B, K - 1, R) or h.shape != (B, R):
        raise ValueError(f"{name}: for width {R}, y_u must be (B, {2 * R}), conv_state (B, {K - 1}, {R}) and h (B, "
                         f"{R}), got {y_u_shape}, {tuple(conv_state.shape)}, {tuple(h.shape)}")
    if h.dtype != torch.float32 or conv_state.dtype != dtype:
        raise ValueError(f"{name}: h must be float32 and conv_state {dtype}, got {h.dtype}, {conv_state.dtype}")


def recurrent_step(y_u: Tensor, conv_state: Tensor, h: Tensor, weights: RecurrentWeights, approximation: str,
                   dtype: torch.dtype) -> Tensor:
    """The recurrent block between its projections for one token per row (:func:`_recurrent_kernel`): y_u (B, 2R) =
    [y, u] the two branches' projections, ``conv_state`` (B, K-1, R) (in ``dtype``, the model's) and ``h`` (B, R)
    float32 the block's cache, updated in place. Returns the input of the output projection (B, R) in ``dtype``."""
    _check_dtype("y_u", y_u)
    _check_out_dtype(dtype)
    _check_recurrent("recurrent_step", tuple(y_u.shape), conv_state, h, weights, dtype)
    B, R = y_u.shape[0], weights.width
    out = torch.empty(B, R, dtype=dtype)
    parallel_ready()
    _recurrent_kernel(storage(y_u.contiguous()), storage(conv_state), *weights.arrays(), h.numpy(),
                      _exact(approximation), storage(out))
    return out


def _attention_arguments(name: str, qkv_shape: tuple[int, ...], rope: tuple[Tensor, Tensor] | None, k_cache: Tensor,
                         v_cache: Tensor, segment_cache: Tensor, count: Tensor, segments: Tensor, local: bool,
                         slots: int, scale: float, dtype: torch.dtype) -> tuple[int, int, tuple]:
    """The attention kernel's inputs after qkv, checked (:func:`attention_step`'s): (H, d, (cos, sin, k_cache, v_cache,
    segment_cache, count, segments, local, slots, scale, query heads per task)) for rows of qkv ``qkv_shape``."""
    B, S, Hk, d = k_cache.shape
    H = qkv_shape[-1] // d - 2 * Hk if len(qkv_shape) == 2 else 0
    if (len(qkv_shape) != 2 or qkv_shape[0] != B or H < Hk or H % Hk or qkv_shape[1] != (H + 2 * Hk) * d
            or v_cache.shape != k_cache.shape or segment_cache.shape != (B, S) or count.shape != (B,)
            or segments.shape != (B, 1) or not 0 < slots <= S):
        raise ValueError(f"{name}: for a cache of {tuple(k_cache.shape)} (B, S, H_kv, d), qkv must be (B, (H + 2 "
                         f"H_kv) d) with H a multiple of H_kv, v_cache like k_cache, segment_cache (B, S), count (B,), "
                         f"segments (B, 1) and 0 < slots <= S; got qkv {qkv_shape}, v_cache {tuple(v_cache.shape)}, "
                         f"segment_cache {tuple(segment_cache.shape)}, count {tuple(count.shape)}, segments "
                         f"{tuple(segments.shape)}, slots {slots}")
    if k_cache.dtype != dtype or v_cache.dtype != dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: the caches must be contiguous {dtype}, got {k_cache.dtype}, {v_cache.dtype}")
    if any(t.dtype != torch.int64 for t in (segment_cache, count, segments)) or not (
            segment_cache.is_contiguous() and count.is_contiguous()):
        raise ValueError(f"{name}: segment_cache, count (contiguous: written in place) and segments must be int64")
    cos, sin = _rope_arrays(name, rope, B, d)
    tasks = max(1, -(-numba.get_num_threads() // (B * Hk)))  # tasks per row and key/value head
    return H, d, (cos, sin, storage(k_cache), storage(v_cache), segment_cache.numpy(), count.numpy(),
                  segments.reshape(B).contiguous().numpy(), local, slots, float(scale), -(-(H // Hk) // tasks))


def _rope_arrays(name: str, rope: tuple[Tensor, Tensor] | None, B: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """The (cos, sin) (B, 1, half) of a step's tokens as the attention kernel reads them, (B, half) each, checked
    (None: no RoPE, half 0)."""
    cos, sin = (torch.empty(B, 0), torch.empty(B, 0)) if rope is None else (t.reshape(B, -1) for t in rope)
    if cos.dtype not in STEP_DTYPES or sin.dtype != cos.dtype or sin.shape != cos.shape or 2 * cos.shape[1] > d:
        raise ValueError(f"{name}: rope must be float32 or bfloat16 (cos, sin), each (B, 1, half) with half <= "
                         f"{d // 2}, got {tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} {sin.dtype}")
    return storage(cos.contiguous()), storage(sin.contiguous())


def attention_step(qkv: Tensor, rope: tuple[Tensor, Tensor] | None, k_cache: Tensor, v_cache: Tensor,
                   segment_cache: Tensor, count: Tensor, segments: Tensor, local: bool, slots: int, scale: float,
                   dtype: torch.dtype) -> Tensor:
    """Multi-query attention between its projections for one token per row (:func:`_attention_kernel`): qkv (B,
    (H + 2 H_kv) d) = [q, k, v] the projections' rows (float32 or ``dtype``), ``rope`` the (cos, sin) (B, 1, half)
    of the tokens' positions (float32 or ``dtype``; None: no RoPE), the block's cache (k_cache, v_cache (B, S, H_kv,
    d) in ``dtype``, segment_cache (B, S) and count (B,) int64: local a ring of S slots, global one slot per step, of
    which the first ``slots`` are read), updated in place, and ``segments`` (B, 1) the tokens' document ids. Returns
    the input of the output projection (B, H d) in ``dtype``."""
    _check_dtype("qkv", qkv)
    _check_out_dtype(dtype)
    H, d, cache = _attention_arguments("attention_step", tuple(qkv.shape), rope, k_cache, v_cache, segment_cache,
                                       count, segments, local, slots, scale, dtype)
    out = torch.empty(qkv.shape[0], H * d, dtype=dtype)
    parallel_ready()
    _attention_kernel(storage(qkv.contiguous()), *cache, storage(out))
    return out


def _exact(approximation: str) -> bool:
    if approximation not in ("none", "tanh"):
        raise ValueError(f"block_step: GeLU approximation must be 'none' or 'tanh', got {approximation!r}")
    return approximation == "none"


# A residual block's whole step in one call, and in one parallel region: these kernels' tasks around the block's four
# weight matmuls (:func:`griffin.inference.cpu.matvec.rows_task`), in phases that the threads share
# (:mod:`griffin.inference.cpu.tasks`). A call per block from Python instead of about eight (each with its checks, views
# and allocations), and one wake-up of the sleeping threads instead of one per kernel (five or six per block).


@numba.njit(inline="always")
def _matmul_phase(c, phase, worker, x, buffers, m, settings, out):
    """Phase ``phase``: out = x times the matrices m (:meth:`MatvecWeights.kernel_args`), a task per tile, x prepared
    into ``buffers`` (:func:`griffin.inference.cpu.matvec.prepare_rows`) by a phase before."""
    tiles = m[1].shape[0]
    t = claim(c, phase, worker, tiles)
    while t < tiles:
        rows_task(t, x, buffers, m[0], m[1], m[2], m[3], m[4], settings, out)
        finish(c, phase, worker)
        t = claim(c, phase, worker, tiles)
    wait(c, phase, tiles)


@numba.njit(inline="always", fastmath=True, error_model="numpy")
def _projection_in(c, worker, x, norms, mixer_in, settings, normed, in_buffers, out):
    """Phases 0-1 of a temporal half: the pre-norm of rows x (and their preparation for the matmul), then out = the
    normed rows times ``mixer_in``."""
    if single(c, 0):
        for b in range(x.shape[0]):
            _normalise(x[b], norms[0], norms[1], normed[b])
        prepare_rows(normed, mixer_in[0], settings, in_buffers)
        finish(c, 0, worker)
    wait(c, 0, 1)
    _matmul_phase(c, 1, worker, normed, in_buffers, mixer_in, settings, out)


@numba.njit(inline="always")
def _projection_out(c, phase, worker, hidden, mixer_out, settings, out_buffers, mixed):
    """Phases ``phase`` and ``phase`` + 1 of a temporal half: the preparation of ``hidden`` for the matmul, then
    mixed = hidden times ``mixer_out``."""
    if single(c, phase):
        prepare_rows(hidden, mixer_out[0], settings, out_buffers)
        finish(c, phase, worker)
    wait(c, phase, 1)
    _matmul_phase(c, phase + 1, worker, hidden, out_buffers, mixer_out, settings, mixed)


MLP_PHASES = 5  # phases of :func:`_mlp_tasks`


@numba.njit(fastmath=True, error_model="numpy")
def _mlp_tasks(c, first, worker, x, mixed, scale, eps, up, down, exact, settings, residual, normed, up_in, gate_up, hidden,  # noqa: E501
               down_in, down_out, out):
    """The channel half of a residual block for rows x (B, D), the share of ``worker`` from phase ``first`` on:
    residual = x + mixed (the temporal block's output in float32, first rounded as its layer's output), RMSNorm, the
    gated MLP (``up``, ``down``), out = residual + its output, everything rounded where the model rounds. The buffers
    between are :func:`_mlp_buffers`'."""
    like = out.dtype.type(0)
    B, D = x.shape
    if single(c, first):
        for b in range(B):
            for d in range(D):
                residual[b, d] = narrow(widen(x[b, d]) + _rounded(mixed[b, d], like), like)
            _normalise(residual[b], scale, eps, normed[b])
        prepare_rows(normed, up[0], settings, up_in)
        finish(c, first, worker)
    wait(c, first, 1)
    _matmul_phase(c, first + 1, worker, normed, up_in, up, settings, gate_up)
    if single(c, first + 2):
        _gelu_product_kernel(gate_up, exact, hidden)
        prepare_rows(hidden, down[0], settings, down_in)
        finish(c, first + 2, worker)
    wait(c, first + 2, 1)
    _matmul_phase(c, first + 3, worker, hidden, down_in, down, settings, down_out)
    if single(c, first + 4):
        for b in range(B):
            for d in range(D):
                out[b, d] = narrow(widen(residual[b, d]) + _rounded(down_out[b, d], like), like)
        finish(c, first + 4, worker)


@numba.njit
def _mlp_buffers(x, up):
    """What :func:`_mlp_tasks`' phases share, for rows x (B, D) and the MLP's ``up`` matrices."""
    B, D = x.shape
    normed = np.empty_like(x)
    hidden = np.empty((B, up[3].shape[0] // 2), x.dtype)
    return (np.empty_like(x), normed, rows_buffers(normed), np.empty((B, up[3].shape[0]), np.float32), hidden,
            rows_buffers(hidden), np.empty((B, D), np.float32))


@numba.njit(fastmath=True, error_model="numpy")
def _recurrent_tasks(c, worker, x, norms, mixer_in, mixer_out, conv_state, h, rec, exact, settings, normed, in_buffers, y_u,  # noqa: E501
                     hidden, out_buffers, mixed):
    """A thread's share of the temporal half of a residual block with a recurrent block (Figure 2a, c), phases 0-4:
    the pre-norm, the input projections, a task per gate block (:func:`_recurrent_head`), the output projection
    into ``mixed`` (the temporal block's output, float32). The buffers between are :func:`_mixer_buffers`'."""
    _projection_in(c, worker, x, norms, mixer_in, settings, normed, in_buffers, y_u)
    blocks = rec[2].shape[0]
    blk = claim(c, 2, worker, blocks)
    while blk < blocks:
        _recurrent_head(blk, y_u, conv_state, rec[0], rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7], rec[8], h,
                        exact, hidden)
        finish(c, 2, worker)
        blk = claim(c, 2, worker, blocks)
    wait(c, 2, blocks)
    _projection_out(c, 3, worker, hidden, mixer_out, settings, out_buffers, mixed)


@numba.njit(inline="always")
def _split(m):
    """(the matrices, the rest) of :meth:`MatvecWeights.kernel_args`: each a tuple one level deep."""
    return m[0], m[1:]


@numba.njit
def _mixer_buffers(x, mixer_in, mixer_out):
    """What the temporal half's phases share, for rows x (B, D): (normed rows, their matmul buffers, the input
    projections' output, the output projection's input and its buffers, the temporal block's output)."""
    B, D = x.shape
    normed = np.empty_like(x)
    hidden = np.empty((B, mixer_out[0][0].shape[1]), x.dtype)
    return (normed, rows_buffers(normed), np.empty((B, mixer_in[3].shape[0]), np.float32), hidden,
            rows_buffers(hidden), np.empty((B, D), np.float32))


@kernel(parallel=PRANGE_ONLY, fastmath=True, error_model="numpy")
def _recurrent_block_kernel(x, norms, mixer_in, mixer_out, up, down, conv_state, h, rec, exact, settings, threads, out):
    """A residual block with a recurrent temporal block (Figure 2a, c) for rows x (B, D) into out (B, D): one
    parallel region in which each of ``threads`` runs :func:`_recurrent_tasks`, then :func:`_mlp_tasks`."""
    normed, in_buffers, y_u, hidden, out_buffers, mixed = _mixer_buffers(x, mixer_in, mixer_out)
    residual, normed_2, up_in, gate_up, hidden_2, down_in, down_out = _mlp_buffers(x, up)
    (w_in, m_in), (w_out, m_out), (w_up, m_up), (w_down, m_down) = _split(mixer_in), _split(mixer_out), _split(up), \
        _split(down)
    c = counters(5 + MLP_PHASES, threads)
    for w in prange(threads):  # (numba passes a prange's tuples to its threads one level deep: rebuilt here)
        worker = np.int64(w)
        _recurrent_tasks(c, worker, x, norms, (w_in,) + m_in, (w_out,) + m_out, conv_state, h, rec, exact, settings,
                         normed, in_buffers, y_u, hidden, out_buffers, mixed)
        _mlp_tasks(c, np.int64(5), worker, x, mixed, norms[2], norms[3], (w_up,) + m_up, (w_down,) + m_down, exact,
                   settings, residual, normed_2, up_in, gate_up, hidden_2, down_in, down_out, out)


@numba.njit(fastmath=True, error_model="numpy")
def _attention_tasks_of_thread(c, worker, x, norms, mixer_in, mixer_out, cache, settings, normed, in_buffers, qkv, hidden,  # noqa: E501
                               out_buffers, mixed):
    """A thread's share of the temporal half of a residual block with multi-query attention (Figure 2a, Section
    2.3), phases 0-5: the pre-norm, the q/k/v projections, the cache write (:func:`_attention_write`), the queries'
    tasks (:func:`_attention_task`), the output projection into ``mixed``. The buffers between are
    :func:`_mixer_buffers`'."""
    cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots, scale, per_task = cache
    _projection_in(c, worker, x, norms, mixer_in, settings, normed, in_buffers, qkv)
    if single(c, 2):
        _attention_write(qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, hidden)
        finish(c, 2, worker)
    wait(c, 2, 1)
    tasks = _attention_task_count(k_cache, hidden, per_task)
    task = claim(c, 3, worker, tasks)
    while task < tasks:
        _attention_task(task, qkv, cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots, scale,
                        per_task, hidden)
        finish(c, 3, worker)
        task = claim(c, 3, worker, tasks)
    wait(c, 3, tasks)
    _projection_out(c, 4, worker, hidden, mixer_out, settings, out_buffers, mixed)


@kernel(parallel=PRANGE_ONLY, fastmath=True, error_model="numpy")
def _attention_block_kernel(x, norms, mixer_in, mixer_out, up, down, cache, exact, settings, threads, out):
    """A residual block with multi-query attention (Figure 2a, Section 2.3) for rows x (B, D) into out (B, D), the
    cache as :func:`_attention_kernel` takes it (a tuple): one parallel region in which each of ``threads`` runs
    :func:`_attention_tasks_of_thread`, then :func:`_mlp_tasks`."""
    _attention_check(cache[2], cache[5], cache[7])
    normed, in_buffers, qkv, hidden, out_buffers, mixed = _mixer_buffers(x, mixer_in, mixer_out)
    residual, normed_2, up_in, gate_up, hidden_2, down_in, down_out = _mlp_buffers(x, up)
    (w_in, m_in), (w_out, m_out), (w_up, m_up), (w_down, m_down) = _split(mixer_in), _split(mixer_out), _split(up), \
        _split(down)
    c = counters(6 + MLP_PHASES, threads)
    for w in prange(threads):  # (as in :func:`_recurrent_block_kernel`)
        worker = np.int64(w)
        _attention_tasks_of_thread(c, worker, x, norms, (w_in,) + m_in, (w_out,) + m_out, cache, settings, normed,
                                   in_buffers, qkv, hidden, out_buffers, mixed)
        _mlp_tasks(c, np.int64(6), worker, x, mixed, norms[2], norms[3], (w_up,) + m_up, (w_down,) + m_down, exact,
                   settings, residual, normed_2, up_in, gate_up, hidden_2, down_in, down_out, out)


@dataclass
class BlockStep:
    """A residual block's weights as its one-call step reads them, prepared once (views, no copies): the two RMSNorms'
    scales and eps, the temporal block's input and output projections (``mixer_in``: the recurrent block's two
    branches or attention's q/k/v; ``mixer_out``) and the MLP's (``up``: its two branches; ``down``) as
    :meth:`griffin.inference.cpu.matvec.MatvecWeights.kernel_args`, and whether the GeLU is exact."""

    norms: tuple[np.ndarray, float, np.ndarray, float]
    mixer_in: tuple
    mixer_out: tuple
    up: tuple
    down: tuple
    exact: bool
    dtype: torch.dtype
    width: int

    @classmethod
    def prepare(cls, norm_scales: tuple[Tensor, Tensor], eps: tuple[float, float], mixer_in: MatvecWeights,
                mixer_out: MatvecWeights, up: MatvecWeights, down: MatvecWeights, approximation: str) -> BlockStep:
        dtype, D = norm_scales[0].dtype, norm_scales[0].shape[0]
        for name, t in (("temporal norm scale", norm_scales[0]), ("channel norm scale", norm_scales[1])):
            _check_dtype(name, t)
            if t.dtype != dtype or t.shape != (D,) or not t.is_contiguous():
                raise ValueError(f"BlockStep: the norm scales must be contiguous ({D},) {dtype}, got {name} "
                                 f"{tuple(t.shape)} {t.dtype}")
        shapes = [(m.in_features, m.out_features) for m in (mixer_in, mixer_out, up, down)]
        if (mixer_in.in_features != D or mixer_out.out_features != D or up.in_features != D or up.out_features % 2
                or down.in_features != up.out_features // 2 or down.out_features != D):
            raise ValueError(f"BlockStep: the projections (in, out) {shapes} (mixer in, mixer out, MLP up, MLP down) "
                             f"do not fit width {D}")
        norms = (storage(norm_scales[0].detach()), float(eps[0]), storage(norm_scales[1].detach()), float(eps[1]))
        return cls(norms, mixer_in.kernel_args(), mixer_out.kernel_args(), up.kernel_args(), down.kernel_args(),
                   _exact(approximation), dtype, D)


# A decode step's whole stack of residual blocks in one call from Python: a compiled loop over the blocks that calls
# each block's kernel above (:func:`_recurrent_block_kernel`, :func:`_attention_block_kernel`), the next block reading
# the one before's output. No Python, checks or allocations of tensors between the blocks. The blocks' weights and
# caches are prepared once per cache (:func:`stack_blocks`), in two typed lists (one per kind of temporal block, an
# item per block), so that a call unboxes two lists instead of every block's arrays. (One parallel region for the whole
# stack was slower: the arrays a thread takes from a list inside a region are not the region's arguments, and numba's
# code for the tasks on them ran slower, docs/performance.md.)

RECURRENT, ATTENTION = 0, 1  # the kinds of :func:`stack_step`'s ``order``


def _stack_recurrent(items, i, x, settings, threads, out):
    """Recurrent block i of ``items`` (None: the model has none) for rows x into out."""
    raise NotImplementedError  # numba only


@overload(_stack_recurrent)
def _stack_recurrent_impl(items, i, x, settings, threads, out):
    if isinstance(items, types.NoneType):
        return lambda items, i, x, settings, threads, out: None

    def run(items, i, x, settings, threads, out):
        norms, mixer_in, mixer_out, up, down, exact, conv_state, h, rec = items[i]
        _recurrent_block_kernel(x, norms, mixer_in, mixer_out, up, down, conv_state, h, rec, exact, settings, threads,
                                out)

    return run


def _stack_attention(items, i, x, step, settings, threads, out):
    """Attention block i of ``items`` (None: the model has none) for rows x into out; ``step`` = (cos, sin, segments,
    cache_len) of this step's tokens."""
    raise NotImplementedError  # numba only


@overload(_stack_attention)
def _stack_attention_impl(items, i, x, step, settings, threads, out):
    if isinstance(items, types.NoneType):
        return lambda items, i, x, step, settings, threads, out: None

    def run(items, i, x, step, settings, threads, out):
        (norms, mixer_in, mixer_out, up, down, exact, k_cache, v_cache, seg_cache, count, local, scale,
         per_task) = items[i]
        cos, sin, segments, cache_len = step
        S = k_cache.shape[1]
        slots = S if local or cache_len < 0 else min(cache_len, S)
        cache = (cos, sin, k_cache, v_cache, seg_cache, count, segments, local, slots, scale, per_task)
        _attention_block_kernel(x, norms, mixer_in, mixer_out, up, down, cache, exact, settings, threads, out)

    return run


def _check_attention_caches(items):
    raise NotImplementedError  # numba only


@overload(_check_attention_caches)
def _check_attention_caches_impl(items):
    if isinstance(items, types.NoneType):
        return lambda items: None

    def check(items):
        for i in range(len(items)):
            item = items[i]
            _attention_check(item[6], item[9], item[10])  # (k_cache, count, local)

    return check


@kernel(fastmath=True, error_model="numpy")
def _stack_kernel(x, recurrent, attention, order, step, settings, threads, out):
    """The residual blocks in ``order`` ((kind, index in its list) per block) for rows x (B, D) into out (B, D), every
    global attention cache checked for room first (so that a full one stops the step before any block writes)."""
    _check_attention_caches(attention)
    n = order.shape[0]
    ping, pong = np.empty_like(x), np.empty_like(x)
    for k in range(n):
        source = x if k == 0 else (ping if k % 2 == 1 else pong)
        target = out if k == n - 1 else (ping if k % 2 == 0 else pong)
        if order[k, 0] == RECURRENT:
            _stack_recurrent(recurrent, order[k, 1], source, settings, threads, target)
        else:
            _stack_attention(attention, order[k, 1], source, step, settings, threads, target)


@dataclass
class Stack:
    """A decode step's residual blocks prepared for :func:`stack_step` on one cache: per kind of temporal block, a
    typed list of the blocks' weights and caches (views of the cache's tensors, updated in place by each step);
    ``order`` the blocks' (kind, index in its list)."""

    recurrent: numba.typed.List | None
    attention: numba.typed.List | None
    order: np.ndarray
    width: int
    dtype: torch.dtype
    batch_size: int
    head_dim: int  # the attention blocks' (0: none)


@kernel()
def _typed_list(items):
    """A typed list of a tuple's items (all of one type), built in a cached kernel: appended to from Python, the
    list compiles its methods afresh in every process (seconds at the first decode step)."""
    out = numba.typed.List()
    for item in items:
        out.append(item)
    return out


def stack_blocks(blocks: list[tuple[BlockStep, RecurrentWeights | None, object]], batch_size: int) -> Stack:
    """The blocks (in order: each its :class:`BlockStep`, its :class:`RecurrentWeights` or None for multi-query
    attention, and its cache: ``(conv_state, h)`` for a recurrent block as :func:`recurrent_step` takes them,
    ``(k_cache, v_cache, segment_cache, count, local, scale)`` for attention as :func:`attention_step` does)
    prepared for :func:`stack_step` on ``batch_size`` rows. Raises ValueError where a block or cache does not fit."""
    if not blocks:
        raise ValueError("stack_blocks: no blocks")
    first = blocks[0][0]
    B = batch_size
    recurrent, attention, order, head_dim = [], [], [], 0
    for k, (block, weights, cache) in enumerate(blocks):
        if block.width != first.width or block.dtype != first.dtype:
            raise ValueError(f"stack_blocks: block {k} is ({block.width}, {block.dtype}), block 0 ({first.width}, "
                             f"{first.dtype})")
        shared = (block.norms, block.mixer_in, block.mixer_out, block.up, block.down, block.exact)
        if weights is not None:
            conv_state, h = cache
            _check_recurrent("stack_blocks", (B, block.mixer_in[3].shape[0]), conv_state, h, weights, block.dtype)
            if block.mixer_out[0][0].shape[1] != weights.width:
                raise ValueError(f"stack_blocks: block {k}'s output projection reads {block.mixer_out[0][0].shape[1]} "
                                 f"inputs, not its recurrent width {weights.width}")
            order.append((RECURRENT, len(recurrent)))
            recurrent.append((*shared, storage(conv_state), h.numpy(), weights.arrays()))
        else:
            k_cache, v_cache, segment_cache, count, local, scale = cache
            S = k_cache.shape[1]
            H, d, arrays = _attention_arguments("stack_blocks", (B, block.mixer_in[3].shape[0]), None, k_cache,
                                                v_cache, segment_cache, count, torch.zeros(B, 1, dtype=torch.int64),
                                                bool(local), S, scale, block.dtype)
            if block.mixer_out[0][0].shape[1] != H * d:
                raise ValueError(f"stack_blocks: block {k}'s output projection reads {block.mixer_out[0][0].shape[1]} "
                                 f"inputs, not the {H} heads of {d}")
            _, _, k_st, v_st, seg, cnt, _, local, _, scale, per_task = arrays
            head_dim = d
            order.append((ATTENTION, len(attention)))
            attention.append((*shared, k_st, v_st, seg, cnt, local, scale, per_task))
    lists = [_typed_list(tuple(items)) if items else None for items in (recurrent, attention)]
    return Stack(*lists, np.array(order, np.int64).reshape(-1, 2), first.width, first.dtype, batch_size, head_dim)


def stack_step(x: Tensor, stack: Stack, rope: tuple[Tensor, Tensor] | None, segments: Tensor | None,
               cache_len: int | None) -> Tensor:
    """The stack's residual blocks, one token of each row of x (B, D) (the residual stream) in one call: what the
    blocks compute one after the other (:class:`griffin.model.ResidualBlock`), their caches
    updated in place. ``rope`` and ``segments`` (B, 1) are the step's tokens' (as :func:`attention_step` takes them;
    unused without attention blocks), ``cache_len`` the tokens a global attention cache holds after this step (None:
    every slot). Returns the last block's output (B, D) in x's dtype."""
    if x.dim() != 2 or x.shape != (stack.batch_size, stack.width) or x.dtype != stack.dtype or (
            x.device.type != "cpu" or not x.is_contiguous()):
        raise ValueError(f"stack_step: x must be contiguous ({stack.batch_size}, {stack.width}) {stack.dtype} CPU "
                         f"rows, got {tuple(x.shape)} {x.dtype} on {x.device}")
    B = x.shape[0]
    if stack.attention is not None:
        cos, sin = _rope_arrays("stack_step", rope, B, stack.head_dim)
        if segments is None or segments.shape != (B, 1) or segments.dtype != torch.int64:
            raise ValueError(f"stack_step: segments must be ({B}, 1) int64, got "
                             f"{None if segments is None else (tuple(segments.shape), segments.dtype)}")
        ids = segments.reshape(B).contiguous().numpy()
    else:
        cos = sin = np.empty((B, 0), np.float32)
        ids = np.zeros(B, np.int64)
    out = torch.empty_like(x)
    parallel_ready()
    _stack_kernel(storage(x), stack.recurrent, stack.attention, stack.order,
                  (cos, sin, ids, -1 if cache_len is None else int(cache_len)), matvec_module.kernel_settings(),
                  numba.get_num_threads(), storage(out))
    return out
