"""Benchmark the CPU linear scan against memory bandwidth and Python-loop scans (paper, Section 4.2).

The scan is memory bound, so the yardstick is the bandwidth of a large tensor copy (read + write bytes). An
ideal scan moves, in elements of the input dtype, forward 3·B·T·D (read a, b; write h) and backward 5·B·T·D
(read a, g, h; write grad_a, grad_b). The copy and the fast scan are timed in interleaved rounds so that drift
in the machine's bandwidth hits them alike; the slow Python loops are timed after them.

    PYTHONPATH=src python benchmarks/scan_cpu.py                 # B=8, T=2048, D=1024, float32
    PYTHONPATH=src python benchmarks/scan_cpu.py --batch 1 --dtype bfloat16 --out /tmp/scan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import torch
from torch import Tensor

from griffin.ops.scan import linear_scan
from griffin.ops.scan.cpu import _backward_kernel, _forward_kernel, channel_chunk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def seconds(fn: Callable[[], object]) -> float:
    """Wall-clock time of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_loop_scan(a: Tensor, b: Tensor) -> Tensor:
    """Today's approach in the HF / official PyTorch ports: index a[:, t] in a loop, differentiate with autograd.

    Each a[:, t] backward scatters into a zero tensor of the full input size, so its backward is O(T²·B·D).
    """
    h = torch.zeros_like(b[:, 0])
    hs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, dim=1)


def unbind_loop_scan(a: Tensor, b: Tensor) -> Tensor:
    """The same loop over a.unbind(1): its backward stacks the per-step gradients once, O(T·B·D)."""
    h = torch.zeros_like(b[:, 0])
    hs = []
    for a_t, b_t in zip(a.unbind(1), b.unbind(1), strict=True):
        h = a_t * h + b_t
        hs.append(h)
    return torch.stack(hs, dim=1)


def cpu_model() -> str:
    """The ``lscpu`` model name (falls back to platform.processor())."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), platform.processor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=25, help="interleaved rounds of copy and fast scan")
    parser.add_argument("--loop-repeats", type=int, default=3, help="timed calls of the faster Python loops")
    parser.add_argument("--skip-hf-loop", action="store_true", help="skip the O(T²) HF-style loop backward")
    parser.add_argument("--copy-mib", type=int, default=512, help="size of the tensor copied for the bandwidth")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scan_cpu.json"))
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    numba.set_num_threads(cores)
    dtype = DTYPES[args.dtype]
    shape = (args.batch, args.time, args.dim)
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(shape, generator=gen).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    a_req, b_req = a.clone().requires_grad_(), b.clone().requires_grad_()
    elem = a.numel() * a.element_size()
    src = torch.ones(args.copy_mib * 2**20 // 4)
    dst = torch.zeros_like(src)

    # the kernels alone, on float32 copies of the inputs and preallocated (already faulted-in) outputs
    f32 = [x.float().numpy() for x in (a, b, g)]
    h0, flags = torch.zeros(args.batch, args.dim).numpy(), torch.zeros(args.batch, args.time, dtype=torch.bool).numpy()
    out = [torch.zeros(shape).numpy() for _ in range(3)] + [torch.zeros(args.batch, args.dim).numpy()]
    chunk = channel_chunk(args.batch, args.dim)

    fast = {  # name: (function, bytes it moves)
        "copy_ (preallocated)": (lambda: dst.copy_(src), 2 * src.numel() * 4),
        "clone (allocating)": (src.clone, 2 * src.numel() * 4),
        "cpu scan, forward": (lambda: linear_scan(a, b, backend="cpu"), 3 * elem),
        "cpu scan, forward+backward": (
            lambda: torch.autograd.grad(linear_scan(a_req, b_req, backend="cpu")[0], (a_req, b_req), g),
            8 * elem,
        ),
        "forward kernel only (float32, outputs preallocated)": (
            lambda: _forward_kernel(f32[0], f32[1], h0, flags, chunk, out[0], out[3]),
            3 * a.numel() * 4,
        ),
        "backward kernel only (float32, outputs preallocated)": (
            lambda: _backward_kernel(f32[0], out[0], h0, flags, f32[2], h0, chunk, out[1], out[2], out[3]),
            5 * a.numel() * 4,
        ),
    }
    slow = {  # name: (function, bytes it moves, timed calls)
        "python loop (HF-style a[:, t]), forward": (lambda: hf_loop_scan(a, b), 3 * elem, args.loop_repeats),
        "python loop (unbind), forward+backward": (
            lambda: torch.autograd.grad(unbind_loop_scan(a_req, b_req), (a_req, b_req), g),
            8 * elem,
            args.loop_repeats,
        ),
    }
    if not args.skip_hf_loop:  # minutes at the default shape: timed once
        slow["python loop (HF-style a[:, t]), forward+backward"] = (
            lambda: torch.autograd.grad(hf_loop_scan(a_req, b_req), (a_req, b_req), g),
            8 * elem,
            1,
        )

    for fn, _ in fast.values():  # warm up: numba compilation (or cache load), first touch of the buffers
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fast}
    for _ in range(args.repeats):
        for name, (fn, _) in fast.items():
            times[name].append(seconds(fn))
    for name, (fn, _, calls) in slow.items():
        times[name] = [seconds(fn) for _ in range(calls)]

    nbytes = {name: v[1] for name, v in (fast | slow).items()}
    copy_times = times["copy_ (preallocated)"]
    copy_gbs = nbytes["copy_ (preallocated)"] / min(copy_times) / 1e9
    copy_median_gbs = nbytes["copy_ (preallocated)"] / statistics.median(copy_times) / 1e9
    results = {}
    for name, ts in times.items():
        median, best = statistics.median(ts), min(ts)
        results[name] = {
            "median_ms": median * 1e3,
            "best_ms": best * 1e3,
            "calls": len(ts),
            "bytes": nbytes[name],
            "gb_per_s": nbytes[name] / median / 1e9,
            "fraction_of_copy": nbytes[name] / median / 1e9 / copy_gbs,
            "fraction_of_copy_median_vs_median": nbytes[name] / median / 1e9 / copy_median_gbs,
            "fraction_of_copy_best_vs_best": nbytes[name] / best / 1e9 / copy_gbs,
        }
    for kind in ("forward", "forward+backward"):
        ours = results[f"cpu scan, {kind}"]
        loops = [name for name in slow if name.endswith(f", {kind}")]
        ours["speedup"] = {loop: results[loop]["median_ms"] / ours["median_ms"] for loop in loops}

    report = {
        "command": " ".join(["PYTHONPATH=src python benchmarks/scan_cpu.py", *sys.argv[1:]]),
        "machine": {"cpu": cpu_model(), "cores": cores, "torch": torch.__version__, "numba": numba.__version__},
        "env": {k: os.environ[k] for k in ("THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS") if k in os.environ},
        "shape": {"B": args.batch, "T": args.time, "D": args.dim},
        "dtype": args.dtype,
        "copy_mib": args.copy_mib,
        "copy_gb_per_s": copy_gbs,
        "copy_median_gb_per_s": copy_median_gbs,
        "results": results,
    }
    print(f"{report['machine']['cpu']}, {cores} cores; B={args.batch} T={args.time} D={args.dim} {args.dtype}")
    print(
        f"copy_ bandwidth of a {args.copy_mib} MiB tensor (read+write): best of {args.repeats} {copy_gbs:.1f} GB/s, "
        f"median {copy_median_gbs:.1f} GB/s"
    )
    print("GB/s at the median time; of copy: median vs best copy (median vs median copy, best vs best copy)")
    header = (
        f"| {'measurement':<52} | {'median ms':>9} | {'best ms':>9} | {'MB moved':>8} | {'GB/s':>5} "
        f"| {'of copy':>7} | {'(med/med, best/best)':>20} |"
    )
    print(header)
    print("|" + "|".join("-" * len(col) for col in header.split("|")[1:-1]) + "|")
    for name, r in results.items():
        pair = f"{r['fraction_of_copy_median_vs_median']:.0%}, {r['fraction_of_copy_best_vs_best']:.0%}"
        print(
            f"| {name:<52} | {r['median_ms']:9.1f} | {r['best_ms']:9.1f} | {r['bytes'] / 1e6:8.0f} "
            f"| {r['gb_per_s']:5.1f} | {r['fraction_of_copy']:7.0%} | {pair:>20} |"
        )
    for kind in ("forward", "forward+backward"):
        for loop, x in results[f"cpu scan, {kind}"]["speedup"].items():
            print(f"speed-up of cpu scan, {kind} over {loop}: {x:.0f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
