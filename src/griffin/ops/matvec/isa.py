"""Dot products through the x86 instructions that multiply-accumulate narrow numbers (AVX-512 BF16 and VNNI), as
numba intrinsics for the one-row matvec kernel (:mod:`griffin.ops.matvec.cpu`, Section 5.1).

A decode step at one row reads each weight once and does one multiply-add with it. Widened to float32 one by one,
the weights are consumed at a rate that leaves the memory system idle part of the time; these instructions take 32
narrow pairs at once, so the kernel streams the weights at close to the read bandwidth:

- :func:`dot_bf16` ``(x, w, start, n)``: the float32 sum over k in [start, start + n) of x[k] w[k], x and w
  bfloat16 (held as their uint16 bits); ``vdpbf16ps``: exact products, float32 sums (subnormal bfloat16 inputs
  count as zero);
- :func:`dot_int16_int8` ``(x, w, start, n)``: the sum of x[k] w[k] for int16 x and int8 w (w sign-extended to 16
  bits; ``vpdpwssd``), exact in each int32 lane for n <= :data:`INT16_CHUNK`, the lanes summed in float32.

n must be a multiple of :data:`VECTOR` (four accumulators of 32 pairs, so that four chains of multiply-adds
overlap). :data:`FAST_DOTS` names the weight dtypes this host has an instruction for (none on a host without them,
or with ``GRIFFIN_MATVEC=generic``): the kernels that call these are only compiled where they run.
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

UNROLL = 4  # accumulators
VECTOR = 32 * UNROLL  # inputs per loop iteration
# An int32 lane adds two products of |int16| <= 32767 and |int8| <= 127 per instruction, one instruction per VECTOR
# inputs: over 16384 inputs (128 instructions, 256 products) it stays below 2^30.
INT16_CHUNK = 16384


def host_dots() -> frozenset[str]:
    """The weight dtypes ("bfloat16", "int8") whose dot product this host computes with the instructions above, for
    the CPU numba compiles for (the host, unless NUMBA_CPU_NAME says otherwise); none with GRIFFIN_MATVEC=generic."""
    if os.environ.get("GRIFFIN_MATVEC", "").lower() == "generic" or numba.config.CPU_NAME not in (None, "host"):
        return frozenset()
    features = llvm.get_host_cpu_features()
    dots = set()
    if features.get("avx512bf16") and features.get("avx512f"):
        dots.add("bfloat16")
    if features.get("avx512vnni") and features.get("avx512bw"):
        dots.add("int8")
    return frozenset(dots)


FAST_DOTS = host_dots()


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
_I16X32 = ir.VectorType(ir.IntType(16), 32)
_I8X32 = ir.VectorType(ir.IntType(8), 32)
_BF16X32 = ir.VectorType(_BFloat(), 32)


def _check(x, w, start, n, x_dtype, w_dtype, name):  # type: ignore[no-untyped-def]
    for arr, dtype in ((x, x_dtype), (w, w_dtype)):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C" and arr.dtype == dtype):
            raise TypingError(f"{name} reads contiguous 1-D {dtype} arrays, got {arr}")
    if not (isinstance(start, types.Integer) and isinstance(n, types.Integer)):
        raise TypingError(f"{name}: start and n are integers, got {start} and {n}")


def _dot_loop(context, builder, sig, args, instruction, acc_type, operand_type, x_load,  # type: ignore[no-untyped-def]
              w_load):
    """IR of UNROLL accumulators of ``acc_type`` fed by ``instruction(acc, x_load(x + k), w_load(w + k))`` (both
    ``operand_type``) for k in [start, start + n) in steps of VECTOR; returns the float32 sum of all their lanes."""
    x = context.make_array(sig.args[0])(context, builder, args[0])
    w = context.make_array(sig.args[1])(context, builder, args[1])
    start, n = (context.cast(builder, a, t, types.intp) for a, t in zip(args[2:], sig.args[2:], strict=True))
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(acc_type, [acc_type, operand_type, operand_type]), instruction)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(acc_type, None)) for _ in range(UNROLL)]
    with cgutils.for_range_slice(builder, start, builder.add(start, n), ir.Constant(start.type, VECTOR)) as (i, _):
        for u in range(UNROLL):
            k = builder.add(i, ir.Constant(i.type, 32 * u))
            xv, wv = x_load(builder, builder.gep(x.data, [k])), w_load(builder, builder.gep(w.data, [k]))
            builder.store(builder.call(fn, [builder.load(accs[u]), xv, wv]), accs[u])
    # int32 lanes become float32 before they are added up (their sum could overflow)
    vectors = [builder.load(acc) for acc in accs]
    vectors = [v if acc_type == _F32X16 else builder.sitofp(v, _F32X16) for v in vectors]
    total = vectors[0]
    for v in vectors[1:]:
        total = builder.fadd(total, v)
    reduce = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), _F32X16]), "llvm.vector.reduce.fadd.v16f32")
    return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), total])


def _load(vector_type, align, widen_to=None, as_type=None):  # type: ignore[no-untyped-def]
    """A loader of one ``vector_type`` at a pointer, sign-extended to ``widen_to`` and bit-cast to ``as_type``."""
    def load(builder, ptr):  # type: ignore[no-untyped-def]
        v = builder.load(builder.bitcast(ptr, vector_type.as_pointer()), align=align)
        v = builder.sext(v, widen_to) if widen_to is not None else v
        return builder.bitcast(v, as_type) if as_type is not None else v

    return load


@intrinsic
def dot_bf16(typingctx, x, w, start, n):  # type: ignore[no-untyped-def]
    """float32 sum of x[k] w[k] over [start, start + n), x and w uint16 arrays of bfloat16 bits (module docstring)."""
    _check(x, w, start, n, types.uint16, types.uint16, "dot_bf16")

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        load = _load(_BF16X32, 2)
        return _dot_loop(context, builder, sig, args, "llvm.x86.avx512bf16.dpbf16ps.512", _F32X16, _BF16X32, load,
                         load)

    return types.float32(x, w, start, n), codegen


@intrinsic
def dot_int16_int8(typingctx, x, w, start, n):  # type: ignore[no-untyped-def]
    """Sum of x[k] w[k] over [start, start + n), x int16 and w int8, as float32 (module docstring)."""
    _check(x, w, start, n, types.int16, types.int8, "dot_int16_int8")

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        # The instruction's operands are declared as 16 int32 lanes, each holding two int16 numbers.
        return _dot_loop(context, builder, sig, args, "llvm.x86.avx512.vpdpwssd.512", _I32X16, _I32X16,
                         _load(_I16X32, 2, as_type=_I32X16), _load(_I8X32, 1, _I16X32, _I32X16))

    return types.float32(x, w, start, n), codegen
