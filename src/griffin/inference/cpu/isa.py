"""Dot products through the x86 instructions that multiply-accumulate narrow numbers (AVX-512 BF16 and VNNI), as
numba intrinsics for the matvec kernel (:mod:`griffin.inference.cpu.matvec`, Section 5.1).

A decode step at one row reads each weight once and does one multiply-add with it. Widened to float32 one by one,
the weights are consumed at a rate that leaves the memory system idle part of the time; these instructions take 32
or 64 narrow pairs at once, so the kernel streams the weights at close to the read bandwidth:

- :func:`dot_bf16` ``(x, w, offset, start, n, ahead)``: the float32 sum over k in [start, start + n) of x[k]
  w[offset + k], x and w bfloat16 (held as their uint16 bits; w a whole matrix, flat, and offset its row's first
  entry: no view per row); ``vdpbf16ps``: exact products, float32 sums (subnormal bfloat16 inputs count as zero).
  With each vector of w it asks for the line ``ahead`` entries on (at most w's last entry: the end of the matrix), so
  that a row's prefetches are spread over its loads rather than sent in one burst before them;
- :func:`dot_uint16_int8` ``(high, low, w, offset, start, n, ahead)``: the exact sum of u[k] w[offset + k] (an int64)
  for unsigned 16-bit u = 256 high[k] + low[k], held as its two bytes, and int8 w (prefetching as :func:`dot_bf16`):
  ``vpdpbusd`` multiplies unsigned by signed bytes, 64 pairs per instruction, one instruction for each byte of u. The
  int8 kernel's row is int16, x = u - 32768, so x w = u w - 32768 sum(w), with sum(w) computed once per weight row
  and group. (Sign-extending w to 16 bits for ``vpdpwssd`` costs an instruction per 32 weights, and it kept the kernel
  below the read bandwidth.) The int32 sums are exact for n <= :data:`DOT_CHUNK`;
- :func:`dot_rows_uint16_int8`: the same for a block of :data:`WEIGHT_ROWS` weight rows and :data:`ROWS` input
  rows (several rows of a decode step), each loaded vector used for several instructions, sixteen independent
  accumulators.

- :func:`tile_dot_int8`: the same sums for 16 weight rows against 16 columns of unsigned bytes (the high and low
  bytes of 8 input rows) through AMX's ``tdpbsud`` (Intel's tile unit: 16 x 16 x 64 byte products per instruction),
  on hosts that have it (:data:`FAST_TILES`): at several rows, one instruction where :func:`dot_rows_uint16_int8`
  takes 32, so the instruction count no longer limits the kernel.

n must be a multiple of :data:`VECTOR` (several accumulators, so that their chains of multiply-adds overlap).
:data:`DOT_INSTRUCTIONS` names the weight dtypes this host has an instruction for: the kernels that call these are only
compiled where the host has them. :data:`FAST_DOTS` (none with ``GRIFFIN_MATVEC=generic``) and :data:`FAST_TILES` say
whether a process takes them, read at each call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

UNROLL = 4  # accumulators of dot_bf16
VECTOR = 32 * UNROLL  # inputs per loop iteration (dot_uint16_int8: two accumulators per byte of u, 64 inputs each)
# dot_uint16_int8 adds its int32 lanes in int32: at most 255 * 128 per product, so exact up to 2^31 / 32640 inputs.
DOT_CHUNK = 1 << 16


def dot_instructions() -> frozenset[str]:
    """The weight dtypes ("bfloat16", "int8") whose dot product numba compiles with the instructions above for this
    host: the CPU numba compiles for (the host, unless NUMBA_CPU_NAME says otherwise) has them, whatever
    GRIFFIN_MATVEC says. Kernels that hold these paths are compiled (and cached) alike in every process on the host;
    :data:`FAST_DOTS` says whether a process takes them."""
    if numba.config.CPU_NAME not in (None, "host"):
        return frozenset()
    features = llvm.get_host_cpu_features()
    dots = set()
    if features.get("avx512bf16") and features.get("avx512f"):
        dots.add("bfloat16")
    if features.get("avx512vnni") and features.get("avx512bw"):
        dots.add("int8")
    return frozenset(dots)


DOT_INSTRUCTIONS = dot_instructions()


def host_dots() -> frozenset[str]:
    """The weight dtypes whose dot product this process computes with the instructions above
    (:func:`dot_instructions`); none with GRIFFIN_MATVEC=generic."""
    if os.environ.get("GRIFFIN_MATVEC", "").lower() == "generic":
        return frozenset()
    return dot_instructions()


FAST_DOTS = host_dots()

# AMX: tiles of 16 rows x 64 bytes (Intel's Advanced Matrix Extensions). Linux hands a process the tile state only on
# request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
TILE_ROWS, TILE_BYTES = 16, 64  # a tile: 16 rows of 64 bytes; tdpbsud: 16 x 16 int32 sums of 64 products each
TILE_COLUMNS = TILE_BYTES // 4  # int32 columns of the sums' tile: the high and low bytes of 8 input rows


def tile_instructions() -> bool:
    """Whether numba compiles the tile instructions for this host: its CPU has AMX-TILE and AMX-INT8 (x86-64 Linux,
    numba compiling for the host), whatever GRIFFIN_MATVEC says and whether the kernel grants the tile state. Code
    that holds the tile kernel is compiled (and cached) alike in every process on the host; :data:`FAST_TILES` says
    whether a process runs it."""
    features = llvm.get_host_cpu_features()
    return bool(features.get("amx-tile") and features.get("amx-int8") and sys.platform == "linux"
                and platform.machine() == "x86_64" and numba.config.CPU_NAME in (None, "host"))


TILE_INSTRUCTIONS = tile_instructions()


def host_tiles() -> frozenset[str]:
    """{"int8"} where this host multiplies int8 tiles (:func:`tile_instructions`, and the kernel grants this process
    the tile state), else empty (also with GRIFFIN_MATVEC=generic, or GRIFFIN_MATVEC=no-tiles)."""
    if os.environ.get("GRIFFIN_MATVEC", "").lower() in ("generic", "no-tiles") or not tile_instructions():
        return frozenset()
    try:
        granted = ctypes.CDLL(None).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        granted = False
    return frozenset({"int8"}) if granted else frozenset()


FAST_TILES = host_tiles()


def tile_config() -> np.ndarray:
    """The 64-byte tile configuration :func:`tile_dot_int8` loads (``ldtilecfg``): palette 1, tiles 0-2 of 16 rows x
    64 bytes (the sums, the weights, the input bytes)."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    for tile in range(3):
        config[16 + 2 * tile] = TILE_BYTES  # bytes per row (uint16, little-endian)
        config[48 + tile] = TILE_ROWS
    return config


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no bfloat type; the IR is text, so its name is enough)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_F32X16 = ir.VectorType(ir.FloatType(), 16)
_I32X16 = ir.VectorType(ir.IntType(32), 16)
_I8X64 = ir.VectorType(ir.IntType(8), 64)
_BF16X32 = ir.VectorType(_BFloat(), 32)


def _check(x, w, start, n, x_dtype, w_dtype, name):
    for arr, dtype in ((x, x_dtype), (w, w_dtype)):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C" and arr.dtype == dtype):
            raise TypingError(f"{name} reads contiguous 1-D {dtype} arrays, got {arr}")
    if not (isinstance(start, types.Integer) and isinstance(n, types.Integer)):
        raise TypingError(f"{name}: start and n are integers, got {start} and {n}")


def _check_ahead(offset, ahead, name):
    if not (isinstance(offset, types.Integer) and isinstance(ahead, types.Integer)):
        raise TypingError(f"{name}: offset and ahead are integers, got {offset} and {ahead}")


def _load(vector_type, align, as_type=None):
    """A loader of one ``vector_type`` at a pointer, bit-cast to ``as_type``."""
    def load(builder, ptr):
        v = builder.load(builder.bitcast(ptr, vector_type.as_pointer()), align=align)
        return builder.bitcast(v, as_type) if as_type is not None else v

    return load


def _prefetcher(builder, w, ahead):
    """A function of the index k of a vector of the flat matrix ``w``: prefetch (into L2, as :func:`prefetch`) the
    line holding entry k + ahead of w, or w's last entry if that lies further; nothing where ahead is 0."""
    limit = w.nitems
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3),
        "llvm.prefetch.p0")
    i32 = ir.IntType(32)
    wanted = cgutils.is_not_null(builder, ahead)
    last = builder.sub(limit, ir.Constant(limit.type, 1))

    def ask(k):
        with builder.if_then(wanted, likely=True):
            q = builder.add(k, ahead)
            q = builder.select(builder.icmp_signed("<", q, limit), q, last)
            ptr = builder.bitcast(builder.gep(w.data, [q]), ir.IntType(8).as_pointer())
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])

    return ask


@intrinsic
def dot_bf16(typingctx, x, w, offset, start, n, ahead):
    """float32 sum of x[k] w[offset + k] over [start, start + n), x and w uint16 arrays of bfloat16 bits (module
    docstring); with each vector of w, the entry ``ahead`` further on prefetched (at most w's last; ahead 0: none)."""
    _check(x, w, start, n, types.uint16, types.uint16, "dot_bf16")
    _check_ahead(offset, ahead, "dot_bf16")

    def codegen(context, builder, sig, args):
        x, w = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2], strict=True))
        offset, start, n, ahead = (context.cast(builder, a, t, types.intp)
                                   for a, t in zip(args[2:], sig.args[2:], strict=True))
        ask = _prefetcher(builder, w, ahead)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32X16, [_F32X16, _BF16X32, _BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")
        load = _load(_BF16X32, 2)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32X16, None)) for _ in range(UNROLL)]
        with cgutils.for_range_slice(builder, start, builder.add(start, n), ir.Constant(start.type, VECTOR)) as (i, _):
            for u in range(UNROLL):
                k = builder.add(i, ir.Constant(i.type, 32 * u))
                kw = builder.add(k, offset)
                ask(kw)
                xv, wv = load(builder, builder.gep(x.data, [k])), load(builder, builder.gep(w.data, [kw]))
                builder.store(builder.call(fn, [builder.load(accs[u]), xv, wv]), accs[u])
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        reduce = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), _F32X16]),
            "llvm.vector.reduce.fadd.v16f32")
        return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), total])

    return types.float32(x, w, offset, start, n, ahead), codegen


@intrinsic
def dot_uint16_int8(typingctx, high, low, w, offset, start, n, ahead):
    """Exact int64 sum of (256 high[k] + low[k]) w[offset + k] over [start, start + n), high and low uint8, w int8
    (module docstring); with each vector of w, the entry ``ahead`` further on prefetched (as :func:`dot_bf16`)."""
    _check(high, w, start, n, types.uint8, types.int8, "dot_uint16_int8")
    _check(low, w, start, n, types.uint8, types.int8, "dot_uint16_int8")
    _check_ahead(offset, ahead, "dot_uint16_int8")

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:3], args[:3], strict=True)]
        offset, start, n, ahead = (context.cast(builder, a, t, types.intp)
                                   for a, t in zip(args[3:], sig.args[3:], strict=True))
        ask = _prefetcher(builder, arrays[2], ahead)
        # vpdpbusd's operands are declared as 16 int32 lanes, each holding four bytes.
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32X16, [_I32X16] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        load = _load(_I8X64, 1, as_type=_I32X16)
        steps = VECTOR // 64
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_I32X16, None)) for _ in range(steps)]
                for _ in range(2)]  # high, low
        with cgutils.for_range_slice(builder, start, builder.add(start, n), ir.Constant(start.type, VECTOR)) as (i, _):
            for u in range(steps):
                k = builder.add(i, ir.Constant(i.type, 64 * u))
                kw = builder.add(k, offset)
                ask(kw)
                hv, lv, wv = (load(builder, builder.gep(a.data, [q])) for a, q in zip(arrays, (k, k, kw), strict=True))
                for acc, xv in zip(accs, (hv, lv), strict=True):
                    builder.store(builder.call(fn, [builder.load(acc[u]), xv, wv]), acc[u])
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_I32X16]),
                                                "llvm.vector.reduce.add.v16i32")
        i64 = ir.IntType(64)
        sums = []
        for acc in accs:
            total = builder.load(acc[0])
            for a in acc[1:]:
                total = builder.add(total, builder.load(a))
            sums.append(builder.sext(builder.call(reduce, [total]), i64))
        return builder.add(builder.shl(sums[0], ir.Constant(i64, 8)), sums[1])

    return types.int64(high, low, w, offset, start, n, ahead), codegen


# The block of dot_rows_uint16_int8: 4 x 2 x 2 = 16 accumulators, a zmm register each. At 8 input rows, 4 weight
# rows x 2 input rows read faster than 2 x 4, 8 x 1 and 2 x 2 (docs/performance.md).
WEIGHT_ROWS, ROWS = 4, 2


@intrinsic
def dot_rows_uint16_int8(typingctx, high, low, m0, w, r0, last, start, n):
    """The exact int64 sums of (256 high[m, k] + low[m, k]) w[r, k] over k in [start, start + n), for the
    :data:`ROWS` input rows m = m0, m0 + 1, ... and the :data:`WEIGHT_ROWS` weight rows r = r0, r0 + 1, ... (each
    at most ``last``): a tuple of WEIGHT_ROWS ROWS sums, r0's first. high and low (B, K) uint8, w (N, K) int8,
    C-contiguous. Each weight vector is loaded once for all the input rows and each input vector once for all the
    weight rows. n must be a multiple of 64; exact for n <= :data:`DOT_CHUNK`."""
    for arr, dtype in ((high, types.uint8), (low, types.uint8), (w, types.int8)):
        if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout == "C" and arr.dtype == dtype):
            raise TypingError(f"dot_rows_uint16_int8 reads C-contiguous 2-D {dtype} arrays, got {arr}")
    if not all(isinstance(a, types.Integer) for a in (m0, r0, last, start, n)):
        raise TypingError("dot_rows_uint16_int8: m0, r0, last, start and n are integers")

    def codegen(context, builder, sig, args):
        high, low, w = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3))
        m0, r0, last, start, n = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 4, 5, 6, 7))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32X16, [_I32X16] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        load = _load(_I8X64, 1, as_type=_I32X16)

        def row(arr, index):
            return builder.gep(arr.data, [builder.mul(index, builder.extract_value(arr.shape, 1))])

        def plus(v, i):
            return builder.add(v, ir.Constant(v.type, i))

        inputs = [[row(a, plus(m0, m)) for a in (high, low)] for m in range(ROWS)]
        weights = []
        for i in range(WEIGHT_ROWS):
            r = plus(r0, i)
            weights.append(row(w, builder.select(builder.icmp_signed("<=", r, last), r, last)))
        # accs[i][m][p]: weight row i, input row m, byte p (high, low) of u
        accs = [[[cgutils.alloca_once_value(builder, ir.Constant(_I32X16, None)) for _ in range(2)]
                 for _ in range(ROWS)] for _ in range(WEIGHT_ROWS)]
        with cgutils.for_range_slice(builder, start, builder.add(start, n), ir.Constant(start.type, 64)) as (k, _):
            wv = [load(builder, builder.gep(p, [k])) for p in weights]
            for m in range(ROWS):
                for p in range(2):
                    xv = load(builder, builder.gep(inputs[m][p], [k]))
                    for i in range(WEIGHT_ROWS):
                        builder.store(builder.call(fn, [builder.load(accs[i][m][p]), xv, wv[i]]), accs[i][m][p])
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_I32X16]),
                                                "llvm.vector.reduce.add.v16i32")
        i64 = ir.IntType(64)
        out = []
        for i in range(WEIGHT_ROWS):
            for m in range(ROWS):
                high_sum, low_sum = (builder.sext(builder.call(reduce, [builder.load(a)]), i64) for a in accs[i][m])
                out.append(builder.add(builder.shl(high_sum, ir.Constant(i64, 8)), low_sum))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(types.int64, WEIGHT_ROWS * ROWS)(high, low, m0, w, r0, last, start, n), codegen


@intrinsic
def tile_dot_int8(typingctx, config, w, row, packed, start, n, out):
    """out (16, 16) int32 = the sums over k in [start, start + n) of w[row + i, k] b[k, j] for the 16 weight rows from
    ``row`` (w (N, K) int8, C-contiguous) and 16 columns j of unsigned bytes b, ``packed`` (K / 4, 64) uint8 in the
    tile unit's layout: packed[k // 4, 4 j + k % 4] = b[k, j]. Through ``tdpbsud`` (signed times unsigned bytes, int32
    sums: exact for n <= :data:`DOT_CHUNK`), with the tile ``config`` of :func:`tile_config`, loaded and released
    within the call. n must be a multiple of 64 and the 16 rows inside w."""
    for arr, dtype, ndim in ((config, types.uint8, 1), (w, types.int8, 2), (packed, types.uint8, 2),
                             (out, types.int32, 2)):
        if not (isinstance(arr, types.Array) and arr.ndim == ndim and arr.layout == "C" and arr.dtype == dtype):
            raise TypingError(f"tile_dot_int8 reads C-contiguous {ndim}-D {dtype} arrays, got {arr}")
    if not all(isinstance(a, types.Integer) for a in (row, start, n)):
        raise TypingError("tile_dot_int8: row, start and n are integers")

    def codegen(context, builder, sig, args):
        config, w, packed, out = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3, 6))
        row, start, n = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 4, 5))
        i8, i64 = ir.IntType(8), ir.IntType(64)
        i8p = i8.as_pointer()

        def function(name, arguments):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arguments), name)

        def tile(t):
            return ir.Constant(i8, t)

        load, store = (function(f"llvm.x86.{name}", [i8, i8p, i64]) for name in ("tileloadd64", "tilestored64"))
        builder.call(function("llvm.x86.ldtilecfg", [i8p]), [builder.bitcast(config.data, i8p)])
        builder.call(function("llvm.x86.tilezero", [i8]), [tile(0)])
        K = builder.extract_value(w.shape, 1)
        stride = K if K.type == i64 else builder.sext(K, i64)
        first = builder.gep(w.data, [builder.mul(row, K)])
        with cgutils.for_range_slice(builder, start, builder.add(start, n), ir.Constant(start.type, 64)) as (k, _):
            builder.call(load, [tile(1), builder.bitcast(builder.gep(first, [k]), i8p), stride])
            b = builder.gep(packed.data, [builder.mul(k, ir.Constant(k.type, TILE_BYTES // 4))])  # row k / 4
            builder.call(load, [tile(2), builder.bitcast(b, i8p), ir.Constant(i64, TILE_BYTES)])
            builder.call(function("llvm.x86.tdpbsud", [i8, i8, i8]), [tile(0), tile(1), tile(2)])
        builder.call(store, [tile(0), builder.bitcast(out.data, i8p), ir.Constant(i64, 4 * TILE_COLUMNS)])
        builder.call(function("llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return types.none(config, w, row, packed, start, n, out), codegen
