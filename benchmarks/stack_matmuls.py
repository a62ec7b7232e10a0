"""Where a one-row decode step's stack of blocks loses time against its weight reads (Section 5.1, issue 19).

For a preset (random weights, bfloat16 and its int8 quantisation), after a 16-token prompt, this script times side by
side, in rounds (each path once per round, bfloat16 then int8), one decode step's pieces at one row:

- ``stack``: :func:`griffin.inference.cpu.block_step.stack_step` inside a real decode step (every residual block: the
  norms, the RG-LRU or attention, the MLP, the four weight matmuls of each block, in the threads' shared phases);
- ``matmuls alone``: the same blocks' weight matmuls only (:func:`griffin.inference.cpu.matvec.rows_task` over every
  tile, the row prepared per matrix as the step prepares it), each thread its contiguous half of each matrix's tiles,
  with no phase between the matrices: the stack without its other work and without waiting for the slower thread;
- ``dots alone``: the dot-product intrinsics alone over the same rows in the same order
  (:func:`griffin.inference.cpu.isa.dot_bf16`, :func:`~griffin.inference.cpu.isa.dot_uint16_int8`): the weight stream
  with nothing per row or per tile but the dot product.

The gaps read as: ``stack - matmuls alone`` what the step does besides its matmuls (and the threads' waits),
``matmuls alone - dots alone`` what the matvec tasks cost per tile and per row beyond the dot products. Medians over
``--rounds`` rounds; GB/s of the matrices' bytes. Needs AVX-512 BF16 and VNNI (the one-row instructions).

    flock /tmp/griffin-bench.lock python benchmarks/stack_matmuls.py --model griffin-1.3b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

import griffin.inference.cpu.fused as step_module
from griffin import CausalLM, Decoder, ModelConfig, prefill
from griffin.inference.cpu.isa import DOT_INSTRUCTIONS, VECTOR, dot_bf16, dot_uint16_int8
from griffin.inference.cpu.matvec import PREFETCH_BYTES, kernel_settings, prepare_rows, rows_buffers, rows_task
from griffin.inference.generate import decode_model
from griffin.quantize import quantize_int8

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, table, write_json  # noqa: E402

PATHS = ("stack", "matmuls alone", "dots alone")


@numba.njit(inline="always")
def _share(worker, workers, n):  # type: ignore[no-untyped-def]
    return worker * n // workers, (worker + 1) * n // workers


@numba.njit(fastmath=True, parallel=True)
def _matmuls(x, items, settings, out):  # type: ignore[no-untyped-def]
    """The four weight matmuls of every block in ``items`` (the stack's typed list), x's first K entries as the row."""
    workers = numba.get_num_threads()
    for worker in prange(workers):
        for i in range(len(items)):
            item = items[i]
            for m in (item[1], item[2], item[3], item[4]):
                arrays, tiles, scale, bias, sums = m
                row = np.ascontiguousarray(x[:, : arrays[0].shape[1]])
                buffers = rows_buffers(row)
                prepare_rows(row, arrays, settings, buffers)
                lo, hi = _share(worker, workers, tiles.shape[0])
                for t in range(lo, hi):
                    rows_task(np.int64(t), row, buffers, arrays, tiles, scale, bias, sums, settings,
                              out[worker : worker + 1, : scale.shape[0]])


def _row_dot(inputs, w, offset, n, ahead):  # type: ignore[no-untyped-def]
    """The one-row dot product of the input (bfloat16 bits, or int8's (high, low) bytes) with w[offset : offset + n]
    through the weights' intrinsic, prefetching ``ahead`` bytes on. Numba only."""
    raise NotImplementedError


@overload(_row_dot, inline="always")
def _row_dot_impl(inputs, w, offset, n, ahead):  # type: ignore[no-untyped-def]
    if w.dtype == types.int8:
        return lambda inputs, w, offset, n, ahead: np.float64(dot_uint16_int8(inputs[0], inputs[1], w, offset, 0, n,
                                                                              ahead))
    return lambda inputs, w, offset, n, ahead: np.float64(dot_bf16(inputs[0], w, offset, 0, n, ahead // 2))


@numba.njit(fastmath=True, parallel=True)
def _dots(inputs, items, ahead, out):  # type: ignore[no-untyped-def]
    """The dot products alone of every row of the blocks' matrices, in the matmuls' order and shares."""
    workers = numba.get_num_threads()
    for worker in prange(workers):
        acc = 0.0
        for i in range(len(items)):
            item = items[i]
            for m in (item[1], item[2], item[3], item[4]):
                arrays, tiles = m[0], m[1]
                K = arrays[0].shape[1]
                lo, hi = _share(worker, workers, tiles.shape[0])
                for t in range(lo, hi):
                    w = arrays[tiles[t, 0]].reshape(arrays[tiles[t, 0]].size)
                    for r in range(tiles[t, 1], tiles[t, 1] + tiles[t, 3]):
                        acc += _row_dot(inputs, w, r * K, K - K % VECTOR, ahead)
        out[worker, 0] = acc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="griffin-1.3b", help="preset name")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/stack_matmuls.json")
    args = p.parse_args(argv)
    if not {"bfloat16", "int8"} <= DOT_INSTRUCTIONS:
        raise SystemExit(f"stack_matmuls: needs AVX-512 BF16 and VNNI; this host has {sorted(DOT_INSTRUCTIONS)}")
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit(f"--rounds={args.rounds} and --threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    config = ModelConfig.from_preset(args.model)
    torch.manual_seed(args.seed)
    bf16 = CausalLM(config).eval().to(torch.bfloat16)
    models = {"bfloat16": bf16, "int8": quantize_int8(bf16)}
    prompts = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(args.seed))
    runs = {}
    for dtype, model in models.items():
        with torch.no_grad():
            copy = decode_model(model, 1)
            _, cache = prefill(copy, prompts, max_length=prompts.shape[1] + 4 * args.rounds + 8)
            decoder = Decoder(copy, cache)
            decoder(prompts[:, -1])
        stack = copy.blocks._stack[1]  # (prepared by the first step)
        lists = [items for items in (stack.recurrent, stack.attention) if items is not None]
        nbytes = sum(a.nbytes for items in lists for item in items for m in item[1:5]
                     for a in {id(a): a for a in m[0]}.values())
        runs[dtype] = (decoder, lists, nbytes)
    gen = np.random.default_rng(args.seed)
    width = max(config.width, config.rnn_width or 0, config.mlp_width) + 128
    x = torch.randn(1, width).bfloat16().view(torch.uint16).numpy()
    high, low = gen.integers(0, 256, width, dtype=np.uint8), gen.integers(0, 256, width, dtype=np.uint8)
    out = np.zeros((args.threads, max(config.vocab_size, 4 * width)), np.float32)
    settings = kernel_settings()
    token = prompts[:, -1].clone()
    stack_time = [0.0]
    original = step_module.stack_step

    def timed_stack(*a: object, **k: object) -> object:
        start = time.perf_counter()
        result = original(*a, **k)
        stack_time[0] += time.perf_counter() - start
        return result

    def run(dtype: str, path: str) -> float:
        decoder, lists, _ = runs[dtype]
        if path == "stack":
            stack_time[0] = 0.0
            with torch.no_grad():
                decoder(token)
            return stack_time[0]
        start = time.perf_counter()
        for items in lists:
            if path == "matmuls alone":
                _matmuls(x, items, settings, out)
            else:
                _dots((x[0],) if dtype == "bfloat16" else (high, low), items, PREFETCH_BYTES, out)
        return time.perf_counter() - start

    step_module.stack_step = timed_stack
    try:
        for dtype in runs:  # compile and warm up
            for path in PATHS:
                run(dtype, path)
        times: dict[tuple[str, str], list[float]] = {(d, p): [] for d in runs for p in PATHS}
        for _ in range(args.rounds):
            for dtype in runs:
                for path in PATHS:
                    times[dtype, path].append(run(dtype, path))
    finally:
        step_module.stack_step = original
    rows = []
    for (dtype, path), t in times.items():
        ms = 1e3 * statistics.median(t)
        rows.append(dict(model=args.model, dtype=dtype, path=path, ms=ms, gb=runs[dtype][2] / 1e9,
                         gbps=runs[dtype][2] / ms / 1e6, ms_all=[1e3 * s for s in t]))
    print(table(rows, [("model", "model", ""), ("weights", "dtype", ""), ("path", "path", ""), ("ms", "ms", ".1f"),
                       ("matrices GB", "gb", ".2f"), ("GB/s", "gbps", ".1f")]))
    write_json(args.out, dict(machine=machine_info(torch.device("cpu")), args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
