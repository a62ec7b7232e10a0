"""Decode speed of 1-3B models on CPU (Section 5.1): how close a decode step comes to the memory-bandwidth floor.

At batch 1-8 a decode step reads every weight once, so the best time per step is the weights' bytes over the
machine's read bandwidth. For each model shape (random weights; ``griffin.config.PRESETS``), weight dtype and batch,
this script times greedy decode steps through ``griffin.generate_stream`` (the :class:`griffin.Decoder`: the matvec
kernel that reads each weight once, the layers sharing an input fused; int8 from :func:`griffin.quantize.quantize_int8`)
and reports:

- ms per step (each row of the batch gets one token per step) and tokens/s (batch / step time);
- weight bytes read per second (the model's parameters and buffers, once per step), as a fraction of the machine's
  read bandwidth, measured in the same run: a warm ``sum`` over a 1 GiB float32 tensor, best of 7, just before each
  model and weight dtype and at the end, and over 128 MiB once after each round of timed steps
  (:func:`interleaved_steps`); fractions of the best of all the best-of-7s, of the one just before, and of the median
  of those between the steps (the machine is shared and its read rate moves by 2x within minutes: only the last saw
  the steps' phases);
- for the ``recurrentgemma-2b`` shape, HF transformers' ``RecurrentGemmaForCausalLM`` on the same weights in
  bfloat16 (written by :func:`griffin.interop.export_hf`, loaded by transformers), timed through its ``generate``
  between consecutive calls of its forward pass.

One model is held at a time (float32, then bfloat16, then its int8 quantisation; the HF model beside the bfloat16
one), so that a 2.7B model fits 24 GiB. A step is timed from one token to the next: after ``--warmup`` steps, the
median of ``--steps`` steps. ``--profile`` adds torch.profiler's operators by self time per step (bfloat16 and int8,
batch 1, the first model), the numba kernels (not aten operators) recorded under their own names. ``--unfused``
also times each griffin run without the fused kernels of the step (:mod:`griffin.inference.cpu.fused`), its steps taken
in turn with the fused run's (:func:`interleaved_steps`), so that the ratio of the two sees the same host;
``--kernel-by-kernel-too`` likewise each run whose step is one call per block (every run of one row, int8 runs of a
few rows) with the fused step's kernels called one by one instead, and ``--prefetch-too`` each run of one row, and
each int8 run of several (without AMX), with the kernels prefetching other distances of weights ahead than
:data:`griffin.inference.cpu.matvec.PREFETCH_BYTES` (0, or ``--no-prefetch-too``: without the prefetch), and
``--no-tiles-too`` each int8 run of several rows through ``vpdpbusd`` instead of the tile unit (on a host with AMX,
:data:`griffin.inference.cpu.isa.FAST_TILES`).
``--split`` times the weight matmuls inside a step, the same calls alone, and the step without them.
``--int8-beside-bf16`` also times an int8 copy of each bfloat16 model beside it, their steps in turn: the int8 /
bfloat16 ratio of one run sees one phase of the host (the int8 stage's ratio compares runs minutes apart).
``--turn-steps K`` makes each turn K steps of one run, of which the first is left out: a step that follows another
model's steps may find less of its own weights in the last-level cache than one that follows its own.
``--huge-pages-too`` also times a copy of each model whose tensors of 2 MiB or more lie in memory advised for
transparent huge pages (:func:`huge_page_copy`), its steps in turn with the model's: the weights' reads then cross a
page boundary every 2 MiB instead of every 4 KiB.

    flock /tmp/griffin-bench.lock python benchmarks/decode_cpu.py --profile
    python benchmarks/decode_cpu.py --models griffin-1.3b --dtypes bfloat16 int8 --batches 1 --no-hf
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import itertools
import mmap
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # as griffin sets it, but torch is imported first here

import numba  # noqa: E402
import torch  # noqa: E402

from griffin import CausalLM, Decoder, ModelConfig, generate_stream, prefill
from griffin.inference.cpu import matvec as matvec_cpu
from griffin.inference.cpu.fused import FusedResidualBlock
from griffin.inference.cpu.linear import Int8PackLinear, MatvecBlockDiagonal, MatvecLinear, int8pack_for
from griffin.inference.cpu.prepack import PackedLinear, can_prepack
from griffin.inference.generate import decode_model
from griffin.quantize import quantization_of, quantize_int8

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, module_setting, progress, table, write_json  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
HF_SHAPES = ("recurrentgemma-2b",)  # shapes in HF RecurrentGemma's conventions (embedding scale, soft-cap, ...)


def read_seconds(x: torch.Tensor) -> float:
    """Seconds of one warm ``sum`` over ``x`` (a float32 tensor far beyond the caches)."""
    start = time.perf_counter()
    x.sum()
    return time.perf_counter() - start


def read_tensor(gib: float = 1.0) -> torch.Tensor:
    """A ``gib`` GiB float32 tensor (far beyond the caches), summed once (page faults, thread pool)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    return x


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes/s of a warm ``sum`` over a ``gib`` GiB float32 tensor, best of ``repeats``."""
    x = read_tensor(gib)
    return x.numel() * 4 / min(read_seconds(x) for _ in range(repeats))


def step_times(loop: Callable[[Callable[[], None]], None], warmup: int) -> list[float]:
    """Seconds between consecutive tokens of ``loop`` (which calls its argument once per token), the first
    ``warmup`` intervals (after the prefill: the decoder's set-up, first calls) left out."""
    stamps: list[float] = []
    loop(lambda: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)][warmup:]


def timed_steps(loop: Callable[[Callable[[], None]], None], warmup: int, steps: int) -> list[float]:
    """The first ``steps`` of :func:`step_times` (a loop of ``warmup + steps + 2`` tokens gives at least that)."""
    times = step_times(loop, warmup)[:steps]
    if len(times) < steps:
        raise RuntimeError(f"{len(times)} steps timed, {steps} asked for")
    return times


def interleaved_steps(models: list[CausalLM], prompts: torch.Tensor, warmup: int, steps: int,
                      compile: bool, read: torch.Tensor | None = None,
                      settings: list[Callable[[], AbstractContextManager]] | None = None, turn: int = 1
                      ) -> tuple[list[list[float]], list[float]]:
    """Seconds per decode step of each model, their steps taken in turn (``turn`` steps of the first, then of the
    second, ...) so that the host's slow and fast phases fall on all of them alike; the first ``warmup`` rounds left
    out. With ``turn`` > 1 the first step of each turn is left out too (it follows the other models' steps, which have
    taken the caches' contents) and the others are timed, until ``steps`` are. With ``settings``, each model's steps
    run inside its context (the same model under two settings). With ``read`` (a float32 tensor), each timed round is
    followed by a timed ``sum`` over it: the read rate in the same phases as the steps (bytes/s, one per round)."""
    if turn < 1:
        raise ValueError(f"turn={turn} must be >= 1")
    kept = turn - 1 if turn > 1 else 1  # timed steps per turn
    rounds = warmup + -(-steps // kept)
    streams = [iter(generate_stream(m, prompts, rounds * turn + 1, temperature=0.0, compile=compile)) for m in models]
    settings = settings or [nullcontext] * len(models)
    times: list[list[float]] = [[] for _ in models]
    rates: list[float] = []
    for stream, setting in zip(streams, settings, strict=True):
        with setting():
            next(stream)  # the prompt and the first token
    for i in range(rounds):
        for stream, setting, out in zip(streams, settings, times, strict=True):
            with setting():
                for j in range(turn):
                    start = time.perf_counter()
                    next(stream)
                    if i >= warmup and (turn == 1 or j > 0):
                        out.append(time.perf_counter() - start)
        if read is not None and i >= warmup:
            rates.append(read.numel() * read.element_size() / read_seconds(read))
    return [t[:steps] for t in times], rates


BESIDE = "griffin int8, steps in turn with bf16"  # the path of --int8-beside-bf16's rows
HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def huge_page_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in anonymous memory of its own, 2 MiB-aligned and advised for transparent huge pages
    (``madvise(MADV_HUGEPAGE)``, Linux), so that the kernel backs it with 2 MiB pages where it can (this host's THP
    setting is ``madvise``: PyTorch's allocations get 4 KiB pages unless ``THP_MEM_ALLOC_ENABLE=1``)."""
    nbytes = t.numel() * t.element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: no THP)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are faulted in as huge pages
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    out = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def huge_page_copy(model: CausalLM) -> CausalLM:
    """A copy of ``model`` whose parameters and buffers of 2 MiB or more lie in huge pages (huge_page_tensor)."""
    hp = copy.deepcopy(model)
    with torch.no_grad():
        for module in hp.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is not None and t.numel() * t.element_size() >= HUGE_PAGE:
                        if isinstance(t, torch.nn.Parameter):
                            t.data = huge_page_tensor(t.data)
                        else:
                            store[name] = huge_page_tensor(t)
    return hp


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what a decode step reads, caches aside)."""
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def one_call_per_block(dtype: str, batch: int) -> bool:
    """Whether the decode copy's stack of blocks is one call per step (their projections are the matvec kernel's: any
    model at one row, int8 at a few rows where the host has ``vpdpbusd``, bfloat16 where oneDNN has no bfloat16 path
    on this CPU; :func:`griffin.inference.generate.decode_model`)."""
    return (batch == 1 or (dtype == "int8" and not int8pack_for(batch))
            or (dtype == "bfloat16" and not can_prepack(torch.zeros(1, 1, dtype=torch.bfloat16))))


def kernel_by_kernel(model: CausalLM, batch: int) -> torch.nn.Module:
    """The decode copy for ``batch`` rows whose blocks call the fused step's kernels one by one, not the stack's one
    call (:class:`griffin.inference.cpu.fused.FusedResidualBlock`'s ``one_call`` left out; where
    :func:`one_call_per_block`)."""
    copy = decode_model(model, batch)
    for block in copy.blocks:
        if isinstance(block, FusedResidualBlock):
            block.one_call = None
    return copy


def prefetch_label(ahead_bytes: int) -> str:
    return "griffin, no prefetch" if ahead_bytes == 0 else f"griffin, prefetch {ahead_bytes / 1024:g} KiB"


def griffin_loop(model: CausalLM, prompts: torch.Tensor, n: int, compile: bool) -> Callable:
    def loop(on_token: Callable[[], None]) -> None:
        for _ in generate_stream(model, prompts, n, temperature=0.0, compile=compile):
            on_token()
    return loop


def hf_loop(hf: Any, prompts: torch.Tensor, n: int) -> Callable:
    def loop(on_token: Callable[[], None]) -> None:
        handle = hf.register_forward_pre_hook(lambda *_: on_token())
        try:
            with torch.no_grad():
                hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n)
        finally:
            handle.remove()
        on_token()  # the last interval ends when generate returns (its last forward's tokens sampled)
    return loop


# The weight matmuls of a decode step: the method of each module type that the step calls.
MATMULS = {MatvecLinear: "side_by_side", MatvecBlockDiagonal: "forward", PackedLinear: "forward",
           Int8PackLinear: "forward"}  # (MatvecLinear.forward calls side_by_side, as the fused step does)


def profile_steps(loop: Callable, top: int) -> list[dict]:
    """torch.profiler's operators by self CPU time per step over one run of ``loop`` (the prefill and the first
    step left out); the numba kernels' calls appear under their own names (``matvec (numba)``, ``block-diagonal gates
    (numba)``, the fused step's ``RMSNorm``, ``GeLU product``, ``recurrent block`` and ``attention``, and where the
    projections are the matvec kernel's the one call of the whole stack of blocks, their matmuls included), and the
    step's wall time not spent in any operator (Python, dispatch, waiting threads) as ``outside operators``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import griffin.inference.cpu.fused as fused_step

    labelled = [(MatvecLinear, "side_by_side", "matvec (numba)"),
                (MatvecBlockDiagonal, "forward", "block-diagonal gates (numba)"),
                (fused_step, "rms_norm_step", "RMSNorm (numba)"),
                (fused_step, "gelu_product_step", "GeLU product (numba)"),
                (fused_step, "recurrent_step", "recurrent block (numba)"),
                (fused_step, "attention_step", "attention (numba)"),
                (fused_step, "stack_step", "residual blocks, one call per step (numba)")]
    originals = [getattr(owner, name) for owner, name, _ in labelled]

    def recorded(fn: Callable, label: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return call

    prof, stamps = profile(activities=[ProfilerActivity.CPU]), []

    def on_token() -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == 2:
            prof.start()

    for (owner, name, label), fn in zip(labelled, originals, strict=True):
        setattr(owner, name, recorded(fn, label))
    try:
        loop(on_token)
    finally:
        for (owner, name, _), fn in zip(labelled, originals, strict=True):
            setattr(owner, name, fn)
    prof.stop()
    steps = len(stamps) - 2
    events = prof.key_averages()
    wall_ms = (stamps[-1] - stamps[1]) / steps * 1e3
    outside = wall_ms - sum(e.self_cpu_time_total for e in events) / steps / 1e3
    rows = [dict(op=e.key, calls=e.count / steps, self_ms=e.self_cpu_time_total / steps / 1e3) for e in events]
    rows.append(dict(op="outside operators", calls=1.0, self_ms=outside))
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def split_step(model: CausalLM, prompts: torch.Tensor, warmup: int, steps: int) -> dict:
    """Where a decode step's time goes, in ms (medians over ``steps`` steps after ``warmup``): the whole step; its
    weight matmuls (the matvec kernel's calls, the gates' where they are a call of their own, oneDNN's and PyTorch's
    int8 matmuls) timed inside it; the same calls replayed back to back on the inputs they had; the step with every
    such call answered at once by the output it gave before (the step without the weights; in the fused step the
    gates run inside the recurrent block's kernel, so they count there). Of the copy that calls the kernels one by one
    (:func:`kernel_by_kernel`) where the step is otherwise one call per block, in which the matmuls are not calls of
    their own."""
    methods = MATMULS
    originals = {cls: getattr(cls, name) for cls, name in methods.items()}
    tokens = prompts[:, -1].clone()

    def patch(fn: Callable) -> None:
        for cls, name in methods.items():
            setattr(cls, name, fn)

    def steps_ms(decoder: Decoder, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            decoder(tokens)
            times.append(1e3 * (time.perf_counter() - start))
        return times

    inside, calls, answers = [0.0], [], {}

    def timed(self: torch.nn.Module, x: torch.Tensor, *args: Any) -> Any:
        start = time.perf_counter()
        out = originals[type(self)](self, x, *args)
        inside[0] += 1e3 * (time.perf_counter() - start)
        return out

    def recorded(self: torch.nn.Module, x: torch.Tensor, *args: Any) -> Any:
        calls.append((self, x.clone(), args))
        answers[id(self)] = out = originals[type(self)](self, x, *args)
        return out

    def answered(self: torch.nn.Module, x: torch.Tensor, *args: Any) -> Any:
        return answers[id(self)]

    try:
        patch(timed)
        _, cache = prefill(model, prompts, max_length=prompts.shape[1] + warmup + 2 * steps + 2)
        dtype = "int8" if quantization_of(model) is not None else str(model.dtype).removeprefix("torch.")
        decoder = Decoder(kernel_by_kernel(model, prompts.shape[0]) if one_call_per_block(dtype, prompts.shape[0])
                          else model, cache)
        steps_ms(decoder, warmup)
        inside[0] = 0.0
        step = steps_ms(decoder, steps)
        kernels_inside = inside[0] / steps
        patch(recorded)
        decoder(tokens)
        patch(answered)
        without = statistics.median(steps_ms(decoder, steps))
    finally:
        for cls, name in methods.items():
            setattr(cls, name, originals[cls])
    replays = []
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            for module, x, args in calls:
                getattr(module, methods[type(module)])(x, *args)
            replays.append(1e3 * (time.perf_counter() - start))
    return dict(step_ms=statistics.median(step), kernels_inside_ms=kernels_inside,
                kernels_replayed_ms=statistics.median(replays), step_without_kernels_ms=without, calls=len(calls))


def hf_from(model: CausalLM, directory: Path) -> Any:
    """HF transformers' RecurrentGemma with ``model``'s weights (export_hf, then transformers' own loader)."""
    import transformers

    from griffin.interop import export_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Conv1D document-reset note: one document per row here
        export_hf(model, directory)
    hf = transformers.RecurrentGemmaForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like griffin without stop tokens
    hf.generation_config.pad_token_id = 0
    return hf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["griffin-1.3b", "recurrentgemma-2b"], help="preset names")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                   help="weight dtypes (int8: weight-only, activations in bfloat16)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--group-size", type=int, default=0, help="int8: inputs per scale (0: one per output channel)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per row (random)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps left out before timing")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed (median kept)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch's threads and the numba kernels' (those at most numba's pool, NUMBA_NUM_THREADS)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (Decoder(compile=True))")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers' RecurrentGemma")
    p.add_argument("--profile", action="store_true",
                   help="also profile bfloat16 and int8 steps at batch 1 on the first model (torch.profiler)")
    p.add_argument("--split", action="store_true",
                   help="also split bfloat16 and int8 steps at each batch on the first model: the weight matmuls "
                        "inside the step, the same calls replayed alone, the step without them")
    p.add_argument("--unfused", action="store_true",
                   help="also time each griffin run without the fused kernels (decode_model(fuse=False)), a step of "
                        "each in turn")
    p.add_argument("--kernel-by-kernel-too", action="store_true",
                   help="also time each run whose step is one call per block (any at one row, int8 at several) with "
                        "the fused step's kernels called one by one, a step of each in turn")
    p.add_argument("--prefetch-too", nargs="+", type=int, default=[], metavar="BYTES",
                   help="also time each run of one row, and each int8 run of several (without AMX), with the kernels "
                        "prefetching these many bytes of weights ahead (0: no prefetch), a step of each in turn")
    p.add_argument("--no-prefetch-too", dest="prefetch_too", action="store_const", const=[0],
                   help="--prefetch-too 0")
    p.add_argument("--int8-beside-bf16", action="store_true",
                   help="also time an int8 copy of each bfloat16 model (quantised, not in place) with its steps taken "
                        "in turn with the bfloat16 model's, so that their ratio sees the same phases of the host")
    p.add_argument("--huge-pages-too", action="store_true",
                   help="also time a copy of each model whose tensors of 2 MiB or more lie in memory advised for "
                        "transparent huge pages (Linux), a step of each in turn")
    p.add_argument("--turn-steps", type=int, default=1,
                   help="runs timed in turn (--int8-beside-bf16, --unfused, ...) take this many steps each turn, the "
                        "first of each turn left out when more than 1 (it follows the other runs' steps)")
    p.add_argument("--no-tiles-too", action="store_true",
                   help="also time each int8 run of several rows through vpdpbusd instead of the tile unit (AMX; on "
                        "a host that has it), a step of each in turn")
    p.add_argument("--read-gib", type=float, default=1.0,
                   help="GiB of float32 summed for the read rate before each model and dtype (between the steps: an "
                        "eighth of it, so that a 2B float32 model's prepacked copy at batch 8 still fits 24 GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/decode_cpu.json")
    args = p.parse_args(argv)
    for b in args.batches:
        if b < 1:
            raise SystemExit(f"--batches: {b} is not a positive batch size")
    if args.read_gib <= 0:
        raise SystemExit(f"--read-gib={args.read_gib} must be positive")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.threads < 1:
        raise SystemExit(f"--threads={args.threads} must be >= 1")
    if args.turn_steps < 1:
        raise SystemExit(f"--turn-steps={args.turn_steps} must be >= 1")
    if args.huge_pages_too and not hasattr(mmap, "MADV_HUGEPAGE"):
        raise SystemExit("--huge-pages-too: this platform has no madvise(MADV_HUGEPAGE) (Linux only)")
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    configs = {name: ModelConfig.from_preset(name) for name in args.models}  # unknown names fail here, named
    started = time.perf_counter()
    info = machine_info(torch.device("cpu"))
    openmp = ", ".join(f"{k}={v}" for k, v in info["openmp"].items() if v is not None)
    print(f"{info['cpu']}, {info['cores']} cores, {args.threads} threads, torch {info['torch']}; load average "
          f"{info['load_average'][0]:.2f}; {openmp or 'OpenMP defaults'}")
    n = args.warmup + args.steps + 2
    hf_wanted = not args.no_hf and "bfloat16" in args.dtypes
    tiled_host = "int8" in matvec_cpu.FAST_TILES  # (its several-row int8 kernel prefetches nothing)
    tiled = args.no_tiles_too and tiled_host
    runs_per_model = {name: len(args.batches) * (len(args.dtypes) * (1 + args.unfused)
                                                  + (hf_wanted and name in HF_SHAPES))
                      + len(args.prefetch_too) * sum(b == 1 or (d == "int8" and not tiled_host)
                                                     for b in args.batches for d in args.dtypes)
                      + tiled * sum(b > 1 for b in args.batches) * ("int8" in args.dtypes)
                      + args.int8_beside_bf16 * len(args.batches) * ("bfloat16" in args.dtypes)
                      + args.huge_pages_too * len(args.batches) * len(args.dtypes)
                      + args.kernel_by_kernel_too * sum(one_call_per_block(d, b)
                                                        for b in args.batches for d in args.dtypes)
                      for name in args.models}
    bar = progress(sum(runs_per_model.values()), "decode runs")
    rows: list[dict] = []
    bandwidths: list[dict] = []
    profiles: list[dict] = []
    splits: list[dict] = []

    def record(times: list[float], model_name: str, path: str, dtype: str, batch: int, wbytes: int,
               rates: list[float] | None = None) -> None:
        step = statistics.median(times)
        between = statistics.median(rates) / 1e9 if rates else float("nan")
        rows.append(dict(model=model_name, path=path, dtype=dtype, batch=batch, step_ms=1e3 * step,
                         read_gbps_adjacent=bandwidths[-1]["bytes_per_s"] / 1e9, read_gbps_between=between,
                         reads_gbps_between=[r / 1e9 for r in rates or []],
                         tokens_per_s=batch / step, weight_gb=wbytes / 1e9, weight_gbps=wbytes / step / 1e9,
                         steps_ms=[1e3 * t for t in times]))
        bar.update()

    for name, config in configs.items():
        torch.manual_seed(args.seed)
        model: CausalLM | None = CausalLM(config).eval()
        gen = torch.Generator().manual_seed(args.seed)
        prompts_of = {b: torch.randint(0, config.vocab_size, (b, args.prompt), generator=gen) for b in args.batches}
        current = "float32"
        for dtype in [d for d in DTYPES if d in args.dtypes]:  # float32, bfloat16, int8: each from the one before
            if dtype == "bfloat16" or (dtype == "int8" and current == "float32"):
                model = model.to(torch.bfloat16)  # a new model; the float32 one is freed
                gc.collect()
            if dtype == "int8":
                model = quantize_int8(model, args.group_size, inplace=True)
                gc.collect()
            current = dtype
            wbytes = weight_bytes(model)
            bw = read_bandwidth(args.read_gib)
            bandwidths.append(dict(before=f"{name} {dtype}", bytes_per_s=bw))
            beside = None
            if args.int8_beside_bf16 and dtype == "bfloat16":
                beside = quantize_int8(model, args.group_size)  # (shares the float parameters it keeps)
            for b in args.batches:
                runs = [("griffin", model, nullcontext)]
                if beside is not None:
                    runs.append((BESIDE, beside, nullcontext))
                if args.huge_pages_too:
                    runs.append(("griffin, huge pages", huge_page_copy(model), nullcontext))
                if args.unfused:
                    runs.append(("griffin unfused", decode_model(model, b, fuse=False), nullcontext))
                if args.kernel_by_kernel_too and one_call_per_block(dtype, b):  # (else the copy would be oneDNN's)
                    runs.append(("griffin, kernel by kernel", kernel_by_kernel(model, b), nullcontext))
                if b == 1 or (dtype == "int8" and not tiled_host):
                    runs += [(prefetch_label(a), model, partial(module_setting, matvec_cpu, "PREFETCH_BYTES", a))
                             for a in args.prefetch_too]
                if tiled and dtype == "int8" and b > 1:
                    untiled = partial(module_setting, matvec_cpu, "FAST_TILES", frozenset())
                    runs.append(("griffin, no tiles", model, untiled))
                times, rates = interleaved_steps([m for _, m, _ in runs], prompts_of[b], args.warmup, args.steps,
                                                 args.compile, read_tensor(args.read_gib / 8), [s for _, _, s in runs],
                                                 args.turn_steps)
                for (path, m, _), t in zip(runs, times, strict=True):
                    if path == BESIDE:
                        record(t, name, path, "int8", b, weight_bytes(m), rates)
                    else:
                        record(t, name, path, dtype, b, wbytes, rates)
                del runs  # (the copies hold the weights: the next model must not find them alive)
            del beside
            if args.profile and name == args.models[0] and dtype in ("bfloat16", "int8"):
                profiles.append(dict(model=name, dtype=dtype, batch=1, ops=profile_steps(
                    griffin_loop(model, prompts_of[args.batches[0]][:1], args.warmup + 6, args.compile), 12)))
            if args.split and name == args.models[0] and dtype in ("bfloat16", "int8"):
                for b in args.batches:
                    splits.append(dict(model=name, dtype=dtype, batch=b, **split_step(
                        model, prompts_of[b], args.warmup, args.steps)))
            if dtype == "bfloat16" and hf_wanted and name in HF_SHAPES:
                with tempfile.TemporaryDirectory() as tmp:
                    hf = hf_from(model, Path(tmp))
                for b in args.batches:
                    record(timed_steps(hf_loop(hf, prompts_of[b], n), args.warmup, args.steps), name, "hf", dtype, b,
                           wbytes)
                del hf
                gc.collect()
        del model
        gc.collect()
    bar.close()
    bw = read_bandwidth(args.read_gib)
    bandwidths.append(dict(before="end", bytes_per_s=bw))
    best = max(b["bytes_per_s"] for b in bandwidths)
    for r in rows:
        r["bandwidth_fraction"] = r["weight_gbps"] * 1e9 / best
        r["adjacent_fraction"] = r["weight_gbps"] / r["read_gbps_adjacent"]
        r["between_fraction"] = r["weight_gbps"] / r["read_gbps_between"]
        same = [o for o in rows if o["model"] == r["model"] and o["batch"] == r["batch"] and o["path"] == "griffin"]
        bf16 = [o for o in same if o["dtype"] == "bfloat16"]  # (a BESIDE row: the bf16 run its steps alternated with)
        r["vs_bf16"] = r["tokens_per_s"] / bf16[0]["tokens_per_s"] if bf16 else float("nan")
        fused = [o for o in rows if o["model"] == r["model"] and o["batch"] == r["batch"] and o["dtype"] == r["dtype"]
                 and o["path"] == "griffin"]
        r["vs_fused"] = r["tokens_per_s"] / fused[0]["tokens_per_s"] if fused else float("nan")
    wall = time.perf_counter() - started
    print(f"\nread bandwidth: best {best / 1e9:.1f} GB/s of {[round(b['bytes_per_s'] / 1e9, 1) for b in bandwidths]}; "
          f"{args.warmup} warm-up + median of {args.steps} steps; prompt {args.prompt}; "
          f"{'compiled' if args.compile else 'eager'}; wall {wall / 60:.1f} min")
    print(table(rows, [("model", "model", ""), ("path", "path", ""), ("weights", "dtype", ""), ("batch", "batch", "d"),
                       ("ms/step", "step_ms", ".1f"), ("tokens/s", "tokens_per_s", ".2f"),
                       ("weight GB", "weight_gb", ".2f"), ("weight GB/s", "weight_gbps", ".1f"),
                       ("of best read GB/s", "bandwidth_fraction", ".0%"),
                       ("of read GB/s just before", "adjacent_fraction", ".0%"),
                       ("read GB/s between steps", "read_gbps_between", ".1f"),
                       ("of it", "between_fraction", ".0%"),
                       ("tokens/s vs griffin bf16", "vs_bf16", ".2f"),
                       ("tokens/s vs the griffin row", "vs_fused", ".2f")]))
    goals = []
    for r in rows:
        if r["path"] == "griffin" and r["dtype"] == "bfloat16" and r["batch"] == 1:
            goals.append(dict(goal="bf16 at >= 75% of the read rate between its steps, batch 1", model=r["model"],
                              value=r["between_fraction"], met=r["between_fraction"] >= 0.75,
                              of_best=r["bandwidth_fraction"]))
        if r["path"] in ("griffin", BESIDE) and r["dtype"] == "int8":
            goals.append(dict(goal="int8 >= 1.8x bf16 tokens/s" + (", steps in turn" if r["path"] == BESIDE else ""),
                              model=r["model"], batch=r["batch"], value=r["vs_bf16"], met=r["vs_bf16"] >= 1.8))
    for g in goals:
        print(f"goal {g['goal']} ({g['model']}{', batch ' + str(g['batch']) if 'batch' in g else ''}): "
              f"{g['value']:.2f} {'met' if g['met'] else 'NOT met'}"
              + (f" (of the best read rate of the run: {g['of_best']:.2f})" if "of_best" in g else ""))
    for prof in profiles:
        print(f"\n{prof['model']} {prof['dtype']} batch 1: operators by self CPU time per step (torch.profiler)")
        print(table(prof["ops"], [("operator", "op", ""), ("calls/step", "calls", ".1f"),
                                  ("self ms/step", "self_ms", ".2f")]))
    if splits:
        print("\nwhere a step goes (ms; matmuls: the weight matmuls' calls)")
        print(table(splits, [("model", "model", ""), ("weights", "dtype", ""), ("batch", "batch", "d"),
                             ("step", "step_ms", ".1f"), ("matmuls inside the step", "kernels_inside_ms", ".1f"),
                             ("the same calls replayed", "kernels_replayed_ms", ".1f"),
                             ("step without the matmuls", "step_without_kernels_ms", ".1f"),
                             ("matmul calls", "calls", "d")]))
    write_json(args.out, dict(args=vars(args), machine=info, load_average_end=machine_info(torch.device("cpu"))[
        "load_average"], wall_s=wall, read_bandwidth=bandwidths, rows=rows, goals=goals, profiles=profiles,
        splits=splits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
