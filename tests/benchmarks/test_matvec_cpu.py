"""``benchmarks/matvec_cpu.py``'s instruction ceiling: the instruction loops count what they run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from griffin.inference.cpu import isa
from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.skipif("int8" not in isa.FAST_DOTS, reason="this host has no unsigned x signed byte instruction")
def test_the_int8_block_loop_sums_every_output_of_every_call():
    """The loop the vpdpbusd rate is timed on uses all the block's sums (none can be compiled away), and each call
    starts at another offset: its total is the sum of the exact dot products it names."""
    bench = load_benchmark("matvec_cpu")
    gen = np.random.default_rng(0)
    k = 2048 + 512
    high, low = (gen.integers(0, 256, (isa.ROWS, k)).astype(np.uint8) for _ in range(2))
    w = gen.integers(-128, 128, (isa.WEIGHT_ROWS, k)).astype(np.int8)
    u = high.astype(np.int64) * 256 + low
    expected = sum(int((u[:, s : s + k - 256] @ w[:, s : s + k - 256].T.astype(np.int64)).sum())
                   for s in ((r % 4) * 64 for r in range(6)))
    assert bench._int8_block_loop(high, low, w, 6) == expected


NAMES = {"int8": "vpdpbusd", "bfloat16": "vdpbf16ps"}


def test_instruction_rates_are_measured_for_the_hosts_instructions():
    """The rates of exactly the instructions the host's kernels take (none on a host without them)."""
    rates = load_benchmark("matvec_cpu").instruction_rates(seconds=0.01)
    assert set(rates) == {NAMES[d] for d in isa.FAST_DOTS}


def test_an_instruction_rate_is_the_loops_instructions_over_their_time(monkeypatch):
    """Each rate is the instructions its loop runs over the time they took: loops that take a known time per call on
    a fake clock (any host) give exactly that rate, once each loop was timed over at least a quarter of the time
    asked for. Per call, the int8 block loop runs two ``vpdpbusd`` per 64 inputs of each of its rows x weight rows,
    the bfloat16 loop one ``vdpbf16ps`` per 32 inputs (the inputs a call sums: the test above)."""
    bench = load_benchmark("matvec_cpu")
    clock, seconds_per_call, timed = [0.0], {"vpdpbusd": 1e-7, "vdpbf16ps": 3e-7}, {}

    def fake(name, instructions_per_call):
        def loop(*args):
            *operands, reps = args
            per_call = instructions_per_call(*operands)
            timed.setdefault(name, []).append((reps, per_call))
            clock[0] += reps * seconds_per_call[name]
            return 0

        return loop

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench, "_int8_block_loop", fake("vpdpbusd", lambda high, low, w: (
        2 * high.shape[0] * w.shape[0] * (high.shape[1] - 256) // 64)))
    monkeypatch.setattr(bench, "_bf16_loop", fake("vdpbf16ps", lambda x, w: (x.shape[0] - 512) // 32))
    rates = bench.instruction_rates(seconds=0.01, dots=frozenset(NAMES))
    assert set(rates) == set(NAMES.values()) == set(timed)
    for name, rate in rates.items():
        (reps, per_call), *_ = timed[name][-3:]  # the three timed runs (after the compile and the growing ones)
        assert set(timed[name][-3:]) == {(reps, per_call)} and reps * seconds_per_call[name] >= 0.01 / 4
        assert rate == pytest.approx(per_call / seconds_per_call[name] / 1e9, rel=1e-9), name
