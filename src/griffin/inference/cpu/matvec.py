"""The weight matmuls of a decode step on CPU, read at memory bandwidth (Section 5.1), in numba.

At a few rows (the batch of a decode step) ``x W^T`` is bound by reading W once: a 1-3B model reads 1-6 GB per
token, while the arithmetic is a few multiply-adds per weight. The kernel streams each weight row once from memory
in its stored format (float32, bfloat16 as its 16 bits, or int8 with float32 scales per group of inputs,
:mod:`griffin.ops.matvec`), widens it to float32 in registers and multiplies it with every input row
while it is in the L1 cache: at one input row, one weight row at a time (one accumulator chain, which LLVM
vectorises best); at several, two weight rows against up to four input rows at a time, eight float32 accumulators
that LLVM vectorises over the inputs (AVX2/AVX-512). Output rows are split among the threads in tiles of
:data:`TILE` rows; several matrices that read the same input (attention's q/k/v, the MLP's two branches) are one
call, one parallel region over the tiles of all of them, with no copy of the weights.

On a host with AVX-512 BF16 / VNNI (:mod:`griffin.inference.cpu.isa`), bfloat16 weights times one bfloat16 row go
through ``vdpbf16ps``, and int8 weights times any number of rows through ``vpdpbusd``, each row rounded to int16 steps
of max |x| / 32767 (:func:`griffin.ops.matvec.quantize_row_int16`, an error below bfloat16's own rounding of
the row's larger entries; the sums over int8 weights are then exact integers): 32 or 64 weights per instruction
instead of one widening and one multiply-add each, which is what kept the widened loop below the read bandwidth.
Several rows are taken in blocks of 4 weight rows x 2 input rows, so that each loaded vector serves several
instructions; where the host has Intel's AMX tiles (:data:`griffin.inference.cpu.isa.FAST_TILES`), several rows of int8
go through them instead (:func:`_tile_unit_task`: 16 weight rows against the high and low bytes of 8 input
rows per ``tdpbsud``, the same exact sums). The one-row kernels ask for the weights :data:`PREFETCH_BYTES` ahead.
The RG-LRU's block-diagonal gates have their own kernel (:func:`block_diagonal_cpu`), which reads each block once
per row (float32, bfloat16 or int8 weights).

Numerics: float32 products and sums (reassociated: the order differs from ``F.linear``'s by rounding only; exact
int64 sums for int8 weights on the instruction path), then the scale of each group, the bias, and the cast to the
output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange, types
from numba.core.errors import TypingError
from numba.extending import overload
from torch import Tensor

from griffin.inference.cpu.isa import (
    DOT_CHUNK,
    DOT_INSTRUCTIONS,
    FAST_DOTS,
    FAST_TILES,
    ROWS,
    TILE_BYTES,
    TILE_COLUMNS,
    TILE_INSTRUCTIONS,
    TILE_ROWS,
    VECTOR,
    WEIGHT_ROWS,
    dot_bf16,
    dot_rows_uint16_int8,
    dot_uint16_int8,
    tile_config,
    tile_dot_int8,
)
from griffin.ops.jit import float32_from_bits, kernel, parallel_ready, prefetch, storage, widen
from griffin.ops.matvec import INT16_MAX

TILE = TILE_ROWS  # output rows per task (16: one AMX tile of weight rows, which the tile kernel relies on)
# How far ahead (bytes of weights) the kernels prefetch (0: not at all), read at each call. At several rows, while a
# block is read again from L1 for the next input rows, nothing else draws the next rows from memory; at one row the
# hardware prefetcher does not cross the 4 KiB page a row's stream enters (docs/performance.md, "CPU decode at 1–3B").
# The one-row bfloat16 and int8 kernels ask with each vector they load (griffin.inference.cpu.isa.dot_bf16), the others
# a row's worth at the start of each row (_prefetch_row).
PREFETCH_BYTES = 1 << 16
SLOTS = 4  # matrices per call the kernel is compiled for (fewer are padded, so that one compilation serves all)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
OFFSET = INT16_MAX + 1  # int16 + OFFSET is unsigned (what vpdpbusd multiplies)


@numba.njit(inline="always", fastmath=True)
def _dot_2x4(x0, x1, x2, x3, w0, w1, k0, k1):
    """Dot products of weight rows w0, w1 with input rows x0..x3 over [k0, k1)."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for d in range(k1 - k0):
        k = k0 + d
        u = widen(w0[k])
        v = widen(w1[k])
        a0 += x0[k] * u
        a1 += x1[k] * u
        a2 += x2[k] * u
        a3 += x3[k] * u
        b0 += x0[k] * v
        b1 += x1[k] * v
        b2 += x2[k] * v
        b3 += x3[k] * v
    return a0, a1, a2, a3, b0, b1, b2, b3


@numba.njit(inline="always", fastmath=True)
def _dot_2x1(x0, w0, w1, k0, k1):
    a0 = b0 = np.float32(0.0)
    for d in range(k1 - k0):
        a0 += x0[k0 + d] * widen(w0[k0 + d])
        b0 += x0[k0 + d] * widen(w1[k0 + d])
    return a0, b0


@numba.njit(inline="always", fastmath=True)
def _dot_1x4(x0, x1, x2, x3, w0, k0, k1):
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for d in range(k1 - k0):
        u = widen(w0[k0 + d])
        a0 += x0[k0 + d] * u
        a1 += x1[k0 + d] * u
        a2 += x2[k0 + d] * u
        a3 += x3[k0 + d] * u
    return a0, a1, a2, a3


@numba.njit(inline="always", fastmath=True)
def _dot_1x1(x0, w0, k0, k1):
    a0 = np.float32(0.0)
    for d in range(k1 - k0):
        a0 += x0[k0 + d] * widen(w0[k0 + d])
    return a0


@numba.njit(inline="always", fastmath=True)
def _row_pair(x, w0, w1, s0, s1, group, out, c, bias0, bias1):
    """out[:, c], out[:, c + 1] = x w0^T, x w1^T with the rows' group scales s0, s1 and biases."""
    batch = x.shape[0]
    b = 0
    while b + 4 <= batch:
        x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
        a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = np.float32(0.0)
        for g in range(s0.shape[0]):
            p = _dot_2x4(x0, x1, x2, x3, w0, w1, g * group, (g + 1) * group)
            a0 += p[0] * s0[g]
            a1 += p[1] * s0[g]
            a2 += p[2] * s0[g]
            a3 += p[3] * s0[g]
            c0 += p[4] * s1[g]
            c1 += p[5] * s1[g]
            c2 += p[6] * s1[g]
            c3 += p[7] * s1[g]
        out[b, c], out[b + 1, c], out[b + 2, c], out[b + 3, c] = a0 + bias0, a1 + bias0, a2 + bias0, a3 + bias0
        out[b, c + 1], out[b + 1, c + 1], out[b + 2, c + 1], out[b + 3, c + 1] = (c0 + bias1, c1 + bias1,
                                                                                  c2 + bias1, c3 + bias1)
        b += 4
    while b < batch:
        a0 = c0 = np.float32(0.0)
        for g in range(s0.shape[0]):
            p = _dot_2x1(x[b], w0, w1, g * group, (g + 1) * group)
            a0 += p[0] * s0[g]
            c0 += p[1] * s1[g]
        out[b, c], out[b, c + 1] = a0 + bias0, c0 + bias1
        b += 1


@numba.njit(inline="always", fastmath=True)
def _row(x, w0, s0, group, out, c, bias0):
    batch = x.shape[0]
    b = 0
    while b + 4 <= batch:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for g in range(s0.shape[0]):
            p = _dot_1x4(x[b], x[b + 1], x[b + 2], x[b + 3], w0, g * group, (g + 1) * group)
            a0 += p[0] * s0[g]
            a1 += p[1] * s0[g]
            a2 += p[2] * s0[g]
            a3 += p[3] * s0[g]
        out[b, c], out[b + 1, c], out[b + 2, c], out[b + 3, c] = a0 + bias0, a1 + bias0, a2 + bias0, a3 + bias0
        b += 4
    while b < batch:
        a0 = np.float32(0.0)
        for g in range(s0.shape[0]):
            a0 += _dot_1x1(x[b], w0, g * group, (g + 1) * group) * s0[g]
        out[b, c] = a0 + bias0
        b += 1


# The tasks: each computes the output columns of tile t (its matrix's rows) for every input row. A call of the kernel
# runs the tasks of all tiles in one parallel region (:func:`_matvec_rows_kernel`, or a residual block's step). Each
# is a function of its own (not inlined), compiled once for all its callers.


@kernel(fastmath=True)
def _widened_task(t, x, weights, tiles, scale, bias, out):
    """out = x W^T for tile t: x (B, K) float32; weights a tuple of (N_j, K) matrices of one storage type;
    tiles (T, 4) int64 rows (matrix j, its first row, the first output column, rows); scale (N, G) float32 and
    bias (N,) float32 indexed by output column; out (B, N) float32. Two weight rows against four input rows at a
    time."""
    K = x.shape[1]
    group = K // scale.shape[1]
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    w = weights[j]
    i = 0
    while i + 2 <= rows:
        c = c0 + i
        _row_pair(x, w[r0 + i], w[r0 + i + 1], scale[c], scale[c + 1], group, out, c, bias[c], bias[c + 1])
        i += 2
    if i < rows:
        _row(x, w[r0 + i], scale[c0 + i], group, out, c0 + i, bias[c0 + i])


@numba.njit(inline="always")
def _prefetch_row(w, r, ahead_bytes):
    """Prefetch (into L2) the weights ``ahead_bytes`` past the start of row r of the matrix w, one row's worth (not
    past the matrix's end; nothing for 0)."""
    K, size = w.shape[1], w.shape[0] * w.shape[1]
    start = r * K + ahead_bytes // w.itemsize
    if ahead_bytes:
        for q in range(start, min(start + K, size), 64 // w.itemsize):
            prefetch(w, q)


@kernel(fastmath=True)
def _one_row_task(t, x, weights, tiles, scale, bias, ahead_bytes, out):
    """out = x W^T for one input row, tile t: x (K,) float32, the weights and tiles as in :func:`_widened_task`,
    out (N,) float32. One weight row at a time, one accumulator chain per group, which LLVM vectorises over K; each
    row asks for the weights ``ahead_bytes`` on (:func:`_prefetch_row`)."""
    K = x.shape[0]
    group = K // scale.shape[1]
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    w = weights[j]
    for i in range(rows):
        row, c = w[r0 + i], c0 + i
        _prefetch_row(w, r0 + i, ahead_bytes)
        total = np.float32(0.0)
        for g in range(scale.shape[1]):
            acc = np.float32(0.0)
            for k in range(group):  # (not range(g * group, ...): LLVM vectorises this form only)
                acc += x[g * group + k] * widen(row[g * group + k])
            total += acc * scale[c, g]
        out[c] = total + bias[c]


@kernel(fastmath=True)
def _one_row_bf16_task(t, x, weights, tiles, bias, ahead_bytes, out):
    """out = x W^T + bias for one bfloat16 row x (K,) and bfloat16 weights, both as their uint16 bits, tile t (tiles
    as in :func:`_widened_task`; bias and out (N,) float32): the first K - K mod VECTOR inputs through ``vdpbf16ps``
    (:func:`griffin.inference.cpu.isa.dot_bf16`), the rest widened; the weights ``ahead_bytes`` on prefetched."""
    K = x.shape[0]
    kv = K - K % VECTOR
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    w = weights[j].reshape(weights[j].size)  # flat: each row by its offset, no view per row
    for i in range(rows):
        first, c = (r0 + i) * K, c0 + i
        acc = dot_bf16(x, w, first, 0, kv, ahead_bytes // 2)
        for k in range(kv, K):
            acc += widen(x[k]) * widen(w[first + k])
        out[c] = acc + bias[c]


@numba.njit(inline="always", fastmath=True)
def _group_dot(high, low, w, first, k0, group, gv, vector_sum, ahead_bytes):
    """The exact int64 sum of x[k] w[first + k] over the group [k0, k0 + group), x = u - 32768 and u = 256 high + low:
    over its first gv entries, whose weights sum to ``vector_sum``, u w - 32768 sum(w) through ``vpdpbusd``
    (:func:`griffin.inference.cpu.isa.dot_uint16_int8`, in chunks of at most :data:`DOT_CHUNK`); the rest one product
    at a time."""
    acc = np.int64(vector_sum) * np.int64(-OFFSET)
    for d in range(0, gv, DOT_CHUNK):
        acc += dot_uint16_int8(high, low, w, first, k0 + d, min(DOT_CHUNK, gv - d), ahead_bytes)
    for k in range(k0 + gv, k0 + group):
        acc += (np.int64(high[k]) * 256 + np.int64(low[k]) - OFFSET) * np.int64(w[first + k])
    return acc


@numba.njit(inline="always", fastmath=True)
def _one_row_int8_task(t, high, low, step, weights, tiles, sums, scale, bias, ahead_bytes, out):
    """out = step (x W^T, each group times its scale) + bias, tile t, for one row x (K,) of int16 steps of ``step``
    (:func:`griffin.ops.matvec.quantize_row_int16`), given as the bytes of u = x + 32768 (``high``,
    ``low``), and int8 weights (tiles as in :func:`_widened_task`) with float32 ``scale`` (N, G) and ``sums``
    (N, G), the sums of each group's first group - group mod VECTOR weights (:func:`vector_sums`): each group's
    sum exact (int64, :func:`_group_dot`) until it is scaled. The weights ``ahead_bytes`` on are prefetched. Inlined
    into its callers: a call per tile cost int8's short rows a measurable share of their time (docs/performance.md)."""
    K = high.shape[0]
    G = scale.shape[1]
    group = K // G
    gv = group - group % VECTOR
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    w = weights[j].reshape(weights[j].size)  # flat: each row by its offset, no view per row
    for i in range(rows):
        first, c = (r0 + i) * K, c0 + i
        total = np.float32(0.0)
        for g in range(G):
            k0 = g * group
            total += np.float32(_group_dot(high, low, w, first, k0, group, gv, sums[c, g], ahead_bytes)) * scale[c, g]
        out[c] = total * step + bias[c]


@kernel(fastmath=True)
def _rows_int8_task(t, high, low, steps, weights, tiles, sums, scale, bias, ahead_bytes, out):
    """:func:`_one_row_int8_task` for B rows, each with its own int16 steps: ``high``, ``low`` (B', K) with
    B' >= B a multiple of :data:`griffin.inference.cpu.isa.ROWS` (the rows past B are computed, not written out),
    ``steps`` (B,), out (B, N). A block of WEIGHT_ROWS weight rows against ROWS input rows at a time
    (:func:`griffin.inference.cpu.isa.dot_rows_uint16_int8`); the weight rows stay in the L1 cache for the next input
    rows, while the block ``ahead_bytes`` of weights ahead (0: none) is prefetched into L2, a share at each pass. At
    the end of a tile the block repeats its last row (computed, not written out)."""
    B = out.shape[0]
    K = high.shape[1]
    G = scale.shape[1]
    group = K // G
    gv = group - group % VECTOR
    n = WEIGHT_ROWS * ROWS
    passes = -(-B // ROWS)
    blocks_ahead = max(1, ahead_bytes // (WEIGHT_ROWS * K))
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    w = weights[j]
    acc = np.empty(n, np.int64)
    total = np.empty(n, np.float32)
    for i in range(0, rows, WEIGHT_ROWS):
        ahead = min(r0 + i + blocks_ahead * WEIGHT_ROWS, w.shape[0]) * K  # (the next tile's rows too)
        share = -(-min(WEIGHT_ROWS * K, w.shape[0] * K - ahead) // (64 * passes)) * 64 if ahead_bytes else 0
        for m0 in range(0, B, ROWS):
            for q in range(ahead + m0 // ROWS * share, ahead + (m0 // ROWS + 1) * share, 64):
                prefetch(w, q)
            total[:] = 0.0
            for g in range(G):
                k0 = g * group
                acc[:] = 0
                for d in range(0, gv, DOT_CHUNK):
                    block = dot_rows_uint16_int8(high, low, m0, w, r0 + i, r0 + rows - 1, k0 + d,
                                                 min(DOT_CHUNK, gv - d))
                    for q in range(n):
                        acc[q] += block[q]
                for q in range(n):
                    m, e = m0 + q % ROWS, min(i + q // ROWS, rows - 1)
                    for k in range(k0 + gv, k0 + group):
                        x_k = np.int64(high[m, k]) * 256 + np.int64(low[m, k]) - OFFSET
                        acc[q] += x_k * np.int64(w[r0 + e, k])
                    total[q] += np.float32(acc[q] - np.int64(sums[c0 + e, g]) * OFFSET) * scale[c0 + e, g]
            for q in range(n):
                m, e = m0 + q % ROWS, i + q // ROWS
                if m < B and e < rows:
                    out[m, c0 + e] = total[q] * steps[m] + bias[c0 + e]


TILE_INPUTS = TILE_COLUMNS // 2  # input rows per tile product (their high and low bytes)


@numba.njit(inline="always")
def _word(row, k):
    """The 4 bytes row[k : k + 4] (those inside the row; zeros past its end) as one little-endian uint32."""
    K = row.shape[0]
    if k + 4 <= K:
        return (np.uint32(row[k]) | np.uint32(row[k + 1]) << np.uint32(8) | np.uint32(row[k + 2]) << np.uint32(16)
                | np.uint32(row[k + 3]) << np.uint32(24))
    word = np.uint32(0)
    for i in range(K - k):
        word |= np.uint32(row[k + i]) << np.uint32(8 * i)
    return word


@kernel()
def _pack_tile_columns(high, low, packed):
    """packed (P, K / 4, 64) uint8, zeros on entry: for each block p of :data:`TILE_INPUTS` input rows, the high
    bytes of its rows as columns 0-7 and the low bytes as columns 8-15 of
    :func:`griffin.inference.cpu.isa.tile_dot_int8`'s input tile (the rows past B stay zero): column j of the tile's row
    k // 4 is the 4 bytes from k, one word."""
    B, K = high.shape
    words = packed.view(np.uint32)  # (P, K / 4, 16)
    for p in range(packed.shape[0]):
        rows = min(TILE_INPUTS, B - p * TILE_INPUTS)
        for q in range(-(-K // 4)):  # (a tile row at a time: 64 consecutive bytes written)
            for j in range(rows):
                words[p, q, j] = _word(high[p * TILE_INPUTS + j], 4 * q)
                words[p, q, TILE_INPUTS + j] = _word(low[p * TILE_INPUTS + j], 4 * q)


@kernel(fastmath=True)
def _tile_rows(high, low, packed, steps, w, first, c0, rows, sums, scale, bias, config, out):
    """out[:, c0 : c0 + rows] for the 16 weight rows of w from ``first`` (the tile's ``rows``, then padding), as
    :func:`_tile_unit_task` describes."""
    B = out.shape[0]
    K = high.shape[1]
    G = scale.shape[1]
    group = K // G
    gv = group - group % VECTOR
    block = np.empty((TILE_ROWS, TILE_COLUMNS), np.int32)
    acc = np.empty((TILE_ROWS, TILE_INPUTS), np.int64)
    total = np.empty((TILE_ROWS, TILE_INPUTS), np.float32)
    for p in range(packed.shape[0]):
        total[:] = 0.0
        for g in range(G):
            k0 = g * group
            acc[:] = 0
            for d in range(0, gv, DOT_CHUNK):
                tile_dot_int8(config, w, first, packed[p], k0 + d, min(DOT_CHUNK, gv - d), block)
                for e in range(TILE_ROWS):
                    for m in range(TILE_INPUTS):
                        acc[e, m] += np.int64(block[e, m]) * 256 + np.int64(block[e, TILE_INPUTS + m])
            for e in range(rows):
                for m in range(min(TILE_INPUTS, B - p * TILE_INPUTS)):
                    b = p * TILE_INPUTS + m
                    for k in range(k0 + gv, k0 + group):
                        x_k = np.int64(high[b, k]) * 256 + np.int64(low[b, k]) - OFFSET
                        acc[e, m] += x_k * np.int64(w[first + e, k])
                    total[e, m] += np.float32(acc[e, m] - np.int64(sums[c0 + e, g]) * OFFSET) * scale[c0 + e, g]
        for e in range(rows):
            for m in range(min(TILE_INPUTS, B - p * TILE_INPUTS)):
                b = p * TILE_INPUTS + m
                out[b, c0 + e] = total[e, m] * steps[b] + bias[c0 + e]


@kernel(fastmath=True)
def _tile_unit_task(t, high, low, packed, steps, weights, tiles, sums, scale, bias, config, out):
    """:func:`_rows_int8_task` through the tile unit (:func:`griffin.inference.cpu.isa.tile_dot_int8`): the tile's 16
    weight rows against each block of 8 input rows (``packed``, :func:`_pack_tile_columns`), the same exact int64
    sums and the same float32 operations after them, so the same bits (:func:`_tile_rows`). A tile of fewer rows (a
    matrix's last) is copied into 16 zero-padded rows first, so that no tile load reads past a matrix. (No prefetch:
    the tile loads keep 16 streams of weights in flight, and prefetching ahead of them was not faster,
    docs/performance.md.)"""
    K = high.shape[1]
    j, r0, c0, rows = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
    if rows < TILE_ROWS:  # (a new array, not a reassigned variable: numba's prange kept the old one)
        padded = np.zeros((TILE_ROWS, K), np.int8)
        padded[:rows] = weights[j][r0 : r0 + rows]
        _tile_rows(high, low, packed, steps, padded, np.int64(0), c0, rows, sums, scale, bias, config, out)
    else:
        _tile_rows(high, low, packed, steps, weights[j], r0, c0, rows, sums, scale, bias, config, out)


_TILE_CONFIG = tile_config()


@kernel()
def _quantize_rows_int16(x, high, low, steps):
    """:func:`_quantize_row_int16` of each row of x (B, K) into high, low and steps (B,); False if a row has an
    infinite or NaN entry."""
    for b in range(x.shape[0]):
        steps[b] = _quantize_row_int16(x[b], high[b], low[b])
        if steps[b] == 0:
            return False
    return True


def _max_magnitude(x):
    """(max |x_k| as float32, whether every entry is finite) for x (K,) float32, or bfloat16 as its uint16 bits (numba
    only)."""
    raise NotImplementedError


@overload(_max_magnitude, inline="always")
def _max_magnitude_impl(x):
    # From the bits without the sign: for finite floats their order is the magnitudes' order, and the largest is at
    # least the infinity's bits where an entry is infinite or NaN. An integer maximum, which LLVM vectorises (a float
    # one it does not, without fastmath's no-NaN promise).
    if x.dtype == types.uint16:
        def bfloat16(x):
            m = np.uint16(0)
            for k in range(x.shape[0]):
                m = max(m, np.uint16(x[k] & np.uint16(0x7FFF)))
            return widen(m), m < np.uint16(0x7F80)

        return bfloat16
    if x.dtype == types.float32:
        def float32(x):
            bits = x.view(np.uint32)
            m = np.uint32(0)
            for k in range(bits.shape[0]):
                m = max(m, np.uint32(bits[k] & np.uint32(0x7FFFFFFF)))
            return float32_from_bits(m), m < np.uint32(0x7F800000)

        return float32
    raise TypingError(f"matvec: no int16 steps for rows of type {x.dtype}")


@kernel(fastmath=False)
def _quantize_row_int16(x, high, low):
    """:func:`griffin.ops.matvec.quantize_row_int16` of x (K,) (float32, or bfloat16 as its uint16 bits),
    the same float32 operations, written as the high and low bytes (K,) uint8 of u = x_int16 + 32768; returns the
    step, or 0 if x has an infinite or NaN entry."""
    amax, finite = _max_magnitude(x)
    if not finite:
        return np.float32(0.0)
    step = amax / np.float32(INT16_MAX) if amax > 0 else np.float32(1.0)
    for k in range(x.shape[0]):
        u = np.int32(min(max(np.rint(widen(x[k]) / step), -INT16_MAX), INT16_MAX)) + OFFSET
        high[k], low[k] = np.uint8(u >> 8), np.uint8(u & 255)
    return step


def vector_sums(weight: Tensor, groups: int) -> Tensor:
    """(N, groups) int32: for an int8 (N, K) matrix, the sum of each group's first group - group mod VECTOR weights
    (what :func:`_one_row_int8_task` multiplies through ``vpdpbusd``)."""
    n, k = weight.shape
    group = k // groups
    return weight.detach().reshape(n, groups, group)[..., : group - group % VECTOR].sum(-1, dtype=torch.int32)


def block_product(x, x0, w, scale, bias, h, out, o0, w_row):
    """Mirrors block h of :meth:`griffin.layers.BlockDiagonalLinear.forward` (and of its int8 version) for every row
    b: out[b, o0 + o] = bias[h, o] + sum_i x[b, x0 + i]
    w[h, i, o], x and w as stored (float32, or bfloat16 bits; w also int8, times ``scale`` (H, Dout) float32, one
    per block and output column: the sum over i is scaled once), out float32, w_row a float32 scratch of Dout. Each
    row of the block's (Din, Dout) matrix is widened once for all the rows of x and added, times their entries, to
    their output rows (vectorised over Dout). Numba only."""
    raise NotImplementedError


@numba.njit(inline="always", fastmath=True)
def _add_rows(x, x0, w, h, out, o0, w_row):
    """out[b, o0 + o] += sum_i x[b, x0 + i] w[h, i, o] for every row b of x, w's entries widened to float32 (int8
    ones as their values), vectorised over o: at one row straight into the output row; at several each row of the
    block widened once into w_row for all of them."""
    Din, Dout = w.shape[1], w.shape[2]
    if x.shape[0] == 1:
        acc = out[0, o0 : o0 + Dout]
        for i in range(Din):
            xi, row = widen(x[0, x0 + i]), w[h, i]
            for o in range(Dout):
                acc[o] += xi * widen(row[o])
        return
    for i in range(Din):
        row = w[h, i]
        for o in range(Dout):
            w_row[o] = widen(row[o])
        for b in range(x.shape[0]):
            xi, acc = widen(x[b, x0 + i]), out[b, o0 : o0 + Dout]
            for o in range(Dout):
                acc[o] += xi * w_row[o]


@overload(block_product, inline="always")
def _block_product_impl(x, x0, w, scale, bias, h, out, o0, w_row):
    if w.dtype == types.int8:
        def int8(x, x0, w, scale, bias, h, out, o0, w_row):
            Dout = w.shape[2]
            for b in range(x.shape[0]):
                for o in range(Dout):
                    out[b, o0 + o] = 0.0
            _add_rows(x, x0, w, h, out, o0, w_row)
            for b in range(x.shape[0]):
                acc = out[b, o0 : o0 + Dout]
                for o in range(Dout):
                    acc[o] = widen(bias[h, o]) + acc[o] * scale[h, o]

        return int8

    def stored(x, x0, w, scale, bias, h, out, o0, w_row):
        for b in range(x.shape[0]):
            for o in range(w.shape[2]):
                out[b, o0 + o] = widen(bias[h, o])
        _add_rows(x, x0, w, h, out, o0, w_row)

    return stored


@kernel(parallel=True, fastmath=True)
def _block_diagonal_kernel(x, w, scale, bias, out):
    """out[b, h Dout + o] = sum_i x[b, h Din + i] w[h, i, o] + bias[h, o], the RG-LRU's block-diagonal gates
    (Section 2.4): x (B, H Din) float32 (or bfloat16 bits), w (H, Din, Dout) as stored (float32 or bfloat16 bits, or
    int8 with ``scale`` (H, Dout)), bias (H, Dout) float32, out (B, H Dout) float32. A task per block
    (:func:`block_product`)."""
    H, Din, Dout = w.shape
    for h in prange(H):
        block_product(x, h * Din, w, scale, bias, h, out, h * Dout, np.empty(Dout, np.float32))


GATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def gate_arrays(weight: Tensor, scale: Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """The block-diagonal weights (H, Din, Dout) and their scales as :func:`block_product` reads them: float32 or
    bfloat16 weights (no scale: an empty array), or int8 with float32 ``scale`` (H, Dout); CPU, contiguous."""
    H, _, Dout = weight.shape
    if weight.dtype not in GATE_DTYPES or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError(f"block-diagonal gates must be contiguous float32, bfloat16 or int8 CPU weights, got "
                         f"{weight.dtype} on {weight.device}")
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("block-diagonal gates: int8 weights need their scales, float weights have none")
    if scale is None:
        return storage(weight.detach()), np.empty((0, 0), np.float32)
    if scale.shape != (H, Dout) or scale.dtype != torch.float32 or scale.device.type != "cpu":
        raise ValueError(f"int8 block-diagonal gates need float32 CPU scales ({H}, {Dout}), got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    return storage(weight.detach()), scale.detach().contiguous().numpy()


def block_diagonal_cpu(x: Tensor, weight: Tensor, bias: Tensor, scale: Tensor | None = None) -> Tensor:
    """x (..., H Din) times the block-diagonal ``weight`` (H, Din, Dout) (float32 or bfloat16, as
    :class:`griffin.layers.BlockDiagonalLinear` holds it, or int8 with its ``scale`` (H, Dout), as
    :class:`griffin.layers.quantized.Int8BlockDiagonalLinear` does) plus ``bias`` (H, Dout) float32: (..., H Dout)
    in x's dtype."""
    H, Din, Dout = weight.shape
    if x.shape[-1] != H * Din:
        raise ValueError(f"block_diagonal_cpu: input width {x.shape[-1]} != the weights' {H} x {Din}")
    w, s = gate_arrays(weight, scale)
    flat = x.reshape(-1, H * Din)
    out = torch.empty(flat.shape[0], H * Dout, dtype=torch.float32)
    if flat.shape[0]:
        parallel_ready()
        _block_diagonal_kernel(_widen_view(flat), w, s, bias.numpy(), out.numpy())
    return out.reshape(*x.shape[:-1], H * Dout).to(x.dtype)


def storage_view(weight: Tensor) -> np.ndarray:
    """:func:`storage` of a weight matrix the kernel reads: float32, bfloat16 or int8, on the CPU, contiguous."""
    if weight.dtype not in WEIGHT_DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"the CPU matvec kernel reads float32, bfloat16 or int8 CPU matrices, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    w = weight.detach()
    if not w.is_contiguous():
        raise ValueError(f"the CPU matvec kernel reads contiguous matrices, got strides {w.stride()}")
    return storage(w)


def padded(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """At least :data:`SLOTS` arrays (the first repeated; no tile refers to the repeats): the kernel's argument is a
    tuple of fixed length, so numba compiles it once per weight dtype."""
    return arrays + (arrays[0],) * max(0, SLOTS - len(arrays))


def tiles_for(rows: Sequence[int], tile: int = TILE) -> Tensor:
    """(T, 4) int64 tiles (matrix, first row, first output column, rows) covering matrices of ``rows`` rows."""
    out, column = [], 0
    for j, n in enumerate(rows):
        out += [(j, r, column + r, min(tile, n - r)) for r in range(0, n, tile)]
        column += n
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 4)


@dataclass
class MatvecWeights:
    """Matrices that read one input, prepared once for :func:`matvec_cpu`: their storage views (shared with the
    tensors), tiles, and concatenated over the matrices: the float32 scales (ones for float weights), biases (zeros
    if none) and int8 weights' :func:`vector_sums` (zeros for float weights)."""

    arrays: tuple[np.ndarray, ...]
    tiles: np.ndarray
    scale: np.ndarray
    bias: np.ndarray
    sums: np.ndarray
    in_features: int
    out_features: int
    matrices: int = SLOTS  # how many of ``arrays`` are matrices (the rest pad the tuple)

    @classmethod
    def prepare(cls, weights: Sequence[Tensor], scales: Sequence[Tensor | None] | None = None,
                biases: Sequence[Tensor | None] | None = None) -> MatvecWeights:
        if not weights or len({w.dtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
            raise ValueError("matvec: weights must be one or more matrices of one dtype and one input width, got "
                             f"{[(w.dtype, tuple(w.shape)) for w in weights]}")
        arrays = padded(tuple(storage_view(w) for w in weights))
        K = weights[0].shape[1]
        quantized = weights[0].dtype == torch.int8
        scales = list(scales) if scales is not None else [None] * len(weights)
        biases = list(biases) if biases is not None else [None] * len(weights)
        if quantized and any(s is None for s in scales):
            raise ValueError("matvec: int8 weights need their scales")
        if not quantized and any(s is not None for s in scales):
            raise ValueError(f"matvec: scales are for int8 weights, not {weights[0].dtype} ones")
        groups = {1 if s is None else s.shape[1] for s in scales}
        if len(groups) != 1 or K % groups.pop():
            raise ValueError(f"matvec: the weights' scales must have one group count dividing {K}, got "
                             f"{[None if s is None else tuple(s.shape) for s in scales]}")
        scale = torch.cat([torch.ones(w.shape[0], 1) if s is None else s.detach().float().reshape(w.shape[0], -1)
                           for w, s in zip(weights, scales, strict=True)])
        bias = torch.cat([torch.zeros(w.shape[0]) if b is None else b.detach().float()
                          for w, b in zip(weights, biases, strict=True)])
        sums = torch.cat([vector_sums(w, scale.shape[1]) if quantized else torch.zeros(w.shape[0], 1, dtype=torch.int32)
                          for w in weights])
        return cls(arrays, tiles_for([w.shape[0] for w in weights]).numpy(), scale.contiguous().numpy(),
                   bias.contiguous().numpy(), sums.numpy(), K, int(scale.shape[0]), len(weights))

    def kernel_args(self) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(arrays, tiles, scale, bias, sums): the matrices as :func:`rows_task` reads them."""
        return self.arrays, self.tiles, self.scale, self.bias, self.sums


def matvec_cpu(x: Tensor, prepared: MatvecWeights, out_dtype: torch.dtype | None = None) -> Tensor:
    """x (..., K) times the prepared matrices (transposed), plus biases, concatenated: (..., N) in ``out_dtype``
    (default x's): :func:`prepare_rows`, then :func:`rows_task` of each tile, in one parallel region."""
    if x.shape[-1] != prepared.in_features:
        raise ValueError(f"matvec: input width {x.shape[-1]} != the weights' {prepared.in_features}")
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape[0], prepared.out_features, dtype=torch.float32)
    if flat.shape[0]:
        parallel_ready()
        _matvec_rows_kernel(_widen_view(flat), *prepared.kernel_args(), kernel_settings(), out.numpy())
    out = out.reshape(*x.shape[:-1], prepared.out_features)
    return out.to(out_dtype or x.dtype)


def _widen_view(x: Tensor) -> np.ndarray:
    """x as :func:`widen` reads it (no copy where possible): bfloat16 as its uint16 bits, anything else as float32,
    contiguous."""
    x = x.contiguous()
    return (x.view(torch.uint16) if x.dtype == torch.bfloat16 else x.to(torch.float32)).numpy()


def kernel_settings() -> tuple[bool, bool, int, bool]:
    """(bfloat16, int8, ahead_bytes, tiles) for :func:`prepare_rows` and :func:`rows_task`, read now: whether to take
    the host's bfloat16 and int8 instructions (:data:`griffin.inference.cpu.isa.FAST_DOTS`), :data:`PREFETCH_BYTES`,
    and whether to take the tile unit (:data:`griffin.inference.cpu.isa.FAST_TILES` holds int8). The kernels are
    compiled with every path the host has (:data:`griffin.inference.cpu.isa.DOT_INSTRUCTIONS`); these flags pick one at
    each call, so that a kernel compiled (or cached) under other settings still follows the current ones."""
    return "bfloat16" in FAST_DOTS, "int8" in FAST_DOTS, int(PREFETCH_BYTES), "int8" in FAST_TILES


# The paths of a call, chosen once its rows are known (:func:`prepare_rows`) and read by every task (:func:`rows_task`).
WIDENED, BF16_ROW, INT8_ROW, INT8_ROWS, INT8_TILES = range(5)
# numba's parallel options for a kernel whose only parallel loops are its ``prange`` ones: no other transformation
# (an ``np.zeros`` or a slice assignment made into a parallel region of its own would cost a wake-up of the threads).
PRANGE_ONLY = dict(comprehension=False, reduction=False, inplace_binop=False, setitem=False, numpy=False,
                   stencil=False, fusion=False, prange=True)


@numba.njit(inline="always")
def rows_buffers(x):
    """What :func:`prepare_rows` writes for rows x (B, K), allocated before a parallel region (its tasks share them):
    (path (1,) int64, x widened to float32 (B, K), high and low bytes of its int16 steps (B', K) uint8 zeros with B'
    B rounded up to :data:`griffin.inference.cpu.isa.ROWS`, steps (B,) float32, the tile unit's packed input
    (zeros))."""
    B, K = x.shape
    P = -(-B // TILE_INPUTS) if B > 1 else 0
    padded_rows = -(-B // ROWS) * ROWS
    return (np.zeros(1, np.int64), np.empty((B, K), np.float32), np.zeros((padded_rows, K), np.uint8),
            np.zeros((padded_rows, K), np.uint8), np.empty(B, np.float32),
            np.zeros((P, K // 4 + 1, TILE_BYTES), np.uint8))


def prepare_rows(x, arrays, settings, buffers):
    """Choose the path for rows x (B, K) (float32, or bfloat16 as its uint16 bits) times matrices prepared as
    :class:`MatvecWeights` holds them, and prepare x for it into ``buffers`` (:func:`rows_buffers`). ``settings`` is
    :func:`kernel_settings`: where it says so and the host has the instruction, one bfloat16 row times bfloat16
    weights through ``vdpbf16ps`` (:func:`_one_row_bf16_task`); int8 weights times rows rounded to int16 steps
    (:func:`griffin.ops.matvec.quantize_row_int16`) through ``vpdpbusd`` (one row:
    :func:`_one_row_int8_task`; several: :func:`_rows_int8_task`) or, several rows where ``settings`` says tiles, the
    tile unit (:func:`_tile_unit_task`); anything else (and rows with an infinite or NaN entry, which int16 steps
    cannot hold) widened to float32 (one row: :func:`_one_row_task`; several: :func:`_widened_task`). Numba only."""
    raise NotImplementedError


@numba.njit(inline="always")
def _widen_rows(x, buffers):
    rows = buffers[1]
    for b in range(x.shape[0]):
        for k in range(x.shape[1]):
            rows[b, k] = widen(x[b, k])
    buffers[0][0] = WIDENED


@overload(prepare_rows)
def _prepare_rows(x, arrays, settings, buffers):
    stored = arrays.dtype.dtype if isinstance(arrays, types.UniTuple) else None
    if stored == types.uint16 and x.dtype == types.uint16 and "bfloat16" in DOT_INSTRUCTIONS:
        def bf16(x, arrays, settings, buffers):
            if x.shape[0] == 1 and settings[0]:
                buffers[0][0] = BF16_ROW
            else:
                _widen_rows(x, buffers)

        return bf16
    if stored == types.int8 and "int8" in DOT_INSTRUCTIONS:
        tile_unit = bool(TILE_INSTRUCTIONS)  # (LLVM cannot compile the tile kernel for a host without it)

        def int8(x, arrays, settings, buffers):
            path, _, high, low, steps, packed = buffers
            B = x.shape[0]
            if settings[1]:
                if B == 1:
                    steps[0] = _quantize_row_int16(x[0], high[0], low[0])
                    if steps[0]:  # else an inf or NaN entry, which int16 steps cannot hold
                        path[0] = INT8_ROW
                        return
                elif _quantize_rows_int16(x, high, low, steps):
                    if tile_unit and settings[3]:
                        _pack_tile_columns(high[:B], low[:B], packed)
                        path[0] = INT8_TILES
                    else:
                        path[0] = INT8_ROWS
                    return
            _widen_rows(x, buffers)

        return int8

    def widened(x, arrays, settings, buffers):
        _widen_rows(x, buffers)

    return widened


def rows_task(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
    """Tile t of out (B, N) float32 = x (B, K) times the matrices (:class:`MatvecWeights`'s
    :meth:`~MatvecWeights.kernel_args`), on the path :func:`prepare_rows` chose (``buffers``). Numba only."""
    raise NotImplementedError


@numba.njit(inline="always")
def _widened_rows_task(t, buffers, arrays, tiles, scale, bias, settings, out):
    rows = buffers[1]
    if rows.shape[0] == 1:
        _one_row_task(t, rows[0], arrays, tiles, scale, bias, settings[2], out[0])
    else:
        _widened_task(t, rows, arrays, tiles, scale, bias, out)


@numba.njit(inline="always")
def _int8_rows_task(t, buffers, arrays, tiles, scale, bias, sums, settings, out):
    path, _, high, low, steps, _ = buffers
    if path[0] == INT8_ROW:
        _one_row_int8_task(t, high[0], low[0], steps[0], arrays, tiles, sums, scale, bias, settings[2], out[0])
    elif path[0] == INT8_ROWS:
        _rows_int8_task(t, high, low, steps, arrays, tiles, sums, scale, bias, settings[2], out)
    else:
        _widened_rows_task(t, buffers, arrays, tiles, scale, bias, settings, out)


@overload(rows_task, inline="always")
def _rows_task(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
    # Each implementation calls its task as a statement and returns nothing: one that returned the (None) value of the
    # inlined call (a lambda) left numba's SSA pass, in the functions that inline this in a loop
    # (griffin.inference.cpu.block_step._matmul_phase), a variable of no scope: a NumbaIRAssumptionWarning per
    # compilation (issue 35).
    stored = arrays.dtype.dtype if isinstance(arrays, types.UniTuple) else None
    if stored == types.uint16 and x.dtype == types.uint16 and "bfloat16" in DOT_INSTRUCTIONS:
        def bf16(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
            if buffers[0][0] == BF16_ROW:
                _one_row_bf16_task(t, x[0], arrays, tiles, bias, settings[2], out[0])
            else:
                _widened_rows_task(t, buffers, arrays, tiles, scale, bias, settings, out)

        return bf16
    if stored == types.int8 and "int8" in DOT_INSTRUCTIONS:
        if not TILE_INSTRUCTIONS:  # (LLVM cannot compile the tile kernel for a host without them)
            def int8(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
                _int8_rows_task(t, buffers, arrays, tiles, scale, bias, sums, settings, out)

            return int8

        def tiled(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
            path, _, high, low, steps, packed = buffers
            if path[0] == INT8_TILES:
                _tile_unit_task(t, high, low, packed, steps, arrays, tiles, sums, scale, bias, _TILE_CONFIG, out)
            else:
                _int8_rows_task(t, buffers, arrays, tiles, scale, bias, sums, settings, out)

        return tiled

    def widened(t, x, buffers, arrays, tiles, scale, bias, sums, settings, out):
        _widened_rows_task(t, buffers, arrays, tiles, scale, bias, settings, out)

    return widened


@kernel(parallel=PRANGE_ONLY, fastmath=True)
def _matvec_rows_kernel(x, arrays, tiles, scale, bias, sums, settings, out):
    """out (B, N) float32 = x (B, K) times the matrices: :func:`prepare_rows`, then the tasks of all tiles
    (:func:`rows_task`) in one parallel region."""
    buffers = rows_buffers(x)
    prepare_rows(x, arrays, settings, buffers)
    for t in prange(tiles.shape[0]):  # (a prange index is unsigned: int64, as a block's tasks, for one compilation)
        rows_task(np.int64(t), x, buffers, arrays, tiles, scale, bias, sums, settings, out)


# An opaque operator for ``torch.compile``: a compiled decode step fuses the elementwise work around it and calls the
# kernel as it is (a plain ``torch.library`` definition, as ``griffin::prepacked_linear``: no per-call checks).
_LIB = torch.library.Library("griffin", "FRAGMENT")
_LIB.define("matvec(Tensor x, Tensor[] weights, Tensor tiles, Tensor scale, Tensor bias, Tensor sums) -> Tensor")


def matvec_op(x: Tensor, weights: list[Tensor], tiles: Tensor, scale: Tensor, bias: Tensor, sums: Tensor) -> Tensor:
    """``griffin::matvec``: :func:`matvec_cpu` from tensors (tiles from :func:`tiles_for`; float32 scale (N, G),
    bias (N,) and int32 sums (N, G) as :class:`MatvecWeights` holds them), output in x's dtype."""
    arrays = padded(tuple(storage_view(w) for w in weights))
    prepared = MatvecWeights(arrays, tiles.numpy(), scale.numpy(), bias.numpy(), sums.numpy(),
                             int(weights[0].shape[1]), int(scale.shape[0]), len(weights))
    return matvec_cpu(x, prepared)


_LIB.impl("matvec", matvec_op, "CPU")


@torch.library.register_fake("griffin::matvec", lib=_LIB)
def _(x: Tensor, weights: list[Tensor], tiles: Tensor, scale: Tensor, bias: Tensor, sums: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], scale.shape[0])


_LIB.define("block_diagonal(Tensor x, Tensor weight, Tensor bias, Tensor? scale=None) -> Tensor")
_LIB.impl("block_diagonal", block_diagonal_cpu, "CPU")


@torch.library.register_fake("griffin::block_diagonal", lib=_LIB)
def _(x: Tensor, weight: Tensor, bias: Tensor, scale: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] * weight.shape[2])
