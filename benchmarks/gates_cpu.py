"""The RG-LRU's two block-diagonal gates (Section 2.4) in a compiled bf16 CPU step: per gate against dense.

    blocks    each gate's BlockDiagonalLinear: a batched matmul over its blocks, the bias fused (the reference)
    dense     griffin.layers.rg_lru.dense_gates: one matmul of x with both gates' block-diagonal weights side by
              side (the zero blocks multiplied too)

Each path is compiled (torch.compile, under bf16 autocast as a ``--precision bf16`` step) with the gates' use in the
RG-LRU after them (sigmoid(W_a x) * (W_x x)), and timed forward+backward on B x T tokens of each width, in rounds
that time both paths in turn (median of ``--rounds``). ``blocks / dense`` above 1: the dense matmul is faster; the
compiled step takes it up to :data:`griffin.layers.rg_lru.DENSE_GATES_MAX_WIDTH`.

    python benchmarks/gates_cpu.py                          # the synthetic presets' width 64 and wider
    python benchmarks/gates_cpu.py --widths 64x8 192x2 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from griffin.layers.rg_lru import DENSE_GATES_MAX_WIDTH, BlockDiagonalLinear, dense_gates

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_json  # noqa: E402


def gates_step(width: int, blocks: int, dense: bool):
    """A compiled forward+backward of the two gates of one RG-LRU on a fixed input."""
    torch.manual_seed(0)
    input_gate, a_gate = BlockDiagonalLinear(width, width, blocks), BlockDiagonalLinear(width, width, blocks)

    def gates(x):
        gate_x, gate_a = dense_gates(x, input_gate, a_gate) if dense else (input_gate(x), a_gate(x))
        return torch.sigmoid(gate_a) * gate_x

    return torch.compile(gates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", nargs="+", default=["64x8", "64x2", "128x4", "128x2", "192x2", "256x8"],
                   help="WIDTHxBLOCKS (the synthetic presets: 64x8; the main job's model: 192x2)")
    p.add_argument("--tokens", type=int, default=4096, help="B x T tokens per step (16 x 256)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--out", default="benchmarks/results/gates_cpu.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.tokens < 16:
        p.error("--rounds and --steps must be at least 1, --tokens at least 16")
    torch.set_num_threads(args.threads)
    info = machine_info(torch.device("cpu"))
    print(f"{info['cpu']}, {torch.get_num_threads()} threads; load average {info['load_average'][0]:.2f}; "
          f"dense up to width {DENSE_GATES_MAX_WIDTH} in a compiled step")
    print("| width | blocks | blocks ms | dense ms | blocks / dense |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for spec in args.widths:
        width, blocks = (int(n) for n in spec.split("x"))
        torch._dynamo.reset()  # each width compiles new graphs: never past dynamo's recompile limit
        x = torch.randn(16, args.tokens // 16, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
        paths = {name: gates_step(width, blocks, name == "dense") for name in ("blocks", "dense")}
        times: dict[str, list[float]] = {name: [] for name in paths}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for fn in paths.values():  # compile and warm up
                for _ in range(3):
                    fn(x).float().sum().backward()
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        fn(x).float().sum().backward()
                    times[name].append((time.perf_counter() - start) / args.steps)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = dict(width=width, blocks=blocks, blocks_s=med["blocks"], dense_s=med["dense"],
                   ratio=med["blocks"] / med["dense"])
        rows.append(row)
        print(f"| {width} | {blocks} | {1e3 * row['blocks_s']:.2f} | {1e3 * row['dense_s']:.2f} | "
              f"{row['ratio']:.2f} |", flush=True)
    write_json(args.out, dict(machine=info, args=vars(args), dense_max_width=DENSE_GATES_MAX_WIDTH, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
