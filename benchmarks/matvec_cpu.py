"""Input rows times a weight matrix on CPU (Section 5.1): the matvec kernel's read rate against the machine's.

A decode step at batch 1 is a sequence of ``x W^T`` for one row x, each bound by reading W (``--batch``: that many
rows, as a decode step of several sequences). For the weight shapes
of a 1.3B Griffin (``griffin-1.3b``: the MLP's 2048 -> 6144 and 6144 -> 2048, the recurrent branch's 2048 -> 2560, the
output layer's 2048 -> 32000) and each weight dtype, this script times, side by side in rounds:

- ``griffin``: :func:`griffin.inference.cpu.matvec.matvec_cpu` as the decoder calls it (bfloat16 activations; on a host
  with AVX-512 BF16 / VNNI the one-row path through ``vdpbf16ps`` / ``vpdpbusd``);
- ``griffin generic``: the same with ``GRIFFIN_MATVEC=generic``'s path (weights widened to float32 one by one);
- ``griffin, no tiles``: int8 at several rows on a host with AMX (:data:`griffin.inference.cpu.isa.FAST_TILES`), the
  ``vpdpbusd`` kernel instead of the tile unit's;
- ``griffin, no prefetch``: at one row, and int8 at several rows on a host with ``vpdpbusd`` but no AMX, the kernel
  without its prefetch of the weights ahead (``PREFETCH_BYTES = 0``);
- ``F.linear``: PyTorch's matmul (oneDNN) on the same weights (float32 or bfloat16);
- ``int8pack``: PyTorch's weight-only int8 matmul (``torch._weight_int8pack_mm``, what gpt-fast and torchao use on
  CPU), bfloat16 activations, per-channel scales;
- ``sum``: a warm ``torch.sum`` over as many bytes of float32 ones, the read rate the kernel can at best reach.

On a host with the instructions it also measures their own rate, one thread on operands in the L1 cache (the block
of :func:`griffin.inference.cpu.isa.dot_rows_uint16_int8`, and :func:`~griffin.inference.cpu.isa.dot_bf16`), and from it
the most weights per second the cores can multiply against ``--batch`` rows when nothing waits for memory: int8 needs
2 x batch ``vpdpbusd`` per 64 weights (one per byte of each row's int16 steps), bfloat16 batch ``vdpbf16ps`` per 32.

Each matrix is held in several copies (together twice the last-level cache), used in turn, so that every call reads its
weights from memory. Reported: the median over ``--rounds`` rounds (each starting at the next path) of GB of weights
read per second, and the ratio to ``sum`` measured in the same round.

    flock /tmp/griffin-bench.lock python benchmarks/matvec_cpu.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # as griffin sets it, but torch is imported first here

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from griffin.inference.cpu import isa  # noqa: E402
from griffin.inference.cpu import matvec as matvec_module  # noqa: E402
from griffin.inference.cpu.matvec import MatvecWeights, matvec_cpu  # noqa: E402
from griffin.ops.matvec import quantize_int8  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import last_level_cache_bytes, machine_info, module_setting, progress, table, write_json  # noqa: E402

SHAPES = {"mlp up 2048->6144": (6144, 2048), "mlp down 6144->2048": (2048, 6144),
          "recurrent 2048->2560": (2560, 2048), "output 2048->32000": (32000, 2048)}


@numba.njit(cache=True)
def _int8_block_loop(high, low, w, reps):  # type: ignore[no-untyped-def]
    total = 0
    for r in range(reps):
        start = (r % 4) * 64  # moves, so that no call repeats the one before
        block = isa.dot_rows_uint16_int8(high, low, 0, w, 0, w.shape[0] - 1, start, high.shape[1] - 256)
        for q in range(len(block)):
            total += block[q]
    return total


@numba.njit(cache=True)
def _bf16_loop(x, w, reps):  # type: ignore[no-untyped-def]
    total = 0.0
    for r in range(reps):
        total += isa.dot_bf16(x, w, 0, (r % 4) * 128, x.shape[0] - 512, 0)
    return total


def instruction_rates(seconds: float = 1.0, dots: frozenset[str] | None = None) -> dict[str, float]:
    """G instructions/s of one thread on L1-resident operands: ``vpdpbusd`` in the several-row block, ``vdpbf16ps``
    in the one-row dot, for the weight dtypes in ``dots`` (default: those the host has, ``FAST_DOTS``)."""
    dots = matvec_module.FAST_DOTS if dots is None else dots
    rates, k = {}, 2048 + 512
    if "int8" in dots:
        rows, weight_rows = isa.ROWS, isa.WEIGHT_ROWS
        high, low = (np.random.randint(0, 256, (rows, k)).astype(np.uint8) for _ in range(2))
        w = np.random.randint(-128, 128, (weight_rows, k)).astype(np.int8)
        per_call = (k - 256) // 64 * 2 * rows * weight_rows
        rates["vpdpbusd"] = _rate(lambda n: _int8_block_loop(high, low, w, n), per_call, seconds)
    if "bfloat16" in dots:
        x, w16 = (np.random.randint(0, 1 << 14, k).astype(np.uint16) for _ in range(2))
        rates["vdpbf16ps"] = _rate(lambda n: _bf16_loop(x, w16, n), (k - 512) // 32, seconds)
    return rates


def _rate(loop: Callable[[int], object], per_call: int, seconds: float) -> float:
    loop(10)  # compile
    reps = 1000
    while timed(lambda: loop(reps)) < seconds / 4:  # noqa: B023 (called at once)
        reps *= 4
    return statistics.median(reps * per_call / timed(lambda: loop(reps)) for _ in range(3)) / 1e9  # noqa: B023


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def candidates(rows: int, cols: int, dtype: str, copies: int, gen: torch.Generator,
               batch: int = 1) -> dict[str, Callable]:
    """name -> a function reading the next copy of a (rows, cols) matrix of ``dtype`` once per call, against
    ``batch`` input rows."""
    base = torch.randn(rows, cols, generator=gen) / cols**0.5
    x = torch.randn(batch, cols, generator=gen).bfloat16()
    if dtype == "int8":
        q, scale = quantize_int8(base)
        weights = [q.clone() for _ in range(copies)]
        prepared = [MatvecWeights.prepare([w], [scale]) for w in weights]
        scale_bf16 = scale[:, 0].bfloat16()
        linear = {"int8pack": lambda w: torch._weight_int8pack_mm(x, w, scale_bf16)}
    else:
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        weights = [base.to(tdtype, copy=True) for _ in range(copies)]  # (float32: not base itself, every time)
        prepared = [MatvecWeights.prepare([w]) for w in weights]
        xl = x.to(tdtype)
        linear = {"F.linear": lambda w: F.linear(xl, w)}
    xg = x if dtype != "float32" else x.float()
    ones = [torch.ones(w.numel() * w.element_size() // 4) for w in weights]  # the same bytes, as float32 ones
    turn = {"i": 0}

    def cycling(fn: Callable) -> Callable[[], object]:
        def call() -> object:
            turn["i"] = (turn["i"] + 1) % copies
            return fn(turn["i"])

        return call

    def with_setting(name: str, value: object) -> Callable[[int], object]:
        """The kernel with ``griffin.inference.cpu.matvec``'s ``name`` set to ``value`` for the call."""
        def call(i: int) -> object:
            with module_setting(matvec_module, name, value):
                return matvec_cpu(xg, prepared[i])

        return call

    generic = with_setting("FAST_DOTS", frozenset())
    unprefetched = with_setting("PREFETCH_BYTES", 0)
    untiled = with_setting("FAST_TILES", frozenset())

    tiled = "int8" in matvec_module.FAST_TILES  # (the tile kernel prefetches nothing)
    out = {"griffin": cycling(lambda i: matvec_cpu(xg, prepared[i])), "griffin generic": cycling(generic)}
    if dtype == "int8" and batch > 1 and tiled:
        out["griffin, no tiles"] = cycling(untiled)
    if batch == 1 or (dtype == "int8" and "int8" in matvec_module.FAST_DOTS and not tiled):
        out["griffin, no prefetch"] = cycling(unprefetched)
    out.update({name: cycling(lambda i, fn=fn: fn(weights[i])) for name, fn in linear.items()})
    out["sum"] = cycling(lambda i: ones[i].sum())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8", "float32"],
                   choices=["bfloat16", "int8", "float32"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch", type=int, default=1, help="input rows per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/matvec_cpu.json")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    start, rows = time.perf_counter(), []
    if args.batch < 1:
        raise SystemExit(f"--batch={args.batch} must be a positive number of rows")
    print(f"{machine_info(torch.device('cpu'))}; {args.batch} input row(s); multiply-accumulate instructions for: "
          f"{sorted(matvec_module.FAST_DOTS) or 'none'}")
    instructions = instruction_rates()
    threads = torch.get_num_threads()
    ceilings = {}  # G weights/s against --batch rows, all threads, operands in the L1 cache
    if "vpdpbusd" in instructions:
        ceilings["int8"] = threads * instructions["vpdpbusd"] * 64 / (2 * args.batch)
    if "vdpbf16ps" in instructions:
        ceilings["bfloat16"] = threads * instructions["vdpbf16ps"] * 32 / args.batch
    for name, rate in instructions.items():
        print(f"{name}: {rate:.2f} G instructions/s on one thread (operands in L1)")
    for dtype, ceiling in ceilings.items():
        print(f"{dtype} at {args.batch} row(s), {threads} threads: at most {ceiling:.1f} G weights/s "
              f"({ceiling * (2 if dtype == 'bfloat16' else 1):.1f} GB/s) from the instruction rate")
    cache = last_level_cache_bytes()
    bar = progress(len(SHAPES) * len(args.dtypes), "matrices")
    for dtype in args.dtypes:
        for shape_name, (n, k) in SHAPES.items():
            nbytes = n * k * {"bfloat16": 2, "int8": 1, "float32": 4}[dtype]
            fns = candidates(n, k, dtype, max(2, -(-2 * cache // nbytes)), gen, args.batch)
            for fn in fns.values():  # compile, page in
                fn()
                fn()
            rates: dict[str, list[float]] = {name: [] for name in fns}
            names = list(fns)
            for r in range(args.rounds):  # each round starts at the next path, so that none always follows another
                for name in names[r % len(names):] + names[: r % len(names)]:
                    rates[name].append(nbytes / timed(fns[name]) / 1e9)
            for name in fns:
                if name == "sum":
                    continue
                ratio = [r / s for r, s in zip(rates[name], rates["sum"], strict=True)]
                rows.append(dict(dtype=dtype, matrix=shape_name, path=name, mb=nbytes / 1e6,
                                 gbps=statistics.median(rates[name]), sum_gbps=statistics.median(rates["sum"]),
                                 of_sum=statistics.median(ratio), us=nbytes / statistics.median(rates[name]) / 1e3))
            bar.update()
    bar.close()
    print(table(rows, [("weights", "dtype", ""), ("matrix", "matrix", ""), ("path", "path", ""), ("MB", "mb", ".1f"),
                       ("us/call", "us", ".0f"), ("GB/s", "gbps", ".1f"), ("sum GB/s", "sum_gbps", ".1f"),
                       ("of sum", "of_sum", ".0%")]))
    write_json(args.out, dict(command="python " + " ".join(sys.argv), machine=machine_info(torch.device("cpu")),
                              fast_dots=sorted(matvec_module.FAST_DOTS), rounds=args.rounds, batch=args.batch,
                              instruction_rates_g_per_s=instructions, ceilings_g_weights_per_s=ceilings,
                              wall_s=time.perf_counter() - start, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
