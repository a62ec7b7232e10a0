"""The RG-LRU operator on CPU (Section 2.4): the fused numba kernel against the unfused paths, on the same inputs.

    fused     rg_lru backend "cpu": gates, decay, sqrt(1 - a^2) and the scan in one numba pass each way
    unfused   rg_lru backend "torch": the gate math in PyTorch (vectorised), then griffin's numba scan
    assoc     the gate math in PyTorch, then the associative scan (scan backend "assoc")

Timed forward (no autograd) and forward+backward (backward of the sum of y), median of --repeats after a warm-up,
interleaved per shape so that host load drifts hit every path alike, with the C heap keeping freed memory as in the
training commands (:func:`griffin.heap.keep_freed_memory`: otherwise the outputs' fresh pages, faulted in at each
call or not as glibc's thresholds happen to be, dominate the backward's time). GB/s = bytes an ideal fused kernel
must move (forward: read x, gate_x, gate_a, write y; backward additionally read dy and write three gradients) / time.
``--cold`` evicts the caches (:func:`common.evict_caches`) before the forward and again between it and the
backward, timed apart, as in a training step, where megabytes of other operators' data pass between an operator's
forward and its backward (at the synthetic models' 16×256×64 the inputs otherwise stay in L3).

    python benchmarks/rg_lru_cpu.py                       # fp32, a few training and prefill shapes
    python benchmarks/rg_lru_cpu.py --shapes 8x2048x1024 --dtype bfloat16
    python benchmarks/rg_lru_cpu.py --shapes 16x256x64 --paths fused --cold --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from griffin.ops.rg_lru import rg_lru, rg_lru_gates
from griffin.ops.scan import linear_scan

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    evict_caches,
    interleaved_forward_backward,
    keep_freed_memory,
    machine_info,
    write_json,
)

keep_freed_memory()  # as the training commands

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCANS = {"unfused": "cpu", "assoc": "assoc"}  # the scan after the PyTorch gate math


def forward(path: str, x, gx, ga, lam, reset) -> torch.Tensor:
    if path == "fused":
        return rg_lru(x, gx, ga, lam, 8.0, None, reset, backend="cpu")[0]
    a, b = rg_lru_gates(x, gx, ga, lam, 8.0, reset)
    return linear_scan(a, b, None, reset, backend=SCANS[path])[0]


def run(path: str, x, gx, ga, lam, reset, backward: bool) -> None:
    with torch.set_grad_enabled(backward):
        y = forward(path, x, gx, ga, lam, reset)
        if backward:
            y.sum().backward()


def cold_times(paths: list[str], inputs: tuple, rounds: int) -> dict[str, tuple[float, float]]:
    """Per path, the median seconds of the forward and of forward + backward, each timed after the caches were
    evicted, over ``rounds`` interleaved rounds (one untimed first)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for r in range(rounds + 1):
        for name in paths:
            evict_caches()
            start = time.perf_counter()
            y = forward(name, *inputs)
            fwd = time.perf_counter() - start
            grad = torch.ones_like(y)
            evict_caches()
            start = time.perf_counter()
            y.backward(grad)
            if r:
                times[name].append((fwd, fwd + time.perf_counter() - start))
    return {name: (statistics.median_high(t[0] for t in ts), statistics.median_high(t[1] for t in ts))
            for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4x1024x336", "8x2048x320", "16x1024x256", "2x4096x1024"],
                   help="BxTxD shapes (defaults: the Figure 9b Hawk, Figure 3, the inference prefill, a wide one)")
    p.add_argument("--paths", nargs="+", choices=["fused", *SCANS], default=["fused", *SCANS])
    p.add_argument("--resets", type=float, default=0.0, help="probability of a document start per token")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="evict the caches before the forward and the backward")
    p.add_argument("--out", default="benchmarks/results/rg_lru_cpu.json")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    info = machine_info(torch.device("cpu"))
    print(f"{info['cpu']}, {info['threads']} threads, {args.dtype}{', cold caches' if args.cold else ''}; "
          f"load average {info['load_average'][0]:.2f}")
    print("| B×T×D | path | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s | fwd vs fused | fwd+bwd vs fused |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for shape in args.shapes:
        B, T, D = (int(n) for n in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        x, gx, ga = (torch.randn(B, T, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
        lam = torch.randn(D, generator=g).requires_grad_()
        reset = torch.rand(B, T, generator=g) < args.resets if args.resets else None
        size = B * T * D * x.element_size()
        inputs = (x, gx, ga, lam, reset)
        med = (cold_times(args.paths, inputs, args.repeats) if args.cold else
               interleaved_forward_backward(args.paths, lambda name, bwd, a=inputs: run(name, *a, bwd), args.repeats))
        base = med.get("fused", next(iter(med.values())))
        for name, (fwd, fb) in med.items():
            row = dict(shape=shape, path=name, forward_s=fwd, forward_backward_s=fb,
                       forward_gbs=4 * size / fwd / 1e9, forward_backward_gbs=12 * size / fb / 1e9)
            rows.append(row)
            print(f"| {shape} | {name} | {1e3 * fwd:.1f} | {row['forward_gbs']:.1f} | {1e3 * fb:.1f} | "
                  f"{row['forward_backward_gbs']:.1f} | {fwd / base[0]:.2f} | {fb / base[1]:.2f} |", flush=True)
    write_json(args.out, dict(machine=info, args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
