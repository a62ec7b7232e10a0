"""What the numba kernels share: the disk cache of their compilations, and the scalar helpers they inline.

**The cache.** A kernel compiled once is kept on disk (in the ``__pycache__`` beside its file) and loaded by later
processes. numba checks a cached compilation against the file that defines the kernel only, but griffin's kernels
inline functions of other files (the decode step's kernels inline the matvec tasks, which inline the instructions of
:mod:`griffin.inference.cpu.isa`): after such a file changed, the cached kernel would run the older code. So the
kernels are declared with :func:`kernel` instead of ``numba.njit(cache=True)``: their cache entries are stamped with
the digest of every kernel source (:data:`KERNEL_SOURCES`), and an entry whose stamp differs is compiled again and
overwritten. Nothing is hashed or deleted on import: the digest is taken at a process's first compilation or cache
lookup.

**Quiet compilations.** numba's warnings about its own internals (:data:`QUIET_WARNINGS`: its pedantic IR checks,
"please report to numba", and its performance remarks) are not shown while a kernel compiles, unless griffin is
verbose (:func:`verbose`: ``griffin --verbose`` or ``GRIFFIN_VERBOSE=1``); the user's own numba functions keep
numba's warnings. (The kernels are written so that they raise none: the filter keeps a numba release's new remarks
out of a user's output.)

**The helpers** (numba only): :func:`exp_vectorizable` and :func:`sigmoid_vectorizable` (an e^x that LLVM vectorises,
where ``math.exp`` is a call to libm; float64), :func:`expm1_typed` and :func:`sigmoid_typed` (the same in their
argument's own precision: float32 vectors hold twice the lanes and need half the polynomial), :func:`widen` (a
stored value as float32) and :func:`narrow` (a float32 as the model stores it: bfloat16 rounded to nearest even, as
``Tensor.to(torch.bfloat16)``), :func:`storage` (the numpy view a kernel reads a tensor through), and
:func:`prefetch` and :func:`prefetch_span` (ask for cache lines ahead of their use: the decode engine's weight rows,
the reverse scans' rows read backwards).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import caching, cgutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.errors import NumbaIRAssumptionWarning, NumbaPerformanceWarning, TypingError
from numba.extending import intrinsic, overload

from griffin.threads import prefer_passive_openmp_wait

PACKAGE = Path(__file__).resolve().parents[1]  # src/griffin
KERNEL_SOURCES = ("ops", "inference/cpu")  # the folders (under the package) whose files kernels are compiled from


@functools.cache
def kernel_sources_digest() -> str:
    """sha256 over the paths and contents of every ``.py`` file under :data:`KERNEL_SOURCES`."""
    digest = hashlib.sha256()
    for folder in KERNEL_SOURCES:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class _StampedBySources:
    """A numba cache locator mixin: the stamp a cache entry is checked against is the digest of every kernel
    source, not of the kernel's own file."""

    def get_source_stamp(self) -> str:
        return kernel_sources_digest()


class _KernelCacheImpl(caching.CompileResultCacheImpl):
    _locator_classes = [type(f"Kernel{c.__name__}", (_StampedBySources, c), {})
                        for c in caching.CompileResultCacheImpl._locator_classes]


class _KernelCache(caching.FunctionCache):
    _impl_class = _KernelCacheImpl


VERBOSE_ENV = "GRIFFIN_VERBOSE"  # set (not "0") by ``griffin --verbose``; inherited by the processes it starts
QUIET_WARNINGS = (NumbaIRAssumptionWarning, NumbaPerformanceWarning)  # not shown while a kernel compiles


def verbose() -> bool:
    """Whether griffin shows its kernels' compiler warnings (:data:`QUIET_WARNINGS`): ``GRIFFIN_VERBOSE`` set to
    anything but ``0`` (``griffin --verbose`` sets it). Read at each compilation."""
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def _quiet(compile: Callable) -> Callable:
    """A dispatcher's ``compile`` (the one way numba compiles it, called or typed from another function) with
    :data:`QUIET_WARNINGS` ignored while it runs, unless :func:`verbose`. (Under numba's compiler lock, which is
    reentrant: the process-wide filters are set and restored by one thread at a time.)"""

    @functools.wraps(compile)
    def quiet_compile(sig):
        if verbose():
            return compile(sig)
        with global_compiler_lock, warnings.catch_warnings():
            for category in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", category=category)
            return compile(sig)

    return quiet_compile


def kernel(**options: object) -> Callable:
    """``numba.njit(**options)`` whose compilations are cached on disk and valid while no kernel source changes,
    and quiet (see the module docstring)."""
    if "cache" in options:
        raise TypeError("kernel() always caches: leave out cache=")

    def wrap(function: Callable) -> Callable:
        dispatcher = numba.njit(**options)(function)
        dispatcher._cache = _KernelCache(dispatcher.py_func)  # what Dispatcher.enable_caching sets, re-stamped
        dispatcher.compile = _quiet(dispatcher.compile)
        return dispatcher

    return wrap


_PARALLEL_READY = False


def parallel_ready() -> None:
    """Called by each entry point before it runs a parallel kernel, which then runs on torch's thread count. At the
    first call, idle OpenMP threads are made to sleep (:func:`griffin.threads.prefer_passive_openmp_wait`, unless the
    program set ``OMP_WAIT_POLICY`` itself):
    numba's OpenMP runtime reads the setting when it starts, at its first parallel kernel, so a program using the
    library gets the griffin command's setting for it without a call of its own. (Spinning idle workers of numba's
    runtime and torch's starve each other's threads.)"""
    global _PARALLEL_READY
    threads = torch.get_num_threads()
    if not _PARALLEL_READY:
        prefer_passive_openmp_wait()
        numba.get_num_threads()  # starts numba's OpenMP pool, which sets torch's thread count to all the cores
        torch.set_num_threads(threads)  # (torch.set_num_threads(1) before griffin's first kernel stays 1)
        _PARALLEL_READY = True
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))  # the kernels run on torch's thread count
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def storage(t: torch.Tensor) -> np.ndarray:
    """The numpy view the kernels read and write (no copy): bfloat16 as its uint16 bits, other dtypes as they are."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


@intrinsic
def _float64_from_bits(typingctx, bits):
    """The float64 whose IEEE-754 bits are the int64 ``bits`` (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bits are the uint32 ``bits`` (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_of_float32(typingctx, value):
    """The IEEE-754 bits of the float32 ``value`` as a uint32 (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask for the cache line holding the entry ``index`` of the C-contiguous array ``arr`` read as flat, into the L2
    cache (LLVM's ``prefetch`` of a read with locality 2, ``prefetcht1`` on x86: into L1 too, it evicted the block
    being computed on). A hint: it never faults, whatever the index, and computes nothing."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and isinstance(index, types.Integer)):
        raise TypingError(f"prefetch reads a C-contiguous array and an integer index, got {arr} and {index}")

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.intp)]), i8p)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])  # read, L2, data
        return context.get_dummy_value()

    return types.none(arr, index), codegen


@numba.njit(inline="always")
def prefetch_span(arr, start, n):
    """:func:`prefetch` the cache lines of the ``n`` entries of the C-contiguous ``arr`` (flat) from ``start``."""
    for k in range(0, n, max(64 // arr.itemsize, 1)):
        prefetch(arr, start + k)


@numba.njit(inline="always")
def _reduce64(z):
    """z (clamped to [-708, 709]) as n ln 2 + r with |r| <= ln(2) / 2 (ln 2 in two parts, Cody-Waite), and
    e^r - 1 = r P(r) by the Taylor polynomial of degree 12 (truncation below 2e-16): (2^n, r P(r))."""
    w = min(max(z, -708.0), 709.0)
    n = math.floor(w * 1.4426950408889634 + 0.5)
    r = (w - n * 6.93145751953125e-1) - n * 1.42860682030941723212e-6
    p = 1.0 / 479001600.0  # 1/12!
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    return _float64_from_bits((np.int64(n) + np.int64(1023)) << np.int64(52)), p * r


@numba.njit(inline="always")
def exp_vectorizable(z):
    """exp(z) in float64 from operations LLVM vectorises (:func:`_reduce64`; 2^n from its exponent bits). Within a
    few ulp of exp on [-708, 709]; saturates outside (about 3e-308 below, 8e307 above); NaN stays NaN."""
    scale, q = _reduce64(z)
    e = (q + 1.0) * scale
    return e if z == z else z


@numba.njit(inline="always")
def sigmoid_vectorizable(z):
    """1 / (1 + exp(-z)) through :func:`exp_vectorizable` (float64)."""
    return 1.0 / (1.0 + exp_vectorizable(-z))


@numba.njit(inline="always")
def _expm1_64(z):
    scale, q = _reduce64(z)
    e = scale * q + (scale - 1.0)
    return e if z == z else z


_F = np.float32


@numba.njit(inline="always")
def _expm1_32(z):
    """e^z - 1 in float32: z (clamped to [-87, 88]) = n ln 2 + r, |r| <= ln(2) / 2, e^r - 1 = r + r^2 P(r) with
    Cephes' degree-5 minimax P for expf, then 2^n (e^r - 1) + (2^n - 1)."""
    w = min(max(z, _F(-87.0)), _F(88.0))
    n = np.floor(w * _F(1.44269504) + _F(0.5))
    r = (w - n * _F(0.693359375)) - n * _F(-2.12194440e-4)
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    q = p * r * r + r
    scale = float32_from_bits(np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)))
    e = scale * q + (scale - _F(1.0))
    return e if z == z else z


def expm1_typed(z):
    """e^z - 1 in z's own precision (float32 or float64) from operations LLVM vectorises; exact to a few ulp also
    for z near 0, where exp(z) - 1 cancels. Within 2 ulp (float32) on [-87, 88], saturating outside (at about
    -1 and 1.7e38 - 1); NaN stays NaN. numba only."""
    raise NotImplementedError  # numba only (the overload below)


@overload(expm1_typed, inline="always")
def _expm1_typed(z):
    if z == types.float32:
        return lambda z: _expm1_32(z)
    if z == types.float64:
        return lambda z: _expm1_64(z)
    raise TypingError(f"expm1_typed: no float32 or float64 value: {z}")


@numba.njit(inline="always")
def sigmoid_typed(z):
    """1 / (1 + e^-z) in z's own precision (float32 or float64), through :func:`expm1_typed` (its float32 constants
    widen exactly for a float64 z)."""
    return _F(1.0) / (_F(2.0) + expm1_typed(-z))


def widen(v):
    """A stored value as float32: bfloat16 (its bits as uint16) shifted into the high half, int8 converted."""
    raise NotImplementedError  # numba only (the overload below)


@overload(widen, inline="always")
def _widen(v):
    if v == types.uint16:
        return lambda v: float32_from_bits(np.uint32(v) << np.uint32(16))
    if v in (types.int8, types.float32):
        return lambda v: np.float32(v)
    raise TypingError(f"widen: no widening for values of type {v}")


def narrow(v, like):
    """float32 ``v`` stored as ``like``'s type: bfloat16 bits (rounded to nearest even), or float32. Mirrors
    :meth:`torch.Tensor.to` (the model's rounding to its dtype)."""
    raise NotImplementedError  # numba only (the overload below)


@overload(narrow, inline="always")
def _narrow(v, like):
    if like == types.uint16:
        def to_bfloat16(v, like):
            bits = bits_of_float32(np.float32(v))
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            quiet = (bits >> np.uint32(16)) | np.uint32(0x40)  # a NaN stays a NaN
            nan = np.int64((bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
            return np.uint16(np.int64(rounded) + nan * (np.int64(quiet) - np.int64(rounded)))  # no branch: vectorised

        return to_bfloat16
    if like == types.float32:
        return lambda v, like: np.float32(v)
    raise TypingError(f"narrow: no storage for values of type {like}")
