"""Tasks that the threads of one parallel region share, in phases (for a residual block's decode step on CPU,
Section 5.1).

Each numba ``prange`` loop is a parallel region of OpenMP, and where idle threads sleep (griffin's
``OMP_WAIT_POLICY=passive``) every region pays for waking them: tens of microseconds on a virtual machine, where a
decode step's matmuls and kernels take a few each. So a block's step runs as one region in which every thread runs
the same program (:func:`griffin.inference.cpu.block_step`'s block kernels): a sequence of phases (the tiles of a
matmul, the heads of the RG-LRU, a norm), each thread claiming the phase's next task (:func:`claim`: first from a
contiguous share of its own, then from the others') until none is left, marking each done (:func:`finish`), then waiting
until every task of the phase is done (:func:`wait`) before the next.

A thread only waits for tasks that another thread has claimed and is running, and no task waits, so the program
ends whatever number of threads OpenMP gives the region (one thread runs every task; a thread that starts late
finds them done): no deadlock, whatever the schedule. A waiting thread spins on the counter with ``pause`` and
yields its core (``sched_yield``) after :data:`SPINS` turns, so that a host with other busy processes runs them.

Counters (:func:`counters`) are an int64 array: per phase, the tasks claimed from each worker's share and the tasks
each worker has done, zeros at the start, changed only through atomic instructions (sequentially consistent: a task's
writes are visible to a thread that has seen it done). Each worker counts what it has done on a cache line of its own,
so that finishing a task does not take the line from the other cores; only a waiting thread reads them all.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

SPINS = 2000  # pause instructions a waiting thread spins before it yields its core, and between yields
# LLVM's intrinsic for the spin-wait hint (x86 ``pause``, Arm's ``yield`` hint), none elsewhere
_PAUSE = {"x86_64": ("llvm.x86.sse2.pause", []), "AMD64": ("llvm.x86.sse2.pause", []),
          "aarch64": ("llvm.aarch64.hint", [1]), "arm64": ("llvm.aarch64.hint", [1])}.get(platform.machine())


def _counter_pointer(context, builder, sig, args):
    counters = context.make_array(sig.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], sig.args[1], types.intp)
    return builder.gep(counters.data, [index])


def _check_counters(counters, index):
    if not (isinstance(counters, types.Array) and counters.dtype == types.int64 and counters.ndim == 1
            and counters.layout == "C" and isinstance(index, types.Integer)):
        raise TypingError(f"tasks: counters are a C-contiguous 1-D int64 array and an integer index, got {counters} "
                          f"and {index}")


@intrinsic
def _fetch_add(typingctx, counters, index):
    """counters[index] += 1, atomically; returns the value before."""
    _check_counters(counters, index)

    def codegen(context, builder, sig, args):
        ptr = _counter_pointer(context, builder, sig, args)
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(counters, index), codegen


@intrinsic
def _load(typingctx, counters, index):
    """counters[index], read atomically (acquire: what was written before it was set is visible after)."""
    _check_counters(counters, index)

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_counter_pointer(context, builder, sig, args), "acquire", 8)

    return types.int64(counters, index), codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 ``pause``, Arm ``yield``; nothing elsewhere)."""
    def codegen(context, builder, sig, args):
        if _PAUSE is not None:
            name, hint = _PAUSE
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i32] * len(hint)), name)
            builder.call(fn, [ir.Constant(i32, h) for h in hint])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _sched_yield(typingctx):
    """POSIX ``sched_yield()``: let another runnable thread have this core (a call to the C library, resolved when
    numba links the function, so that the function stays cacheable)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


LINE = 8  # int64 entries per counter: each on a cache line of its own (threads that update neighbours would contend)


@numba.njit(inline="always")
def counters(phases, workers):
    """Counters for ``phases`` phases shared by ``workers`` workers (the region's ``prange`` indices)."""
    c = np.zeros((1 + phases * 2 * workers) * LINE, np.int64)
    c[0] = workers
    return c


@numba.njit(inline="always")
def _slot(counters, phase, r):
    """Counter r of ``phase``: r < workers counts the tasks claimed from worker r's share, workers + r those that
    worker r has done."""
    return (1 + phase * 2 * counters[0] + r) * LINE


@numba.njit(inline="always")
def claim(counters, phase, worker, tasks):
    """The next of ``phase``'s ``tasks`` tasks for ``worker``, or ``tasks`` if none is left. The tasks are split
    into one contiguous share per worker, which it takes in order (so that the weights it reads stay one stream),
    then it takes what is left of the others' shares."""
    workers = counters[0]
    for k in range(workers):
        r = (worker + k) % workers
        lo, hi = r * tasks // workers, (r + 1) * tasks // workers
        i = lo + _fetch_add(counters, _slot(counters, phase, r))
        if i < hi:
            return i
    return tasks


@numba.njit(inline="always")
def finish(counters, phase, worker):
    """Mark one task of ``phase`` done by ``worker`` (after its writes)."""
    _fetch_add(counters, _slot(counters, phase, counters[0] + worker))


@numba.njit(inline="always")
def wait(counters, phase, tasks):
    """Return once ``tasks`` tasks of ``phase`` are done: spin, yielding the core every :data:`SPINS` turns."""
    workers = counters[0]
    spins = 0
    while True:
        done = 0
        for r in range(workers):
            done += _load(counters, _slot(counters, phase, workers + r))
        if done >= tasks:
            return
        spins += 1
        if spins == SPINS:
            _sched_yield()
            spins = 0
        else:
            _pause()


@numba.njit(inline="always")
def single(counters, phase):
    """Whether the calling thread is the one to run ``phase``'s only task (the first to ask); it calls
    :func:`finish` after it, and every thread :func:`wait` (``tasks`` 1)."""
    return _fetch_add(counters, _slot(counters, phase, 0)) == 0
