"""Sliding-window attention (Section 2.3): griffin's chunked kernel against the alternatives, on the same inputs.

    chunked (C)      griffin.ops.attention.sliding_window_attention, C queries per chunk (default window/4)
    chunked, C = W   the same with chunks as long as the window (the old default: 2x the useful work)
    5-D chunks       chunks of C = W passed as one 5-D tensor (griffin's path before: PyTorch's CPU dispatch
                     sends it to the unfused math kernel)
    dense mask       one T x T boolean mask (sliding_window_attention_ref; O(T^2) memory)
    causal (global)  PyTorch's causal attention over all T keys, no mask: the work of global attention
    flex             torch.compile'd FlexAttention with a sliding-window block mask (--flex)
    compiled         the chunked kernel under torch.compile, its chunks by the fused kernel (in float32 for bf16
                     inputs, as a compiled CPU step runs it; and in bf16) and by attention_bmm (--compiled: what a
                     compiled training step runs; chunks_by_bmm chooses between them)

Each is timed forward and forward+backward (sum of the output), median of --repeats after a warm-up. "useful
GFLOP/s" counts 4·d FLOPs per (query, key) pair the window lets a query see, whatever the kernel executes.

    python benchmarks/local_attention.py                      # CPU: B=4, T=2048/4096/8192, window 1024
    python benchmarks/local_attention.py --device cuda --dtype bfloat16 --batch 8 --heads 8 --flex
    python benchmarks/local_attention.py --lengths 4096 --window 256 --chunks-only --chunks 32 128 256   # sweep
    python benchmarks/local_attention.py --compiled --batch 16 --heads 2 --lengths 256 --window 128   # griffin-cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import griffin.ops.attention as attention
from griffin.ops.attention import local_chunk, sliding_window_attention, sliding_window_attention_ref

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, median_time, module_setting, sync, write_json  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def five_d_chunks(q, k, v, window: int):  # (B, T, H, d): the pre-change layout, chunks of C = window
    B, T, H, d = q.shape
    C = window
    n = -(-T // C)
    span = C + window - 1
    qc = F.pad(q, (0, 0, 0, 0, 0, n * C - T)).view(B, n, C, H, d).transpose(2, 3)  # (B, n, H, C, d)

    def keys(t):
        t = F.pad(t, (0, 0, 0, 0, window - 1, n * C - T))
        return t.unfold(1, span, C).permute(0, 1, 2, 4, 3)  # (B, n, Hk, span, d)

    j = torch.arange(C, device=q.device)[:, None]
    r = torch.arange(span, device=q.device)[None, :]
    i = torch.arange(n, device=q.device)[:, None, None] * C
    mask = ((r >= j) & (r < j + window) & (i + r >= window - 1))[:, None]  # (n, 1, C, span)
    out = F.scaled_dot_product_attention(qc, keys(k), keys(v), attn_mask=mask, enable_gqa=k.shape[2] != H)
    return out.transpose(2, 3).reshape(B, n * C, H, d)[:, :T]


def flex_attention_fn(T: int, window: int, device: torch.device) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    block_mask = create_block_mask(sliding, None, None, T, T, device=str(device))
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                       enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    return run


def implementations(args: argparse.Namespace, T: int, device: torch.device) -> dict[str, Callable]:
    W = args.window
    impls: dict[str, Callable] = {
        f"chunked (C={min(local_chunk(W), T)})": lambda q, k, v: sliding_window_attention(q, k, v, W)}
    for c in args.chunks:
        impls[f"chunked, C = {c}"] = lambda q, k, v, c=c: sliding_window_attention(q, k, v, W, chunk=c)
    if args.compiled:
        for bmm in (False, True):
            fn = torch.compile(functools.partial(sliding_window_attention, window=W, bmm=bmm), dynamic=False)
            impls[f"compiled, chunks by {'attention_bmm' if bmm else 'fused SDPA'}"] = fn
        if args.dtype != "float32":  # the fused kernel in the inputs' dtype: what the step ran before it upcast
            fn = torch.compile(functools.partial(sliding_window_attention, window=W, bmm=False), dynamic=False)

            def in_half(q, k, v, fn=fn):
                with module_setting(attention, "compiled_cpu_half", lambda q: False):
                    return fn(q, k, v)

            impls[f"compiled, chunks by fused SDPA in {args.dtype}"] = in_half
    if args.chunks_only:
        return impls
    impls |= {
        f"chunked, C = W ({W})": lambda q, k, v: sliding_window_attention(q, k, v, W, chunk=W),
        "5-D chunks (C = W)": lambda q, k, v: five_d_chunks(q, k, v, W),
        "causal (global)": lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2),
    }
    if T <= args.dense_max_t:
        impls["dense mask"] = lambda q, k, v: sliding_window_attention_ref(q, k, v, W)
    if args.flex:
        impls["flex (compiled)"] = flex_attention_fn(T, W, device)
    return impls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--dense-max-t", type=int, default=4096, help="skip the dense T x T mask above this T")
    p.add_argument("--flex", action="store_true", help="also time compiled FlexAttention (compiles per T)")
    p.add_argument("--chunks", type=int, nargs="*", default=[], help="also time these chunk sizes")
    p.add_argument("--chunks-only", action="store_true", help="time the chunked kernel only (a chunk-size sweep)")
    p.add_argument("--compiled", action="store_true",
                   help="also time the chunked kernel compiled, its chunks by the fused kernel and by attention_bmm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/local_attention.json")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    info = machine_info(device)
    print(f"{info.get('gpu', info['cpu'])}, {info['threads']} threads, {args.dtype}; B={args.batch}, "
          f"{args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, window {args.window}; "
          f"load average {info['load_average'][0]:.2f}")
    rows = []
    print("| T | implementation | fwd ms | fwd+bwd ms | useful GFLOP/s fwd | fwd vs chunked | fwd+bwd vs chunked |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for T in args.lengths:
        B, H, Hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
        q = torch.randn(B, T, H, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, T, Hk, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(B, T, Hk, d, device=device, dtype=dtype, requires_grad=True)
        pairs = sum(min(t + 1, args.window) for t in range(T)) * B * H
        results = {}
        for name, fn in implementations(args, T, device).items():
            def forward(fn=fn, q=q, k=k, v=v) -> None:
                fn(q.detach(), k.detach(), v.detach())
                sync(device)

            def forward_backward(fn=fn, q=q, k=k, v=v) -> None:
                fn(q, k, v).sum().backward()
                sync(device)

            fwd = median_time(forward, args.repeats)
            no_backward = name.startswith("flex") and device.type == "cpu"  # FlexAttention has no CPU backward
            results[name] = (fwd, None if no_backward else median_time(forward_backward, args.repeats))
        base = next(iter(results.values()))
        for name, (fwd, fb) in results.items():
            row = dict(T=T, implementation=name, forward_s=fwd, forward_backward_s=fb,
                       useful_gflops_forward=4 * d * pairs / fwd / 1e9)
            rows.append(row)
            fb_ms, fb_ratio = ("–", "–") if fb is None else (f"{1e3 * fb:.1f}", f"{fb / base[1]:.2f}")
            print(f"| {T} | {name} | {1e3 * fwd:.1f} | {fb_ms} | {row['useful_gflops_forward']:.1f} | "
                  f"{fwd / base[0]:.2f} | {fb_ratio} |", flush=True)
    write_json(args.out, dict(machine=info, args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
