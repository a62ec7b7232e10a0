"""Fused RG-LRU in Triton: gate math and linear scan in one pass over memory (paper, Section 2.4 and Section 4.2).

Section 4.2 observes that the RG-LRU does about one multiply-add per byte it touches, so it is bound by memory
traffic, and that the winning kernel keeps the state on chip and moves each input once (their Pallas kernel on
TPU). This module does the same on GPUs:

* forward reads x, gate_x, gate_a once, computes the gates in float32 (``log a_t = -c softplus(Lambda) r_t``,
  Appendix A) and writes y once. The only extra output is one float32 state per backward time tile (a
  checkpoint every 16 steps on CUDA: 1/32 of y's bytes in bf16) kept for the backward pass.
* backward reads x, gate_x, gate_a and dy once, recomputes the gates and, from the checkpoints, the forward
  state (or, with ``save_states``, reads the float32 state the forward kept for every step: 4 bytes an element
  more, one scan fewer), runs the reverse scan and writes dx, dgate_x, dgate_a once. The gradient of
  ``-c softplus(Lambda)`` is summed per program (no atomics) and reduced by torch afterwards; the chain rule to
  Lambda is torch's.
* a program owns ``BLOCK_D`` channels of one sequence and walks time in tiles of ``BLOCK_T`` steps; inside a
  tile the recurrence is a ``tl.associative_scan`` over (a, b) pairs. Carries are products of a_t in [0, 1];
  nothing is divided, so any length is stable.
* when batch x channels gives too few programs to fill the GPU, time is also split into chunks scanned in
  parallel (chunked variant): a summary pass computes each chunk's (prod a, h from zero), a small kernel carries
  the state across chunks, and the final pass rescans every chunk from its true initial state. It reads the
  inputs twice, so :func:`select_config` picks it only when batch x channels is small (e.g. B=1, D=2560); on an
  H100 it won there and lost at B=8, D=1024 (docs/performance.md).

Shapes follow :mod:`griffin.ops.scan`: x and the gates (B, T, D) in bf16/fp16/fp32, h0 (B, D), reset (B, T) bool;
y has x's dtype, h_last is float32 (B, D). The sqrt in ``sqrt(1 - a_t^2)`` has its derivative clipped exactly as
:class:`griffin.ops.rg_lru.SqrtBoundDerivative` (d sqrt(u)/du = 1 / sqrt(max(4u, 1e-6))).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from griffin.ops.rg_lru.reference import MAX_SQRT_GRADIENT, check_rg_lru_inputs

# Constants are constexpr (Triton refuses other globals in a kernel); each stands to the right of a tensor operand:
# in Triton 3.9's interpreter ``constexpr * tensor`` gives a constexpr wrapping the tensor, which tl.exp2 refuses.
_MIN_4U = tl.constexpr(1.0 / MAX_SQRT_GRADIENT**2)  # clip of 4u in the sqrt derivative
_LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))


@dataclass(frozen=True)
class KernelConfig:
    """One launch: time tile, channels per program, time per chunk, warps, software-pipelining depth."""

    block_t: int
    block_d: int
    chunk_t: int
    num_warps: int
    num_stages: int = 2

    def meta(self) -> dict[str, int]:
        """The launch arguments of the scan kernels for this configuration."""
        return dict(NUM_STAGES=self.num_stages, BLOCK_T=self.block_t, BLOCK_D=self.block_d, num_warps=self.num_warps)


# Read once: the kernels below are defined for one mode, and torch.compile cannot trace Triton's environment lookup
# (a call into its C extension) inside rg_lru_triton.
INTERPRETED = bool(triton.knobs.runtime.interpret)
# rg_lru_triton's save_states default (see there); read once, for the same reason
_STATES_ENV = os.environ.get("GRIFFIN_RG_LRU_STATES", "0")
if _STATES_ENV not in ("", "0", "1"):
    raise ValueError(f"GRIFFIN_RG_LRU_STATES={_STATES_ENV!r}: expected 1 (the backward from kept states) or 0 (not)")
SAVE_STATES = _STATES_ENV == "1"

if INTERPRETED:  # the interpreter runs no PTX

    @triton.jit
    def _exp2(x):
        return tl.exp2(x)

    @triton.jit
    def _rcp(x):
        return 1.0 / x

else:  # one MUFU instruction each: the kernels issue ~100 instructions per element, so these matter

    @triton.jit
    def _exp2(x):
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], tl.float32, True, 1)

    @triton.jit
    def _rcp(x):
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], tl.float32, True, 1)


@triton.jit
def _sigmoid(x):
    return _rcp(1.0 + _exp2(x * (-_LOG2E)))


@triton.jit
def _scan_combine(a1, b1, a2, b2):
    """Compose h -> a1 h + b1 (first) with h -> a2 h + b2 (second)."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _adjoint_combine(f1, u1, v1, f2, u2, v2):
    """Reverse-time composition for dh_t = g_t + a_{t+1} dh_{t+1}.

    A segment [i, j] maps the carry s = a_{j+1} dh_{j+1} entering from the right to dh_i = u s + v; f = a_i.
    Segment 1 is the later one (already scanned), segment 2 the earlier one.
    """
    w = u2 * f1
    return f2, w * u1, v2 + w * v1


@triton.jit
def _load_step(
    p0, p1, p2, p3, reset_ptr, seq, t0, t_end, D, rows, tile, col_ok,
    N: tl.constexpr, HAS_RESET: tl.constexpr,
):  # fmt: skip
    """Raw tiles at steps t0 + rows of the first N of four (B, T, D) tensors, and the reset flags (0 past t_end)."""
    row_ok = (t0 + rows) < t_end
    mask = row_ok[:, None] & col_ok[None, :]
    base = (seq + t0) * D
    v0 = tl.load(p0 + base + tile, mask=mask, other=0.0)
    v1 = tl.load(p1 + base + tile, mask=mask, other=0.0)
    if N > 2:
        v2 = tl.load(p2 + base + tile, mask=mask, other=0.0)
    else:
        v2 = v0
    if N > 3:
        v3 = tl.load(p3 + base + tile, mask=mask, other=0.0)
    else:
        v3 = v1
    if HAS_RESET:
        rst = tl.load(reset_ptr + seq + t0 + rows, mask=row_ok, other=0)
    else:
        rst = tl.zeros_like(rows).to(tl.uint8)
    return v0, v1, v2, v3, rst


@triton.jit
def _decay(ga, log2_scale, rst, row_ok):
    """sigmoid(gate_a), a_t = 2^(log2_scale r_t) with a_t := 0 at resets and 1 past the end (Appendix A)."""
    sig_a = _sigmoid(ga)
    a = _exp2(log2_scale[None, :] * sig_a)
    a_eff = tl.where(rst, 0.0, a)
    a_eff = tl.where(row_ok[:, None], a_eff, 1.0)
    return sig_a, a, a_eff


@triton.jit
def _rg_lru_fwd_kernel(
    x_ptr, gx_ptr, ga_ptr, log2_scale_ptr, reset_ptr, h_init_ptr,
    y_ptr, ckpt_ptr, h_out_ptr, a_out_ptr,
    T, D, n_chunks, chunk_t, n_ckpt,
    HAS_RESET: tl.constexpr, HAS_INIT: tl.constexpr, SUMMARY: tl.constexpr, CKPT_T: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Scan one chunk of BLOCK_D channels of one sequence.

    SUMMARY: start from h = 0 and write the chunk's (h_end, prod a) to h_out/a_out (B, n_chunks, D).
    Otherwise start from h_init (B, n_chunks, D) (or 0), write y, the state before every CKPT_T-th step to
    ckpt (B, n_ckpt, D) unless CKPT_T == 0 (CKPT_T is the backward's tile, any size), and from the last chunk
    h_last to h_out (B, D). Tiles are software-pipelined NUM_STAGES deep (asynchronous copies to shared memory).
    """
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    n_dblk = tl.cdiv(D, BLOCK_D)
    b = pid // n_dblk
    cols = (pid % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    rows = tl.arange(0, BLOCK_T)
    tile = rows[:, None] * D + cols[None, :]
    last = rows[:, None] == BLOCK_T - 1
    log2_scale = tl.load(log2_scale_ptr + cols, mask=col_ok, other=0.0)
    state = (b * n_chunks + chunk).to(tl.int64) * D + cols
    if HAS_INIT:
        h = tl.load(h_init_ptr + state, mask=col_ok, other=0.0)
    else:
        h = tl.zeros([BLOCK_D], dtype=tl.float32)
    a_tot = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    t_begin = chunk * chunk_t
    t_end = tl.minimum(t_begin + chunk_t, T)
    seq = b.to(tl.int64) * T
    if CKPT_T > 0:
        if chunk == 0:
            tl.store(ckpt_ptr + b.to(tl.int64) * n_ckpt * D + cols, h, mask=col_ok)
    for t0 in tl.range(t_begin, t_end, BLOCK_T, num_stages=NUM_STAGES):
        ga, x, gx, _, r = _load_step(
            ga_ptr, x_ptr, gx_ptr, x_ptr, reset_ptr, seq, t0, t_end, D, rows, tile, col_ok, 3, HAS_RESET
        )
        row_ok = (t0 + rows) < t_end
        rst = r[:, None] != 0
        sig_a, a, a_eff = _decay(ga.to(tl.float32), log2_scale, rst, row_ok)
        mult = tl.where(rst, 1.0, tl.sqrt(1.0 - a * a))
        bb = x.to(tl.float32) * _sigmoid(gx.to(tl.float32)) * mult
        acc_a, acc_b = tl.associative_scan((a_eff, bb), 0, _scan_combine)
        hs = acc_a * h[None, :] + acc_b
        if CKPT_T > 0:  # the state after step t is the checkpoint of the backward tile that starts at t + 1
            t_next = t0 + rows + 1
            is_ckpt = (t_next % CKPT_T == 0) & (t_next <= t_end) & (t_next < T)
            ckpt_offs = (b * n_ckpt + t_next // CKPT_T).to(tl.int64)[:, None] * D + cols[None, :]
            tl.store(ckpt_ptr + ckpt_offs, hs, mask=is_ckpt[:, None] & col_ok[None, :])
        if not SUMMARY:
            mask = row_ok[:, None] & col_ok[None, :]
            tl.store(y_ptr + (seq + t0) * D + tile, hs.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            a_tot = a_tot * tl.sum(tl.where(last, acc_a, 0.0), axis=0)
        h = tl.sum(tl.where(last, hs, 0.0), axis=0)
    if SUMMARY:
        tl.store(h_out_ptr + state, h, mask=col_ok)
        tl.store(a_out_ptr + state, a_tot, mask=col_ok)
    elif chunk == n_chunks - 1:
        tl.store(h_out_ptr + b.to(tl.int64) * D + cols, h, mask=col_ok)


@triton.jit
def _rg_lru_bwd_kernel(
    x_ptr, gx_ptr, ga_ptr, log2_scale_ptr, reset_ptr, dy_ptr, ckpt_ptr, s_init_ptr,
    dx_ptr, dgx_ptr, dga_ptr, dlog2_scale_ptr, s_out_ptr, p_out_ptr,
    T, D, n_chunks, chunk_t, n_tiles,
    HAS_RESET: tl.constexpr, SUMMARY: tl.constexpr, WRITE_DH0: tl.constexpr, STATES: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Reverse scan of one chunk of BLOCK_D channels; s = a_t dh_t is the carry passed to step t - 1.

    s starts at s_init (B, n_chunks, D): the carry entering the chunk from the right (dh_last for the last chunk).
    SUMMARY: start from s = 0, read only gate_a and dy, write (s at the chunk start, prod a) to s_out/p_out.
    Otherwise recompute the gates and the state from the checkpoints, write dx, dgate_x, dgate_a, this program's
    partial sum of dL/dlog2_scale to dlog2_scale (B, n_chunks, D), and from chunk 0 (WRITE_DH0) dL/dh0 = s to
    s_out (B, D). STATES: the checkpoints are the state before every step (B, T, D), read instead of rescanned;
    the tile's rows are then laid out latest first, so the adjoint scan needs no reversed (cross-lane) scan.
    """
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    n_dblk = tl.cdiv(D, BLOCK_D)
    b = pid // n_dblk
    cols = (pid % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if STATES and not SUMMARY:  # the forward's state before every step (ckpt (B, T, D)): rows latest first, so
        rows = BLOCK_T - 1 - tl.arange(0, BLOCK_T)  # that the adjoint is a forward scan and nothing is recomputed
    else:
        rows = tl.arange(0, BLOCK_T)
    tile = rows[:, None] * D + cols[None, :]
    first = rows[:, None] == 0
    n_loads: tl.constexpr = 2 if SUMMARY else 4
    log2_scale = tl.load(log2_scale_ptr + cols, mask=col_ok, other=0.0)
    state = (b * n_chunks + chunk).to(tl.int64) * D + cols
    if SUMMARY:
        s = tl.zeros([BLOCK_D], dtype=tl.float32)
    else:
        s = tl.load(s_init_ptr + state, mask=col_ok, other=0.0)
    p_tot = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    dscale = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # sum of dL/dlog(a_t) r_t
    t_begin = chunk * chunk_t
    t_end = tl.minimum(t_begin + chunk_t, T)
    n_chunk_tiles = tl.cdiv(t_end - t_begin, BLOCK_T)
    seq = b.to(tl.int64) * T
    for i in tl.range(n_chunk_tiles, num_stages=NUM_STAGES):
        t0 = t_begin + (n_chunk_tiles - 1 - i) * BLOCK_T
        ga, g, x, gx, r = _load_step(
            ga_ptr, dy_ptr, x_ptr, gx_ptr, reset_ptr, seq, t0, t_end, D, rows, tile, col_ok, n_loads, HAS_RESET
        )
        row_ok = (t0 + rows) < t_end
        mask = row_ok[:, None] & col_ok[None, :]
        rst = r[:, None] != 0
        g = g.to(tl.float32)
        sig_a, a, a_eff = _decay(ga.to(tl.float32), log2_scale, rst, row_ok)
        if SUMMARY:
            acc_p, acc_q = tl.associative_scan((a_eff, a_eff * g), 0, _scan_combine, reverse=True)
            p_tot = p_tot * tl.sum(tl.where(first, acc_p, 0.0), axis=0)
            s = tl.sum(tl.where(first, acc_p * s[None, :] + acc_q, 0.0), axis=0)
        else:
            x = x.to(tl.float32)
            u = 1.0 - a * a
            mult = tl.where(rst, 1.0, tl.sqrt(u))
            sig_x = _sigmoid(gx.to(tl.float32))
            xi = x * sig_x
            ones = tl.full([BLOCK_T, BLOCK_D], 1.0, tl.float32)
            if STATES:
                h_prev = tl.load(ckpt_ptr + (seq + t0 + rows)[:, None] * D + cols[None, :], mask=mask, other=0.0)
                a_h_prev = a_eff * h_prev  # a_t h_{t-1}
                _, acc_u, acc_v = tl.associative_scan((a_eff, ones, g), 0, _adjoint_combine)
            else:
                h_in = tl.load(ckpt_ptr + (b * n_tiles + t0 // BLOCK_T).to(tl.int64) * D + cols, mask=col_ok,
                               other=0.0)  # fmt: skip
                bb = xi * mult
                acc_a, acc_b = tl.associative_scan((a_eff, bb), 0, _scan_combine)
                a_h_prev = acc_a * h_in[None, :] + acc_b - bb  # a_t h_{t-1}, no division
                _, acc_u, acc_v = tl.associative_scan((a_eff, ones, g), 0, _adjoint_combine, reverse=True)
            dh = acc_u * s[None, :] + acc_v
            s = tl.sum(tl.where(first, a_eff * dh, 0.0), axis=0)
            dlog_a = dh * (a_h_prev - 2.0 * a * a * xi * tl.rsqrt(tl.maximum(4.0 * u, _MIN_4U)))
            dlog_a = tl.where(rst | ~mask, 0.0, dlog_a)
            dxi = dh * mult
            base = (seq + t0) * D
            tl.store(dx_ptr + base + tile, (dxi * sig_x).to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dgx_ptr + base + tile, (dxi * xi * (1.0 - sig_x)).to(dgx_ptr.dtype.element_ty), mask=mask)
            dga = dlog_a * (log2_scale[None, :] * _LN2) * sig_a * (1.0 - sig_a)
            tl.store(dga_ptr + base + tile, dga.to(dga_ptr.dtype.element_ty), mask=mask)
            dscale += dlog_a * sig_a
    if SUMMARY:
        tl.store(s_out_ptr + state, s, mask=col_ok)
        tl.store(p_out_ptr + state, p_tot, mask=col_ok)
    else:
        tl.store(dlog2_scale_ptr + state, tl.sum(dscale, axis=0) * _LN2, mask=col_ok)
        if WRITE_DH0:
            if chunk == 0:
                tl.store(s_out_ptr + b.to(tl.int64) * D + cols, s, mask=col_ok)


@triton.jit
def _chunk_carry_kernel(
    mul_ptr, add_ptr, init_ptr, out_ptr, D, n_chunks,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Carry a state across chunks: out[c] = state entering chunk c; state <- mul[c] state + add[c].

    Chunks are visited in time order, or from the last one when REVERSE (the backward carry). All (B, n_chunks, D)
    float32; init is (B, D).
    """
    pid = tl.program_id(0)
    n_dblk = tl.cdiv(D, BLOCK_D)
    b = pid // n_dblk
    cols = (pid % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if HAS_INIT:
        state = tl.load(init_ptr + b.to(tl.int64) * D + cols, mask=col_ok, other=0.0)
    else:
        state = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(n_chunks):
        c = n_chunks - 1 - i if REVERSE else i
        offs = (b * n_chunks + c).to(tl.int64) * D + cols
        tl.store(out_ptr + offs, state, mask=col_ok)
        mul = tl.load(mul_ptr + offs, mask=col_ok, other=0.0)
        add = tl.load(add_ptr + offs, mask=col_ok, other=0.0)
        state = mul * state + add


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv costs ~15 us per host call


@cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# CUDA configurations (block_t, block_d, num_warps, num_stages), measured with the sweep of
# benchmarks/scan_gpu.py on an H100 (docs/performance.md, "GPU RG-LRU kernel"). A direction runs its "wide"
# configuration in one time chunk when batch x channels gives it at least MIN_WARPS x SMs warps; otherwise the
# chunked variant runs the "narrow" configuration in enough time chunks for about TARGET_WARPS x SMs warps.
_WIDE = {False: (64, 16, 4, 3), True: (16, 16, 1, 3)}
_NARROW = {False: (16, 32, 1, 3), True: (16, 16, 1, 3)}
_MIN_WARPS = {False: 8, True: 3}
_TARGET_WARPS = 10


def select_config(x: Tensor, backward: bool, chunk_t: int = 0) -> KernelConfig:
    """Kernel configuration for x (B, T, D) and one direction; chunk_t > 0 forces the chunked variant.

    The forward pass stores checkpoints at the backward's block_t, so the two may use different tiles.
    """
    batch, steps, dim = x.shape
    if not x.is_cuda:  # the Triton interpreter: small tiles so that tests cover several tiles and chunks
        block_t, block_d, num_warps, num_stages = 8, 16, 1, 1
        return KernelConfig(block_t, block_d, _chunk(steps, block_t, chunk_t, 1), num_warps, num_stages)
    sms = _multiprocessors(x.device.index if x.device.index is not None else torch.cuda.current_device())
    block_t, block_d, num_warps, num_stages = _WIDE[backward]
    if chunk_t <= 0 and batch * _cdiv(dim, block_d) * num_warps >= _MIN_WARPS[backward] * sms:
        return KernelConfig(block_t, block_d, _chunk(steps, block_t, chunk_t, 1), num_warps, num_stages)
    block_t, block_d, num_warps, num_stages = _NARROW[backward]
    warps = batch * _cdiv(dim, block_d) * num_warps
    n_chunks = min(_cdiv(_TARGET_WARPS * sms, warps), max(1, steps // (8 * block_t)))
    return KernelConfig(block_t, block_d, _chunk(steps, block_t, chunk_t, n_chunks), num_warps, num_stages)


def _chunk(steps: int, block_t: int, chunk_t: int, n_chunks: int) -> int:
    """The time chunk: chunk_t if given (checked), else steps split into n_chunks, rounded up to whole tiles."""
    if chunk_t > 0:
        if chunk_t % block_t:
            raise ValueError(f"rg_lru_triton: chunk_t={chunk_t} must be a multiple of block_t={block_t}")
        return chunk_t
    return max(block_t, _cdiv(_cdiv(steps, n_chunks), block_t) * block_t)


@triton_op("griffin::rg_lru_fwd", mutates_args=())
def _rg_lru_fwd(
    x: Tensor,
    gate_x: Tensor,
    gate_a: Tensor,
    scale: Tensor,
    h0: Tensor | None,
    reset: Tensor | None,
    save_ckpt: bool,
    chunk_t: int,
    save_states: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward launch(es): returns y (like x), h_last (B, D) fp32 and the checkpoints (B, n_ckpt, D) fp32: the state
    before every block_t-th step (the backward's time tile), or before every step if save_states."""
    batch, steps, dim = x.shape
    cfg = select_config(x, backward=False, chunk_t=chunk_t)
    ckpt_t = (1 if save_states else select_config(x, backward=True).block_t) if save_ckpt else 0
    n_ckpt = max(1, _cdiv(steps, ckpt_t)) if save_ckpt else 0  # checkpoint 0 (h0) exists even when T == 0
    n_chunks = max(1, _cdiv(steps, cfg.chunk_t))
    y = torch.empty_like(x)
    h_last = torch.empty(batch, dim, device=x.device, dtype=torch.float32)
    ckpt = torch.empty(batch, n_ckpt, dim, device=x.device, dtype=torch.float32)
    reset_arg = x if reset is None else reset
    grid = (batch * _cdiv(dim, cfg.block_d), n_chunks)
    h_init = h0
    if n_chunks > 1:
        h_end = torch.empty(batch, n_chunks, dim, device=x.device, dtype=torch.float32)
        a_prod = torch.empty_like(h_end)
        h_init = torch.empty_like(h_end)
        wrap_triton(_rg_lru_fwd_kernel)[grid](
            x, gate_x, gate_a, scale, reset_arg, x, y, ckpt, h_end, a_prod, steps, dim, n_chunks, cfg.chunk_t,
            n_ckpt, HAS_RESET=reset is not None, HAS_INIT=False, SUMMARY=True, CKPT_T=0,
            **cfg.meta(),
        )  # fmt: skip
        wrap_triton(_chunk_carry_kernel)[(grid[0],)](
            a_prod, h_end, x if h0 is None else h0, h_init, dim, n_chunks,
            HAS_INIT=h0 is not None, REVERSE=False, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
        )  # fmt: skip
    wrap_triton(_rg_lru_fwd_kernel)[grid](
        x, gate_x, gate_a, scale, reset_arg, x if h_init is None else h_init, y, ckpt, h_last, h_last,
        steps, dim, n_chunks, cfg.chunk_t, n_ckpt, HAS_RESET=reset is not None, HAS_INIT=h_init is not None,
        SUMMARY=False, CKPT_T=ckpt_t, **cfg.meta(),
    )  # fmt: skip
    return y, h_last, ckpt


@triton_op("griffin::rg_lru_bwd", mutates_args=())
def _rg_lru_bwd(
    x: Tensor,
    gate_x: Tensor,
    gate_a: Tensor,
    scale: Tensor,
    reset: Tensor | None,
    ckpt: Tensor,
    dy: Tensor,
    dh_last: Tensor,
    need_dh0: bool,
    chunk_t: int,
    states: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward launch(es): returns dx, dgate_x, dgate_a (like the inputs), dscale (D,) and dh0 (B, D) fp32."""
    batch, steps, dim = x.shape
    cfg = select_config(x, backward=True, chunk_t=chunk_t)
    n_tiles = _cdiv(steps, cfg.block_t)
    n_chunks = max(1, _cdiv(steps, cfg.chunk_t))
    dx, dgx, dga = torch.empty_like(x), torch.empty_like(gate_x), torch.empty_like(gate_a)
    dscale = torch.empty(batch, n_chunks, dim, device=x.device, dtype=torch.float32)
    dh0 = torch.empty(batch, dim if need_dh0 else 0, device=x.device, dtype=torch.float32)
    reset_arg = x if reset is None else reset
    grid = (batch * _cdiv(dim, cfg.block_d), n_chunks)
    s_init = dh_last
    if n_chunks > 1:
        s_start = torch.empty(batch, n_chunks, dim, device=x.device, dtype=torch.float32)
        p_prod = torch.empty_like(s_start)
        s_init = torch.empty_like(s_start)
        wrap_triton(_rg_lru_bwd_kernel)[grid](
            x, gate_x, gate_a, scale, reset_arg, dy, ckpt, x, dx, dgx, dga, dscale, s_start, p_prod,
            steps, dim, n_chunks, cfg.chunk_t, n_tiles, HAS_RESET=reset is not None, SUMMARY=True,
            WRITE_DH0=False, STATES=states, **cfg.meta(),
        )  # fmt: skip
        wrap_triton(_chunk_carry_kernel)[(grid[0],)](
            p_prod, s_start, dh_last, s_init, dim, n_chunks,
            HAS_INIT=True, REVERSE=True, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
        )  # fmt: skip
    wrap_triton(_rg_lru_bwd_kernel)[grid](
        x, gate_x, gate_a, scale, reset_arg, dy, ckpt, s_init, dx, dgx, dga, dscale, dh0, dh0,
        steps, dim, n_chunks, cfg.chunk_t, n_tiles, HAS_RESET=reset is not None, SUMMARY=False,
        WRITE_DH0=need_dh0, STATES=states, **cfg.meta(),
    )  # fmt: skip
    return dx, dgx, dga, dscale.sum(dim=(0, 1)), dh0


def _setup_context(ctx, inputs, output) -> None:
    x, gate_x, gate_a, scale, _, reset, _, chunk_t, save_states = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(x, gate_x, gate_a, scale, reset, output[2])
    ctx.chunk_t, ctx.states = chunk_t, save_states


def _backward(ctx, dy: Tensor, dh_last: Tensor, _dckpt: Tensor):
    x, gate_x, gate_a, scale, reset, ckpt = ctx.saved_tensors
    need_dh0 = ctx.needs_input_grad[4]
    if ckpt.shape[1] == 0:
        raise RuntimeError("rg_lru_triton: backward through a forward run without checkpoints (save_ckpt=False)")
    dx, dgx, dga, dscale, dh0 = torch.ops.griffin.rg_lru_bwd(
        x, gate_x, gate_a, scale, reset, ckpt, dy.contiguous(), dh_last.float().contiguous(), need_dh0,
        ctx.chunk_t, ctx.states,
    )  # fmt: skip
    return dx, dgx, dga, dscale, dh0 if need_dh0 else None, None, None, None, None


_rg_lru_fwd.register_autograd(_backward, setup_context=_setup_context)


def rg_lru_triton(
    x: Tensor,
    gate_x: Tensor,
    gate_a: Tensor,
    a_param: Tensor,
    c: float = 8.0,
    h0: Tensor | None = None,
    reset: Tensor | None = None,
    *,
    chunk_t: int = 0,
    save_states: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused RG-LRU (Section 2.4): returns y (like x) and the float32 final state (B, D).

    chunk_t > 0 forces the chunked variant with this time chunk (a multiple of its time tile; chunk_t >= T gives
    one chunk); 0 lets :func:`select_config` choose per shape and direction. save_states: for the backward, keep the
    float32 state before every step (4 bytes an element of activation memory) instead of one every time tile, so
    that the backward reads it rather than recomputing it with a second scan; None takes the environment's
    GRIFFIN_RG_LRU_STATES=1 (off by default: not yet timed on a GPU, docs/gpu-notes.md).
    """
    check_rg_lru_inputs(x, gate_x, gate_a, a_param)
    if not INTERPRETED:  # compiled kernels read device memory only: refuse host tensors here
        for name, t in (("x", x), ("gate_x", gate_x), ("gate_a", gate_a), ("a_param", a_param), ("h0", h0),
                        ("reset", reset)):
            if t is not None and not t.is_cuda:
                raise ValueError(f"rg_lru_triton: {name} is on {t.device}, but the Triton kernel runs on CUDA tensors "
                                 f"(TRITON_INTERPRET=1 runs it on the CPU, slowly; backend='cpu' is the CPU kernel)")
    # log2 a_t = log2_scale * r_t; autograd carries dL/dlog2_scale on to a_param
    scale = (-c * math.log2(math.e)) * F.softplus(a_param.float())
    if h0 is not None:
        h0 = h0.float().contiguous()
    if reset is not None:
        reset = reset.contiguous()
    inputs = (x, gate_x, gate_a, scale, h0)
    save_ckpt = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    y, h_last, _ = torch.ops.griffin.rg_lru_fwd(
        x.contiguous(), gate_x.contiguous(), gate_a.contiguous(), scale, h0, reset, save_ckpt, chunk_t,
        SAVE_STATES if save_states is None else save_states,
    )
    return y, h_last
