"""How the process's OpenMP threads wait: a setting for the program that runs griffin, made by an explicit call (the
``griffin`` command makes it first thing). Imports nothing, so that it can run before torch is imported."""

from __future__ import annotations

import os


def prefer_passive_openmp_wait() -> None:
    """Let OpenMP threads that wait for work sleep instead of spinning: ``OMP_WAIT_POLICY=passive`` unless the
    environment already sets it (the user's own setting wins).

    Two OpenMP runtimes share a griffin process: torch's bundled libgomp and the system one under numba's parallel
    kernels (the RG-LRU, the CPU decode engine). With the default, spinning, policy the idle workers of one starve the
    other's threads and, on a shared host, every other process: forward passes, training steps and decode steps on the
    2-core development host ran several times slower. The cost of passive waiting is the wake-up of a sleeping worker
    at each parallel region (tens of microseconds; ``GOMP_SPINCOUNT`` trades it back, benchmarks/openmp_wait.py).

    Each runtime reads the variable once, when it loads: call this before ``import torch`` (torch loads its runtime
    on import) for it to reach both runtimes; called later, it reaches numba's runtime if no numba kernel has run yet,
    and child processes started afterwards. ``griffin.cli.main`` calls it before importing torch, and griffin's first
    parallel kernel of a process calls it (:func:`griffin.ops.jit.parallel_ready`), which reaches numba's runtime; a
    program using the library that wants torch's runtime to sleep too calls it first::

        import griffin.threads

        griffin.threads.prefer_passive_openmp_wait()  # before torch is imported (``import griffin`` does not)
        import torch
        from griffin import load_for_use
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


__all__ = ["prefer_passive_openmp_wait"]
