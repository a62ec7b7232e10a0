"""Profile of one decode step (paper Section 5): time and aten operators per generated token.

Paths, all greedy at batch ``--batch`` after the same ``--prompt``-token prompts, on the benchmark's models
(``benchmarks/inference.py``, same weights for griffin's Griffin and HF's RecurrentGemma):

- ``forward``: the generic path, ``model(tokens[:, None], cache=cache)`` (checks, masks and RoPE rebuilt each step);
- ``decoder``: ``generate_stream``, i.e. ``griffin.inference.generate.Decoder`` in eager mode;
- ``compiled``: the same with ``compile=True`` (``torch.compile`` of ``CausalLM.decode_step``; ``--compile``);
- ``hf``: HF transformers' ``generate`` of RecurrentGemma.

A step is one iteration of the sampling loop (forward + greedy sampling + handing the tokens to Python), timed as
the interval between consecutive tokens (griffin: between yields; HF: between calls of its model's forward) and
counted with a ``TorchDispatchMode`` over a separate run (not ``compiled``: a dispatch mode disables compilation;
it runs inductor's fused kernels instead of aten operators). The paths are run in turn ``--rounds`` times and the
median of the per-round medians is kept, so that load from other processes hits them alike.

    python benchmarks/decode_profile.py                         # Griffin, batch 16, 1024-token prompt
    python benchmarks/decode_profile.py --families hawk mqa griffin --compile
    python benchmarks/decode_profile.py --prompt 1 --compile --trace   # + where each path's step goes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from griffin.inference.generate import generate_stream, prefill
from griffin.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, table  # noqa: E402
from inference import build_models, make_prompts, parse_args  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.count += 1
        return func(*args, **(kwargs or {}))


def forward_loop(model: CausalLM, prompts: torch.Tensor, n: int, on_token: Callable[[], None]) -> None:
    """Greedy decoding through ``CausalLM.forward`` with a cache (the generic path)."""
    with torch.no_grad():
        logits, cache = prefill(model, prompts, max_length=prompts.shape[1] + n)
        for step in range(n):
            tokens = logits.float().argmax(-1)
            tokens.tolist()
            on_token()
            if step < n - 1:
                logits = model(tokens[:, None], cache=cache)[:, -1]


def griffin_loop(model: CausalLM, prompts: torch.Tensor, n: int, on_token: Callable[[], None],
                 compile: bool = False) -> None:
    for _ in generate_stream(model, prompts, n, temperature=0.0, compile=compile):
        on_token()


def hf_loop(hf: Any, prompts: torch.Tensor, n: int, on_token: Callable[[], None]) -> None:
    handle = hf.register_forward_pre_hook(lambda *_: on_token())
    try:
        with torch.no_grad():
            hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n,
                        min_new_tokens=n)
    finally:
        handle.remove()


def step_ms(loop: Callable[[Callable[[], None]], None]) -> float:
    """Median interval between consecutive tokens (the first interval, after the prefill, is left out)."""
    stamps: list[float] = []
    loop(lambda: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return 1e3 * statistics.median(steps)


def ops_per_step(loop: Callable[[Callable[[], None]], None]) -> float:
    """Median aten operators dispatched between consecutive tokens."""
    counts: list[int] = []
    with OpCounter() as counter:
        loop(lambda: counts.append(counter.count))
    return statistics.median(b - a for a, b in zip(counts[1:], counts[2:], strict=False))


def trace(loop: Callable[[Callable[[], None]], None], top: int = 10) -> list[dict]:
    """Self CPU time and calls per step of the ``top`` operators (``torch.profiler`` from the second token to the
    last of one run: the prefill and the first step are left out)."""
    from torch.profiler import ProfilerActivity, profile

    prof, stamps = profile(activities=[ProfilerActivity.CPU]), []

    def on_token() -> None:
        stamps.append(None)
        if len(stamps) == 2:
            prof.start()

    loop(on_token)
    prof.stop()
    steps = len(stamps) - 2
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [dict(op=e.key, calls=e.count / steps, self_us=e.self_cpu_time_total / steps) for e in events]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["griffin"], choices=["mqa", "hawk", "griffin"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time the torch.compile'd decode step")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--trace", action="store_true", help="also print each path's operators by self CPU time per step")
    p.add_argument("--out", default="benchmarks/results/decode_profile.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bench_args = parse_args(["--families", *args.families])  # the benchmark's model sizes (CPU scale)
    device, dtype = torch.device("cpu"), torch.float32
    with_hf = "griffin" in args.families and not args.no_hf
    models, hf = build_models(bench_args, dtype, device, with_hf)
    prompts = make_prompts(bench_args, args.batch, args.prompt, device)

    paths: dict[str, Callable[[Callable[[], None]], None]] = {}
    for family, model in models.items():
        paths[f"{family} forward"] = lambda f, model=model: forward_loop(model, prompts, args.tokens, f)
        paths[f"{family} decoder"] = lambda f, model=model: griffin_loop(model, prompts, args.tokens, f)
        if args.compile:
            paths[f"{family} compiled"] = lambda f, model=model: griffin_loop(model, prompts, args.tokens, f, True)
    if hf is not None:
        paths["griffin hf"] = lambda f: hf_loop(hf, prompts, args.tokens, f)

    for loop in paths.values():  # warm-up (and compilation)
        loop(lambda: None)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, loop in paths.items():
            times[name].append(step_ms(loop))
    rows = []
    for name, loop in paths.items():
        family, path = name.split()
        rows.append(dict(family=family, path=path, step_ms=statistics.median(times[name]), rounds_ms=times[name],
                         ops=float("nan") if path == "compiled" else ops_per_step(loop)))
    hf_ms = {r["family"]: r["step_ms"] for r in rows if r["path"] == "hf"}
    for r in rows:
        r["vs_hf"] = hf_ms[r["family"]] / r["step_ms"] if r["family"] in hf_ms else float("nan")
    load = os.getloadavg()
    print(f"{cpu_name()}, {args.threads} threads; batch {args.batch}, {args.prompt}-token prompt, {args.tokens} "
          f"tokens, median of {args.rounds} rounds; load average {load[0]:.2f} (1 min)")
    print(table(rows, [("family", "family", ""), ("path", "path", ""), ("step ms", "step_ms", ".2f"),
                       ("aten ops/step", "ops", ".0f"), ("HF step / step", "vs_hf", ".2f")]))
    if args.trace:
        for row, loop in zip(rows, paths.values(), strict=True):
            row["trace"] = trace(loop)
            print(f"\n{row['family']} {row['path']}: operators by self CPU time per step (torch.profiler)")
            print(table(row["trace"], [("operator", "op", ""), ("calls/step", "calls", ".1f"),
                                       ("self µs/step", "self_us", ".0f")]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), load_average=load, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
