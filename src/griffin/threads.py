"""How the process's OpenMP threads wait: a setting for the program that runs griffin, made by an explicit call (the
``griffin`` command makes it first thing). Imports nothing at its top, so that it can run before torch is imported."""

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


#: How long torch's idle OpenMP workers spin (pause instructions, ``GOMP_SPINCOUNT``) in a process that trains on CPU
TRAINING_SPINCOUNT = 20000


def prefer_training_openmp_wait(spins: int = TRAINING_SPINCOUNT) -> None:
    """For a process that trains on CPU (the ``griffin train``, ``finetune`` and ``synth`` commands): torch's idle
    OpenMP workers spin about ``spins`` pause instructions before they sleep; numba's sleep at once, as with
    :func:`prefer_passive_openmp_wait`, which this also makes.

    A compiled training step runs hundreds of parallel regions (each generated kernel, each matmul) and under passive
    waiting each one first wakes a sleeping worker; a short spin finds it awake (docs/performance.md, "OpenMP's wait
    policy"). numba's workers stay passive so that they never spin against torch's, whose regions surround every
    numba kernel.

    Imports torch, whose runtime reads ``GOMP_SPINCOUNT`` as it loads, then removes the variable again: numba's
    runtime (started by griffin's first parallel kernel) and child processes do not see it. No effect on torch if it
    is already imported; the environment's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins (child processes of a
    griffin command inherit its passive setting, and so keep it)."""
    own = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    prefer_passive_openmp_wait()
    if own or spins <= 0:
        return
    os.environ["GOMP_SPINCOUNT"] = str(spins)
    try:
        import torch  # noqa: F401  (loads torch's OpenMP runtime, which reads the setting now)
    finally:
        del os.environ["GOMP_SPINCOUNT"]


__all__ = ["TRAINING_SPINCOUNT", "prefer_passive_openmp_wait", "prefer_training_openmp_wait"]
