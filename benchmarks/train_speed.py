"""Training speed as the sequence grows, at a fixed number of tokens per batch: the paper's Figure 3 (Section 3.3).

MQA, Hawk and Griffin of the same width, depth and hyper-parameters (Appendix C: one key/value head, head dimension
128, MLP expansion 3, 16 RG-LRU gate blocks, Griffin's local-attention window 1024) are trained for a few steps at
each sequence length T with batch = tokens / T, so that every step sees the same tokens. A step is forward,
cross-entropy, backward and an AdamW update; fp32 on CPU, bf16 autocast (fp32 weights) on CUDA; ``--compile`` runs
the model's forward and backward through torch.compile (static shapes: the first warm-up step of each T compiles,
so give ``--warmup`` at least 1). Reported: the step
time (``--stat``: the median of the timed steps, or the fastest on a shared host), tokens/s, the step time relative
to MQA at the shortest T (the paper's y axis, "relative to MQA at 2K"), and, from :mod:`griffin.flops`, training
FLOPs per token, the achieved TFLOP/s and the model FLOPs utilization.

    python benchmarks/train_speed.py              # CPU: D=256, N=6, 16K tokens, T=2K..8K; about 6 min on 2 cores
    python benchmarks/train_speed.py --scale paper-400m --device cuda       # Figure 3a: 400M, T=2K..32K
    python benchmarks/train_speed.py --scale paper-1b --device cuda --compile --seq-lens 2048
    python benchmarks/train_speed.py --from-json benchmarks/results/train_speed.json    # tables and plot again

Writes JSON (``--out``) and a bar chart (``--plot``) like the paper's figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from griffin.config import PAPER_SIZES, ModelConfig, nominal_size
from griffin.flops import flops_per_token, model_flops_utilization, peak_flops, training_flops_per_token
from griffin.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import label, machine_info, progress, sync, table  # noqa: E402

FAMILIES = ("mqa", "hawk", "griffin")

# Defaults of each --scale; every value can be overridden by its own flag.
SCALES: dict[str, dict[str, Any]] = {
    # A few minutes on 2 CPU cores. Head dimension 128 and D_RNN = 5D/4 as in the paper's 1.3B row; window 1024.
    "cpu": dict(width=256, rnn_width=320, depth=6, heads=2, vocab=256, window=1024, tokens=16_384,
                seq_lens=[2048, 4096, 8192], warmup=1, steps=2, stat="min"),
    # Figure 3a and 3b: Appendix C's 400M and 1.3B rows with a 32K vocabulary, sized (unmeasured) for one 80 GB
    # GPU: fp32 weights and AdamW state, bf16 activations. A point that runs out of memory is reported as such.
    "paper-400m": dict(preset_size="400m", vocab=32_000, window=1024, tokens=32_768,
                       seq_lens=[2048, 4096, 8192, 16384, 32768], warmup=3, steps=10, stat="median"),
    "paper-1b": dict(preset_size="1.3b", vocab=32_000, window=1024, tokens=16_384,
                     seq_lens=[2048, 4096, 8192, 16384], warmup=3, steps=10, stat="median"),
}


def family_config(args: argparse.Namespace, family: str) -> ModelConfig:
    """The benchmark model of ``family``: every family shares width, depth, heads and window (Section 3)."""
    return ModelConfig(
        family=family, vocab_size=args.vocab, width=args.width, depth=args.depth, rnn_width=args.rnn_width,
        num_heads=args.heads, head_dim=args.width // args.heads, num_kv_heads=1, attention_window=args.window,
        gate_blocks=16, name=f"{family}-train-speed",
    )


def make_batch(vocab: int, batch: int, seq_len: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Random inputs and targets (B, T): the step's cost does not depend on the token values."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen).to(device)
    return ids[:, :-1], ids[:, 1:]


def train_step(model: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, autocast: contextlib.AbstractContextManager) -> float:
    """Forward (the model or its compiled form), next-token cross-entropy, backward and one AdamW step; returns the
    loss."""
    opt.zero_grad(set_to_none=True)
    with autocast:
        logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    return loss.item()  # also waits for the device


def time_point(args: argparse.Namespace, model: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
               seq_len: int, device: torch.device, bar) -> list[float]:
    """``--warmup`` untimed steps, then the seconds of each of ``--steps`` timed ones."""
    inputs, targets = make_batch(args.vocab, args.tokens // seq_len, seq_len, device, args.seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        train_step(model, opt, inputs, targets, autocast)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        bar.update()
    return times


def run(args: argparse.Namespace, device: torch.device, peak: float) -> tuple[list[dict], list[dict]]:
    """Every (T, family) point, ``--rounds`` times; within a round T is the outer loop, so that a change in host
    load hits every family alike. A point's step time is the ``--stat`` of all its timed steps."""
    models: dict[str, tuple[CausalLM, torch.optim.Optimizer, Callable[[torch.Tensor], torch.Tensor]]] = {}
    model_rows = []
    for family in args.families:
        torch.manual_seed(args.seed)
        model = CausalLM(family_config(args, family)).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        models[family] = (model, opt, torch.compile(model, dynamic=False) if args.compile else model)
        n = model.num_parameters()
        model_rows.append(dict(family=family, params=n, size=nominal_size(n)))
    times: dict[tuple[str, int], list[float]] = {}
    loads: dict[tuple[str, int], list[float]] = {}
    failed: set[tuple[str, int]] = set()
    total = args.rounds * len(args.seq_lens) * len(models) * (args.warmup + args.steps)
    with progress(total, "train steps") as bar:
        for round_ in range(args.rounds):
            for seq_len in args.seq_lens:
                for family, (_, opt, step_model) in models.items():
                    key = (family, seq_len)
                    if key in failed:
                        bar.update(args.warmup + args.steps)
                        continue
                    try:
                        new = time_point(args, step_model, opt, seq_len, device, bar)
                    except torch.OutOfMemoryError:
                        opt.zero_grad(set_to_none=True)
                        torch.cuda.empty_cache()
                        failed.add(key)
                        bar.write(f"{label(family):>7} T={seq_len:>6}: out of memory")
                        continue
                    times.setdefault(key, []).extend(new)
                    loads.setdefault(key, []).append(os.getloadavg()[0])
                    bar.write(f"{label(family):>7} T={seq_len:>6} B={args.tokens // seq_len:>3} round {round_ + 1}: "
                              f"{' '.join(f'{t:.3f}' for t in new)} s/step (load {loads[key][-1]:.2f})")
    rows = []
    for seq_len in args.seq_lens:
        for family, (model, _, _) in models.items():
            key = (family, seq_len)
            row: dict[str, Any] = dict(family=family, seq_len=seq_len, tokens=args.tokens,
                                       batch=args.tokens // seq_len)
            if key not in times:
                rows.append(dict(row, error="out of memory"))
                continue
            ts = times[key]
            step = min(ts) if args.stat == "min" else statistics.median(ts)
            tok_s = args.tokens / step
            config = model.config
            model_flops = training_flops_per_token(config, seq_len, include_elementwise=False)
            forward = flops_per_token(config, seq_len)
            attention = forward["global_attention"] + forward["local_attention"]
            row.update(step_s=step, step_median_s=statistics.median(ts), step_min_s=min(ts), step_max_s=max(ts),
                       times_s=ts, load_average=loads[key], tokens_per_s=tok_s,
                       forward_flops_per_token=forward["total"], attention_share=attention / forward["total"],
                       train_flops_per_token=model_flops, train_mflops_per_token=model_flops / 1e6,
                       achieved_tflops=model_flops * tok_s / 1e12,
                       mfu=model_flops_utilization(config, seq_len, tok_s, peak))
            rows.append(row)
    add_ratios(rows, args.families, min(args.seq_lens))
    return model_rows, rows


def add_ratios(rows: list[dict], families: Sequence[str], base_len: int) -> None:
    """Step time relative to the reference (MQA, or else the first family, at the shortest T): measured, and as
    predicted by training FLOPs per token (what the ratio would be if time followed FLOPs)."""
    ref_family = "mqa" if "mqa" in families else families[0]
    ref = next((r for r in rows if r["family"] == ref_family and r["seq_len"] == base_len and "step_s" in r), None)
    for r in rows:
        r["reference"] = f"{ref_family}@{base_len}"
        if ref is None or "step_s" not in r:
            r["relative_time"] = r["flops_ratio"] = float("nan")
            continue
        r["relative_time"] = r["step_s"] / ref["step_s"]
        r["flops_ratio"] = r["train_flops_per_token"] / ref["train_flops_per_token"]


def ratio_table(rows: list[dict], families: Sequence[str], seq_lens: Sequence[int]) -> str:
    """Markdown: one row per T, measured step time relative to the reference per family, (FLOPs ratio)."""
    by = {(r["family"], r["seq_len"]): r for r in rows}
    head = "| T | batch | " + " | ".join(f"{label(f)}" for f in families) + " |"
    lines = [head, "|" + "---:|" * (2 + len(families))]
    for t in seq_lens:
        cells = []
        for f in families:
            r = by.get((f, t))
            if r is None or "step_s" not in r:
                cells.append("OOM" if r else "–")
            else:
                cells.append(f"{r['relative_time']:.2f} ({r['flops_ratio']:.2f})")
        batch = next((by[(f, t)]["batch"] for f in families if (f, t) in by), "")
        lines.append(f"| {t} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], families: Sequence[str], seq_lens: Sequence[int], path: Path, title: str) -> None:
    """Figure 3: grouped bars of step time relative to MQA at the shortest T, one group per T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["family"], r["seq_len"]): r for r in rows if "step_s" in r}
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(seq_lens), 3.6))
    width = 0.8 / len(families)
    for i, family in enumerate(families):
        xs = [j + (i - (len(families) - 1) / 2) * width for j in range(len(seq_lens))]
        values = [by[(family, t)]["relative_time"] if (family, t) in by else 0.0 for t in seq_lens]
        bars = ax.bar(xs, values, width, label=label(family))
        ax.bar_label(bars, [f"{v:.2f}" if v else "" for v in values], fontsize=7)
        flops = [by[(family, t)]["flops_ratio"] if (family, t) in by else float("nan") for t in seq_lens]
        ax.scatter(xs, flops, marker="_", s=220, color="black", lw=1.5, zorder=3,
                   label="if time followed FLOPs" if i == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(seq_lens)), [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in seq_lens])
    ax.set_xlabel("sequence length (fixed tokens per batch)")
    ax.set_ylabel(f"training time relative to\n{rows[0]['reference'].replace('@', ' at ').replace('mqa', 'MQA')}")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1.25 * max(max(r["relative_time"], r["flops_ratio"]) for r in by.values()))
    ax.legend(ncol=2, loc="upper left", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="defaults for the flags below")
    m = p.add_argument_group("models (same hyper-parameters for every family)")
    m.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    m.add_argument("--preset-size", choices=list(PAPER_SIZES),
                   help="width, RNN width, depth and heads from the paper's Table (Appendix C)")
    m.add_argument("--width", type=int, help="model width D")
    m.add_argument("--rnn-width", type=int, help="recurrence width D_RNN (a multiple of 16)")
    m.add_argument("--depth", type=int, help="residual blocks N")
    m.add_argument("--heads", type=int, help="attention heads (head dim = width / heads; one KV head)")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument("--window", type=int, help="Griffin's local attention window")
    r = p.add_argument_group("runs")
    r.add_argument("--tokens", type=int, help="tokens per batch (batch = tokens / T)")
    r.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths T")
    r.add_argument("--warmup", type=int, help="untimed steps per point")
    r.add_argument("--steps", type=int, help="timed steps per point and round")
    r.add_argument("--rounds", type=int, default=1, help="passes over every point (their steps are pooled)")
    r.add_argument("--stat", choices=("median", "min"),
                   help="step time of a point: median of its steps, or the fastest (for a shared host)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--compile", action="store_true", help="torch.compile the model (forward and backward)")
    e = p.add_argument_group("environment and output")
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads (default: all cores)")
    e.add_argument("--out", help="JSON results (default benchmarks/results/train_speed[_SCALE].json)")
    e.add_argument("--plot", help="PNG bar chart ('' for none; default docs/figures/train_speed[_SCALE].png)")
    e.add_argument("--from-json", help="print the tables and plot of an earlier run's JSON instead of running")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    defaults = dict(SCALES[args.scale])
    size = args.preset_size or defaults.pop("preset_size", None)
    if size is not None:
        width, rnn_width, depth, heads = PAPER_SIZES[size]
        defaults.update(width=width, rnn_width=rnn_width, depth=depth, heads=heads)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.preset_size = size
    if args.rnn_width is None:
        args.rnn_width = args.width
    suffix = "" if args.scale == "cpu" else f"_{args.scale.replace('-', '_')}"
    if args.out is None:
        args.out = f"benchmarks/results/train_speed{suffix}.json"
    if args.plot is None:
        args.plot = f"docs/figures/train_speed{suffix}.png"
    if args.width % args.heads:
        raise SystemExit(f"--width {args.width} is not divisible by --heads {args.heads}")
    for t in args.seq_lens:
        if t < 1 or args.tokens % t:
            raise SystemExit(f"--tokens {args.tokens} is not a positive multiple of the sequence length {t}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("--steps and --rounds must be positive, --warmup non-negative")
    if args.compile and args.warmup < 1:
        raise SystemExit("--compile needs --warmup 1 or more: the first step at each T compiles, and would be timed")
    args.seq_lens = sorted(args.seq_lens)
    return args


def report(results: dict[str, Any]) -> None:
    """Print the tables of a run (fresh or loaded with ``--from-json``)."""
    args, rows = results["args"], results["rows"]
    print(table(results["models"], [("family", "family", ""), ("parameters", "params", ","), ("", "size", "")]))
    ok = [r for r in rows if "step_s" in r]
    print(f"\nTraining step (forward + backward + AdamW), {args['tokens']:,} tokens per batch, {args['stat']} of "
          f"{args['rounds'] * args['steps']} steps; peak {results['peak_flops'] / 1e12:.3g} TFLOP/s "
          f"({results['peak_source']})")
    print(table(ok, [("family", "family", ""), ("T", "seq_len", "d"), ("batch", "batch", "d"),
                     ("step s", "step_s", ".3f"), ("tokens/s", "tokens_per_s", ",.0f"),
                     ("train MFLOP/token", "train_mflops_per_token", ".1f"),
                     ("attention share", "attention_share", ".1%"), ("TFLOP/s", "achieved_tflops", ".3g"),
                     ("MFU", "mfu", ".1%"), ("relative", "relative_time", ".2f")]))
    print(f"\nStep time relative to {rows[0]['reference']} (in brackets: the ratio of training FLOPs per token)")
    print(ratio_table(rows, args["families"], args["seq_lens"]))


def save_plot(results: dict[str, Any], path: Path) -> None:
    args, machine = results["args"], results["machine"]
    where = machine.get("gpu", f"{machine['cpu']}, {machine['threads']} threads, fp32")
    size = nominal_size(results["models"][0]["params"])
    title = (f"D={args['width']}, N={args['depth']} ({results['models'][0]['family']} {size}), "
             f"{args['tokens'] // 1024}K tokens per batch\n{where}")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(results["rows"], args["families"], args["seq_lens"], path, title)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # tables and plot of an earlier run
        results = json.loads(Path(args.from_json).read_text())
        report(results)
        if args.plot:
            save_plot(results, Path(args.plot))
        return 0
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(device)
    where = info.get("gpu", f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads")
    print(f"{where}, {device}, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}"
          f"{', compiled' if args.compile else ''}; load average {info['load_average'][0]:.2f}")
    print(f"Models: D={args.width}, D_RNN={args.rnn_width}, N={args.depth}, {args.heads} heads of "
          f"{args.width // args.heads} (1 KV head), vocab {args.vocab}, Griffin window {args.window}; "
          f"{args.tokens:,} tokens per batch")

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak, source = peak_flops(device, dtype)
    model_rows, rows = run(args, device, peak)
    if source.startswith("measured"):  # measured again after the run; a busy host lowers one of the two
        after, _ = peak_flops(device, dtype, refresh=True)
        print(f"measured peak: {peak / 1e12:.3g} TFLOP/s before the run, {after / 1e12:.3g} after; using the larger")
        if after > peak:
            peak = after
            for r in rows:
                if "mfu" in r:
                    r["mfu"] = r["achieved_tflops"] * 1e12 / peak
    print()
    results = dict(machine=info, command=" ".join(shlex.quote(a) for a in ["python", *sys.argv]), args=vars(args),
                   peak_flops=peak, peak_source=source, models=model_rows, rows=rows,
                   load_average_end=os.getloadavg())
    if device.type == "cuda":
        results["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    if args.plot and any("step_s" in r for r in rows):
        save_plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
