"""The cost of serving LoRA adapters unmerged (``griffin serve BASE --adapter NAME=DIR ...``): one decode step of the
running batch, as the engine runs it (:func:`griffin.inference.generate.decode_model`'s copy, a
:class:`griffin.inference.Decoder` step), for

- ``plain``: the base model with no adapter loaded (a merged adapter costs exactly this: its weights are the base's
  shape);
- ``unmerged, 0``: adapters loaded (every projection a :class:`griffin.serve.adapters.MultiLoRALinear`), every row on
  the base model;
- ``unmerged, 1``: every row on the same adapter (two small matmuls per layer);
- ``unmerged, 4``: rows on 4 different adapters, round robin: two matmuls per layer over the 4 adapters side by side,
  each row's other adapters masked (the engine's choice at this many columns), and, ``gathered``, each row's A and B
  gathered and two batched matmuls (its choice beyond :data:`griffin.serve.adapters.MASKED_COLUMNS`).

The model is the Griffin of ``benchmarks/serve_load.py`` (byte-level, width 256, depth 6: 4.9M parameters, float32,
random weights); the adapters are rank 16 on every projection (``all``), as ``griffin finetune`` makes them. Median of
``--steps`` steps after a warm-up, for each batch size.

    python benchmarks/serve_lora.py                          # a few minutes on 2 cores
    NUMBA_NUM_THREADS=1 python benchmarks/serve_lora.py --threads 1 --clock cpu   # on a busy shared host
    python benchmarks/serve_lora.py --batch-sizes 1 8 --steps 50 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from griffin import CausalLM
from griffin.config import ModelConfig
from griffin.inference import Decoder
from griffin.inference.generate import decode_model
from griffin.interop.adapters import LoraSettings, base_fingerprint, resolve_targets, save_adapter
from griffin.serve import adapters as serve_adapters
from griffin.serve.adapters import load_adapters, multi_lora_swapped

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, module_setting, sync, table, write_json  # noqa: E402


def bench_config(width: int, depth: int, heads: int) -> ModelConfig:
    return ModelConfig(family="griffin", vocab_size=256, width=width, depth=depth, rnn_width=width, num_heads=heads,
                       head_dim=width // heads, num_kv_heads=1, attention_window=128, gate_blocks=heads,
                       embed_scale=True, logits_soft_cap=30.0, conv1d_document_reset=False, name="griffin-lora-bench")


def write_adapters(model: CausalLM, root: Path, count: int, rank: int, gen: torch.Generator) -> dict[str, Path]:
    out = {}
    for k in range(count):
        pairs = {}
        for name in resolve_targets(model.config, "all"):
            layer = model.get_submodule(name)
            pairs[name] = (torch.randn(rank, layer.in_features, generator=gen) * 0.05,
                           torch.randn(layer.out_features, rank, generator=gen) * 0.05)
        fingerprint = base_fingerprint({name: model.get_submodule(name).weight for name in pairs})
        save_adapter(root / f"a{k}", model.config, LoraSettings(rank, 2.0 * rank), pairs, fingerprint, "bench")
        out[f"a{k}"] = root / f"a{k}"
    return out


def median_time(step: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    """Median ``clock`` seconds of ``step()`` over ``repeats`` calls after one warm-up call."""
    step()
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append(clock() - start)
    return statistics.median(times)


@torch.no_grad()
def decode_step(model: CausalLM, batch: int, rows: list[int] | None, device: torch.device, gen: torch.Generator,
                gather: bool = False) -> Callable[[], None]:
    """One decode step of ``batch`` rows as the engine runs it, on the rows' adapters ``rows`` (None: no adapters;
    ``gather``: several adapters through the gather and batched matmuls, not the masked matmuls), after an 8-token
    prompt; the rows are set again before each step (the configurations share them)."""

    def set_rows() -> None:
        if rows is not None:
            with module_setting(serve_adapters, "MASKED_COLUMNS", 0 if gather else serve_adapters.MASKED_COLUMNS):
                model.adapter_rows.set(rows, device)

    set_rows()
    prompt = torch.randint(0, 256, (batch, 8), generator=gen).to(device)
    cache = model.init_cache(batch)
    model(prompt, cache=cache)
    decoder = Decoder(decode_model(model, batch), cache, prepack=False, matvec=False)
    tokens = torch.randint(0, 256, (batch,), generator=gen).to(device)

    def step() -> None:
        set_rows()
        with torch.no_grad():
            decoder(tokens)
        sync(device)

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds the steps are split into")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: the process's CPU time (with --threads 1 and NUMBA_NUM_THREADS=1, "
                        "the work of a step, steadier than wall time on a busy shared host)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_lora.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = CausalLM(bench_config(args.width, args.depth, args.heads)).eval().to(device)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = load_adapters(model, write_adapters(model, Path(tmp), 4, args.rank, gen))
    swapped = multi_lora_swapped(model, adapters)
    results = []
    for batch in args.batch_sizes:
        configs = {"plain": (model, None), "unmerged_0": (swapped, [-1] * batch),
                   "unmerged_1": (swapped, [0] * batch), "unmerged_4": (swapped, [i % 4 for i in range(batch)]),
                   "unmerged_4_gather": (swapped, [i % 4 for i in range(batch)])}
        steps = {k: decode_step(m, batch, rows, device, gen, gather=k.endswith("gather"))
                 for k, (m, rows) in configs.items() if not k.startswith("unmerged_4") or batch >= 4}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds):  # interleaved, so that a busy spell of a shared host hits every configuration
            for k, step in steps.items():
                times[k].append(median_time(step, max(1, args.steps // args.rounds), clock))
        plain = statistics.median(times["plain"])
        row = {"batch": batch, "plain_ms": plain * 1e3, **{f"unmerged_4{g}_{u}": math.nan for g in ("", "_gather")
                                                            for u in ("ms", "x")}}
        for k in steps:
            if k != "plain":
                t = statistics.median(times[k])
                row[f"{k}_ms"], row[f"{k}_x"] = t * 1e3, t / plain
        results.append(row)
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "batch"), flush=True)
    print(table(results, [("rows", "batch", "d"), ("plain ms", "plain_ms", ".3f"),
                          ("0 adapters ms", "unmerged_0_ms", ".3f"), ("x", "unmerged_0_x", ".2f"),
                          ("1 adapter ms", "unmerged_1_ms", ".3f"), ("x", "unmerged_1_x", ".2f"),
                          ("4 adapters ms", "unmerged_4_ms", ".3f"), ("x", "unmerged_4_x", ".2f"),
                          ("4, gathered ms", "unmerged_4_gather_ms", ".3f"), ("x", "unmerged_4_gather_x", ".2f")]))
    numba = os.environ.get("NUMBA_NUM_THREADS")
    command = (f"NUMBA_NUM_THREADS={numba} " if numba else "") + "python benchmarks/serve_lora.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    write_json(args.out, {"command": command,
                          "config": vars(args), "parameters": model.num_parameters(),
                          "machine": machine_info(device), "results": results})


if __name__ == "__main__":
    main()
