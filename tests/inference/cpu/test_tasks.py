"""griffin.inference.cpu.tasks: the phases of one parallel region run every task exactly once and end, whatever number
of threads OpenMP gives the region (a residual block's decode step, griffin.inference.cpu.block_step, relies on it)."""

import json
import os
import subprocess
import sys

import numpy as np

PROGRAM = r"""
import json, sys
import numba, numpy as np
from numba import prange
from griffin.inference.cpu.matvec import PRANGE_ONLY
from griffin.inference.cpu.tasks import claim, counters, finish, single, wait

@numba.njit(parallel=PRANGE_ONLY)
def phases(x, workers, runs, order):
    # phase 0: out0 = 2 x, a task per entry; phase 1 (one task): their sum; phase 2: out0 + the sum, a task per entry.
    # runs counts how often each task of phase 0 ran; order[k] the task of phase 0 that started k-th.
    n = x.shape[0]
    out0, total, out2, started = np.zeros(n), np.zeros(1), np.zeros(n), np.zeros(1, np.int64)
    c = counters(3, workers)
    for w in prange(workers):
        worker = np.int64(w)
        t = claim(c, 0, worker, n)
        while t < n:
            order[started[0]] = t  # (exact where one thread runs the region, which the order check uses)
            started[0] += 1
            runs[t] += 1
            out0[t] = 2 * x[t]
            finish(c, 0, worker)
            t = claim(c, 0, worker, n)
        wait(c, 0, n)
        if single(c, 1):
            total[0] = out0.sum()
            finish(c, 1, worker)
        wait(c, 1, 1)
        t = claim(c, 2, worker, n)
        while t < n:
            out2[t] = out0[t] + total[0]
            finish(c, 2, worker)
            t = claim(c, 2, worker, n)
        wait(c, 2, n)
    return out2

out = []
for threads in (1, 2):
    numba.set_num_threads(threads)
    for workers in (1, 2, 3, 5):
        for n in (0, 1, 7, 100):
            x = np.arange(n, dtype=np.float64) + 1
            runs, order = np.zeros(n, np.int64), np.full(n + 8, -1, np.int64)
            got = phases(x, workers, runs, order)
            out.append(dict(threads=threads, workers=workers, n=n, got=got.tolist(), runs=runs.tolist(),
                            order=order[:n].tolist()))
print(json.dumps(out))
"""


def test_phases_run_each_task_once_and_end_with_any_thread_count():
    """1 or 2 threads for 1, 2, 3 or 5 workers (more workers than threads: a thread runs several workers' programs
    one after the other, the first of which waits for tasks of the others' shares), 0 to 100 tasks: every task of a
    phase runs once, a phase sees the whole phase before it (phase 2 reads phase 1's sum of phase 0), and the region
    ends (in a child process with a time limit: a deadlock fails the test rather than hanging the suite). With one
    thread, worker 0 takes its own contiguous share in order, then the others' in order (so the tasks run 0, 1, ...,
    n - 1)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(cases) == 2 * 4 * 4
    for case in cases:
        n = case["n"]
        x = np.arange(n, dtype=np.float64) + 1
        assert case["runs"] == [1] * n, case
        assert case["got"] == (2 * x + 2 * x.sum()).tolist(), case
        if case["threads"] == 1:
            assert case["order"] == list(range(n)), case
