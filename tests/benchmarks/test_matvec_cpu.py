"""``benchmarks/matvec_cpu.py``'s instruction ceiling: the instruction loops count what they run."""

from __future__ import annotations

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


def test_instruction_rates_are_measured_for_the_hosts_instructions():
    rates = load_benchmark("matvec_cpu").instruction_rates(seconds=0.01)
    names = {"int8": "vpdpbusd", "bfloat16": "vdpbf16ps"}
    assert set(rates) == {names[d] for d in isa.FAST_DOTS}
    assert all(r > 0 for r in rates.values())
