"""The recurrent block's Conv1D on CPU (Section 2.3): the fused numba kernels against the PyTorch reference.

    fused     griffin.ops.conv1d backend "cpu": one pass over x forward, one over the output gradient backward
    ref       backend "ref": conv1d_ref, shifted slices of x differentiated by autograd

Timed forward (no autograd) and forward+backward (backward of a fixed output gradient, into x, w and b), median of
--repeats interleaved rounds. GB/s = bytes an ideal kernel must move (forward: read x, write y; backward
additionally read x and the output gradient, write dx) / time: against the copy bandwidth of the machine, what is
left to gain.

    python benchmarks/conv1d_cpu.py                                   # fp32 and bf16, training and prefill shapes
    python benchmarks/conv1d_cpu.py --shapes 16x256x64 --dtypes bfloat16 --resets 0.01
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from griffin.ops.conv1d import causal_conv1d

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_forward_backward, machine_info, write_json  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = {"fused": "cpu", "ref": "ref"}


def run(path: str, x, w, b, reset, grad, backward: bool) -> None:
    with torch.set_grad_enabled(backward):
        y = causal_conv1d(x, w, b, reset, backend=PATHS[path])
        if backward:
            y.backward(grad)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16x256x64", "16x1024x64", "16x256x192", "4x1024x1024"],
                   help="BxTxD shapes (defaults: the synthetic models at T = 256 and 1024, the main job's model, a "
                        "wide prefill)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--resets", type=float, default=0.0, help="probability of a document start per token")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/conv1d_cpu.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be at least 1")
    info = machine_info(torch.device("cpu"))
    print(f"{info['cpu']}, {info['threads']} threads; load average {info['load_average'][0]:.2f}")
    print("| B×T×D | dtype | path | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s | fwd vs fused | fwd+bwd vs fused |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for shape in args.shapes:
        B, T, D = (int(n) for n in shape.split("x"))
        for dtype_name in args.dtypes:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(B, T, D, generator=g).to(DTYPES[dtype_name]).requires_grad_()
            w, b = torch.randn(4, D, generator=g).requires_grad_(), torch.randn(D, generator=g).requires_grad_()
            grad = torch.randn(B, T, D, generator=g).to(x.dtype)
            reset = torch.rand(B, T, generator=g) < args.resets if args.resets else None
            size = B * T * D * x.element_size()
            inputs = (x, w, b, reset, grad)
            med = interleaved_forward_backward(list(PATHS), lambda name, bwd, a=inputs: run(name, *a, bwd),
                                               args.repeats)
            for name, (fwd, fb) in med.items():
                row = dict(shape=shape, dtype=dtype_name, path=name, forward_s=fwd, forward_backward_s=fb,
                           forward_gbs=2 * size / fwd / 1e9, forward_backward_gbs=5 * size / fb / 1e9)
                rows.append(row)
                print(f"| {shape} | {dtype_name} | {name} | {1e3 * fwd:.2f} | {row['forward_gbs']:.1f} | "
                      f"{1e3 * fb:.2f} | {row['forward_backward_gbs']:.1f} | {fwd / med['fused'][0]:.2f} | "
                      f"{fb / med['fused'][1]:.2f} |", flush=True)
    write_json(args.out, dict(machine=info, args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
