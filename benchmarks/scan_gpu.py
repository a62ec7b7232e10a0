"""GPU benchmark of the RG-LRU (paper Section 4.2, Figure 9a setting of Appendix D: batch 8, width 1024).

Times the fused Triton kernel (:mod:`griffin.ops.rg_lru.triton`: "triton" as the model calls it, and "triton-states",
whose backward reads the state the forward kept for every step) against, in the same run, a large device-to-device
copy (the practical bandwidth limit), the naive PyTorch loop (:func:`griffin.ops.rg_lru.rg_lru_ref`), torch.compile
of the gate math plus ``associative_scan``, and accelerated-scan's and fla's HGRN kernels where they are installed
(``benchmarks/scan_peers.py`` says how, without internet). Every implementation is first checked against the
float64 reference (output and gradients, B=2, T=512, D=96) and left out, with a note, if it is wrong.
Forward, backward and forward+backward, bf16 I/O (``--dtypes`` adds fp32). Achieved bandwidth = bytes an ideal
fused kernel must move / time: forward reads x, gate_x, gate_a and writes y (4 arrays); backward reads x, gate_x,
gate_a, dy and writes dx, dgate_x, dgate_a (7 arrays); the states variant moves 4 bytes an element more each way,
not counted. Medians of ``triton.testing.do_bench`` (eager, L2 flushed between calls) and, for the Triton kernels,
also of ``do_bench_cudagraph`` (replays of a CUDA graph: device time without Python launch overhead; backward =
forward+backward - forward there). A baseline whose backward fails is timed forward-only.

    PYTHONPATH=src python benchmarks/scan_gpu.py [--quick] [--out benchmarks/results/scan_gpu.json]
    PYTHONPATH=src python benchmarks/scan_gpu.py --sweep   # time kernel configurations (tile, warps, chunks)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from torch import Tensor
from triton.testing import do_bench, do_bench_cudagraph

import griffin.ops.rg_lru.triton as kernels
from griffin.ops.rg_lru import rg_lru_gates, rg_lru_ref

sys.path.insert(0, str(Path(__file__).parent))
from scan_peers import max_rel_error, peer_scans  # noqa: E402

C = 8.0
ARRAYS = {"fwd": 4, "bwd": 7, "fwd+bwd": 11}  # (B, T, D) arrays an ideal fused kernel reads + writes
MAX_REL_ERROR = 2e-2  # of y and of the gradients against float64, with bf16 inputs and outputs
Inputs = tuple[Tensor, Tensor, Tensor, Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(batch: int, steps: int, dim: int, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Random x and gate pre-activations; Lambda such that a = sigmoid(-Lambda) is uniform in [0.9, 0.999]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, gate_x, gate_a = (torch.randn(batch, steps, dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    a = torch.empty(dim, device="cuda").uniform_(0.9, 0.999, generator=gen)
    a_param = torch.log(torch.expm1(-torch.log(a)))  # softplus(Lambda) = -log a
    return x, gate_x, gate_a, a_param


def bench(fn: Callable[[], object], quick: bool) -> float:
    """Median milliseconds of fn."""
    return do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")


def copy_bandwidth(quick: bool) -> dict[str, float]:
    """A large device-to-device copy: bytes read + written per second (GB/s)."""
    src = torch.randn(2**28 if not quick else 2**26, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), quick)
    return {"bytes": 2 * src.numel() * 4, "ms": ms, "GB/s": 2 * src.numel() * 4 / ms / 1e6}


def _combine(left: tuple[Tensor, Tensor], right: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return left[0] * right[0], right[0] * left[1] + right[1]


def compiled_gates_and_scan() -> Callable[..., tuple[Tensor, Tensor]]:
    """torch.compile of the PyTorch gate math plus torch's associative_scan over time (fp32 state).

    Static shapes: with dynamic ones the symbolic sizes become lifted arguments of the scan, which inductor's
    Triton-scan lowering rejects (torch 2.11). So this baseline compiles once per shape.
    """
    from torch._higher_order_ops.associative_scan import associative_scan

    torch._functorch.config.donated_buffer = False  # the backward is timed with retain_graph=True

    def fn(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor) -> tuple[Tensor, Tensor]:
        a, b = rg_lru_gates(x, gate_x, gate_a, a_param, C, None)
        _, h = associative_scan(_combine, (a.float(), b.float()), dim=1, combine_mode="pointwise")
        return h.to(x.dtype), h[:, -1]

    return torch.compile(fn, dynamic=False)


def time_impl(fn: Callable[..., tuple[Tensor, Tensor]], inputs: Inputs, quick: bool) -> dict[str, float]:
    """Eager forward (training mode), backward (autograd, given dy) and forward+backward milliseconds."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y, _ = fn(*leaves)
    dy = torch.randn_like(y)

    def fwd_bwd() -> None:
        out, _ = fn(*leaves)
        torch.autograd.grad(out, leaves, dy)

    return {
        "fwd": bench(lambda: fn(*leaves), quick),
        "bwd": bench(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), quick),
        "fwd+bwd": bench(fwd_bwd, quick),
    }


def time_graphed(fn: Callable[..., tuple[Tensor, Tensor]], inputs: Inputs, quick: bool) -> dict[str, float]:
    """Forward and forward+backward as replays of a CUDA graph: device time, without Python launch overhead.

    Autograd runs each backward op on its forward op's stream and the graph is captured on a side stream, so the
    leaves are made inside the captured function and the backward is timed as (forward+backward) - forward.
    """
    dy = torch.randn(inputs[0].shape, device="cuda", dtype=inputs[0].dtype)

    def fwd() -> None:
        fn(*(t.detach().requires_grad_() for t in inputs))

    def fwd_bwd() -> None:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out, _ = fn(*leaves)
        torch.autograd.grad(out, leaves, dy)

    rep = 20 if quick else 50
    times = {"fwd": do_bench_cudagraph(fwd, rep=rep, return_mode="median")}
    times["fwd+bwd"] = do_bench_cudagraph(fwd_bwd, rep=rep, return_mode="median")
    times["bwd"] = times["fwd+bwd"] - times["fwd"]
    return times


def time_forward_only(fn: Callable[..., tuple[Tensor, Tensor]], inputs: Inputs, quick: bool) -> dict[str, float]:
    with torch.no_grad():
        return {"fwd": bench(lambda: fn(*inputs), quick)}


def _row(name: str, timing: str, shape: tuple[int, int, int], dtype: str, ms: dict[str, float],
         copy_gbs: float) -> dict:
    batch, steps, dim = shape
    n_bytes = batch * steps * dim * DTYPES[dtype].itemsize
    row = {"impl": name, "timing": timing, "B": batch, "T": steps, "D": dim, "dtype": dtype}
    for kind, value in ms.items():
        gbs = ARRAYS[kind] * n_bytes / value / 1e6
        row[kind] = {"ms": value, "GB/s": gbs, "copy%": 100 * gbs / copy_gbs}
    key = "fwd+bwd" if "fwd+bwd" in ms else "fwd"
    print(f"  {name:14s} {timing:10s} {dtype} B={batch} T={steps:6d} D={dim}: {key} {ms[key]:8.3f} ms "
          f"({row[key]['copy%']:5.1f}% of copy)", flush=True)  # fmt: skip
    return row


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:600]}"


def run_benchmark(args: argparse.Namespace) -> dict:
    """Eager timings of every implementation at every shape, then CUDA-graph timings of the Triton kernel."""
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth(args.quick)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; copy {copy['GB/s']:.0f} GB/s", flush=True)
    impls: dict[str, Callable[..., tuple[Tensor, Tensor]] | str] = {
        "triton": lambda *t: kernels.rg_lru_triton(*t, C),
        "triton-states": lambda *t: kernels.rg_lru_triton(*t, C, save_states=True),
        "torch.compile": compiled_gates_and_scan(),
        "pytorch-loop": lambda *t: rg_lru_ref(*t, C),
    }
    impls.update(peer_scans(cuda=args.impls is None or "accelerated-scan-warp" in args.impls))
    if args.impls is not None:
        unknown = sorted(set(args.impls) - set(impls))
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; known: {sorted(impls)}")
        impls = {name: fn for name, fn in impls.items() if name in args.impls or name.startswith("triton")}
    check, errors = make_inputs(2, 512, 96, torch.bfloat16, seed=1), {}
    for name, fn in list(impls.items()):
        if isinstance(fn, str):
            continue
        try:
            errors[name] = max_rel_error(fn, *check)
        except Exception as err:  # e.g. no backward: the timing below falls back to the forward alone
            errors[name] = f"reference check failed: {_error(err)}"
            continue
        print(f"  {name}: relative error {errors[name]:.2e} against the float64 reference", flush=True)
        if not errors[name] <= MAX_REL_ERROR:  # NaN too
            impls[name] = f"wrong: relative error {errors[name]:.2e} against the float64 reference"
    steps_list = [512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    shapes = args.shapes or [(8, t, 1024) for t in steps_list] + [(1, t, 2560) for t in steps_list]
    cases = [(shape, dtype) for dtype in args.dtypes for shape in shapes]
    result = {"device": props.name, "copy": copy, "reference_errors": errors, "rows": [], "notes": {}}
    notes = result["notes"]
    notes.update({name: fn for name, fn in impls.items() if isinstance(fn, str)})
    forward_only: set[str] = set()
    compile_s = 0.0
    for shape, dtype in cases:
        inputs = make_inputs(*shape, DTYPES[dtype])
        for name, fn in impls.items():
            if isinstance(fn, str) or (name == "pytorch-loop" and shape[1] > args.loop_max_t):
                continue
            if name == "torch.compile" and compile_s > args.compile_budget_s:
                stop = f"stopped after {compile_s:.0f} s of compiling (once per shape)"
                impls[name] = notes[name] = f"{notes[name]}; {stop}" if name in notes else stop
                continue
            t0 = time.time()
            try:
                ms = (time_forward_only if name in forward_only else time_impl)(fn, inputs, args.quick)
            except Exception as err:  # a baseline that cannot run is reported, not fatal
                print(f"  {name} {shape}: failed: {_error(err)}", flush=True)
                if name in forward_only:
                    impls[name] = notes[name] = f"failed at {shape}: {_error(err)}"
                    continue
                notes[name] = f"forward+backward failed ({_error(err)}); forward timed without autograd."
                forward_only.add(name)
                try:
                    ms = time_forward_only(fn, inputs, args.quick)
                except Exception as err2:
                    impls[name] = notes[name] = f"failed at {shape}: {_error(err2)}"
                    continue
            finally:
                compile_s += time.time() - t0 if name == "torch.compile" else 0.0
            result["rows"].append(_row(name, "eager", shape, dtype, ms, copy["GB/s"]))
        del inputs
        torch.cuda.empty_cache()
        save(args, {**result, "partial": True})
    for name in ("triton", "triton-states"):
        for shape, dtype in cases:
            if isinstance(impls[name], str):
                break
            try:
                ms = time_graphed(impls[name], make_inputs(*shape, DTYPES[dtype]), args.quick)
            except Exception as err:
                notes[f"{name} cuda-graph"] = f"capture failed at {shape} {dtype}: {_error(err)}"
                break
            result["rows"].append(_row(name, "cuda-graph", shape, dtype, ms, copy["GB/s"]))
            save(args, {**result, "partial": True})
    if args.loop_max_t < max(steps_list):
        notes["pytorch-loop"] = f"timed up to T={args.loop_max_t} only (one Python step per token)"
    return result


def save(args: argparse.Namespace, result: dict) -> None:
    """Write result as JSON to args.out (also after every shape, so that a cut-off run keeps its rows)."""
    result.update(command=" ".join(sys.argv), torch=torch.__version__, triton=triton.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def print_table(result: dict) -> None:
    print(f"\n{result['device']}; copy bandwidth {result['copy']['GB/s']:.0f} GB/s (read + write)")
    print("| impl | timing | dtype | B | T | D | fwd ms | fwd GB/s | bwd ms | bwd GB/s | fwd+bwd ms | fwd+bwd GB/s "
          "| % copy |")
    print("|---" * 13 + "|")
    for r in sorted(result["rows"], key=lambda r: (r["dtype"], -r["B"], r["T"], r["impl"], r["timing"])):
        cells = [f"{r[k]['ms']:.3f} | {r[k]['GB/s']:.0f}" if k in r else "n/a | n/a" for k in ARRAYS]
        pct = f"{r['fwd+bwd']['copy%']:.0f}" if "fwd+bwd" in r else "n/a"
        head = f"| {r['impl']} | {r['timing']} | {r['dtype']} | {r['B']} | {r['T']} | {r['D']}"
        print(f"{head} | {' | '.join(cells)} | {pct} |")
    for key, note in result["notes"].items():
        print(f"note: {key}: {note}")


SWEEP_CONFIGS = [
    # (block_t, block_d, num_warps, num_stages)
    (32, 32, 4, 3), (32, 32, 4, 2), (32, 32, 4, 4), (64, 32, 8, 3), (64, 32, 4, 3), (128, 32, 16, 2),
    (64, 16, 4, 3), (32, 16, 2, 3), (32, 32, 2, 3), (16, 32, 1, 3), (16, 16, 1, 3), (16, 32, 2, 3),
]  # fmt: skip


def _measure_config(cfg: kernels.KernelConfig, case: dict, copy_gbs: float, quick: bool) -> dict:
    """Time one configuration's forward and backward launches on case; compare with case["ref"] if set."""
    kernels.select_config = lambda *_, **__: cfg
    x, gate_x, gate_a, scale, dy, dh = (case[k] for k in ("x", "gate_x", "gate_a", "scale", "dy", "dh"))
    y, _, ckpt = torch.ops.griffin.rg_lru_fwd(x, gate_x, gate_a, scale, None, None, True, 0, False)
    grads = torch.ops.griffin.rg_lru_bwd(x, gate_x, gate_a, scale, None, ckpt, dy, dh, False, 0, False)
    outs = [y, *grads[:4]]
    err = max(_rel(a, b) for a, b in zip(outs, case["ref"], strict=True)) if case["ref"] else 0.0
    case["ref"] = case["ref"] or outs
    ms_f = bench(lambda: torch.ops.griffin.rg_lru_fwd(x, gate_x, gate_a, scale, None, None, True, 0, False), quick)
    ms_b = bench(lambda: torch.ops.griffin.rg_lru_bwd(x, gate_x, gate_a, scale, None, ckpt, dy, dh, False, 0, False),
                 quick)
    n_bytes = x.numel() * x.element_size()
    batch, steps, dim = x.shape
    row = {"B": batch, "T": steps, "D": dim, **dataclasses.asdict(cfg), "n_chunks": triton.cdiv(steps, cfg.chunk_t)}
    row.update(fwd_ms=ms_f, bwd_ms=ms_b, max_rel_err_vs_first=err)
    row["fwd_copy%"] = 100 * ARRAYS["fwd"] * n_bytes / ms_f / 1e6 / copy_gbs
    row["bwd_copy%"] = 100 * ARRAYS["bwd"] * n_bytes / ms_b / 1e6 / copy_gbs
    print(f"  B={batch} T={steps} D={dim} {cfg}: fwd {ms_f:.3f} ms ({row['fwd_copy%']:.0f}%), "
          f"bwd {ms_b:.3f} ms ({row['bwd_copy%']:.0f}%), err {err:.1e}", flush=True)  # fmt: skip
    return row


def run_sweep(args: argparse.Namespace) -> dict:
    """Time the forward and backward launches per configuration and time-chunk count, bf16; check each result."""
    select_config = kernels.select_config
    copy = copy_bandwidth(args.quick)
    results = []
    shapes = [(8, 4096, 1024), (1, 8192, 2560)]
    for batch, steps, dim in shapes:
        x, gate_x, gate_a, a_param = make_inputs(batch, steps, dim, torch.bfloat16)
        scale = (-C * math.log2(math.e)) * torch.nn.functional.softplus(a_param)
        case = dict(x=x, gate_x=gate_x, gate_a=gate_a, scale=scale, dy=torch.randn_like(x), ref=None)
        case["dh"] = torch.zeros(batch, dim, device="cuda")
        stage1 = []
        for bt, bd, nw, ns in SWEEP_CONFIGS:
            cfg = kernels.KernelConfig(bt, bd, triton.cdiv(steps, bt) * bt, nw, num_stages=ns)
            try:
                stage1.append(_measure_config(cfg, case, copy["GB/s"], args.quick))
            except Exception as err:  # a configuration the compiler rejects (e.g. out of shared memory)
                print(f"  {cfg}: failed {type(err).__name__}: {str(err)[:200]}", flush=True)
        results += stage1
        for key in ("fwd_ms", "bwd_ms"):
            for row in sorted(stage1, key=lambda r: r[key])[:2]:
                fields = {k: row[k] for k in ("block_t", "block_d", "num_warps", "num_stages")}
                for n_chunks in (4, 8, 16, 32):
                    chunk_t = triton.cdiv(triton.cdiv(steps, n_chunks), row["block_t"]) * row["block_t"]
                    cfg = kernels.KernelConfig(chunk_t=chunk_t, **fields)
                    results.append(_measure_config(cfg, case, copy["GB/s"], args.quick))
    kernels.select_config = select_config
    for key in ("fwd_ms", "bwd_ms"):
        for shape in shapes:
            rows = sorted((r for r in results if (r["B"], r["T"], r["D"]) == shape), key=lambda r: r[key])
            print(f"best {key[:3]} for B,T,D={shape}:")
            for r in rows[:6]:
                fields = ("block_t", "block_d", "num_warps", "num_stages", "n_chunks")
                print(f"   {r[key]:.3f} ms", *(f"{k}={r[k]}" for k in fields), f"err={r['max_rel_err_vs_first']:.1e}")
    return {"device": torch.cuda.get_device_name(), "copy": copy, "sweep": results}


def _shape(text: str) -> tuple[int, int, int]:
    try:
        batch, steps, dim = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxTxD (e.g. 8x2048x1024)") from None
    return batch, steps, dim


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scan_gpu.json"))
    parser.add_argument("--quick", action="store_true", help="two sequence lengths, short timing runs")
    parser.add_argument("--sweep", action="store_true", help="time kernel configurations instead")
    parser.add_argument("--loop-max-t", type=int, default=2048, help="longest T for the Python-loop baseline")
    parser.add_argument("--shapes", type=_shape, nargs="+", help="BxTxD cases (default: the Figure 9a set)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"], help="input/output dtypes")
    parser.add_argument("--impls", nargs="+", help="implementations besides triton (default: all; names are "
                        "triton, torch.compile, pytorch-loop and benchmarks/scan_peers.py's)")
    parser.add_argument("--compile-budget-s", type=float, default=150.0, help="time cap of the torch.compile baseline")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scan_gpu.py needs a CUDA GPU")
    result = run_sweep(args) if args.sweep else run_benchmark(args)
    if not args.sweep:
        print_table(result)
    save(args, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
