"""Inference speed of MQA, Hawk and Griffin (paper Section 5, Figures 1b and 4, Appendix G), against their peers.

Measures, for three models of the same width and depth that differ only in their temporal-mixing blocks
(global MQA everywhere; recurrent everywhere; recurrent, recurrent, local MQA repeated):

1. latency (Figure 4): seconds to sample N tokens greedily at a fixed batch, after an empty prompt (one BOS
   token) and after a long prompt;
2. maximum throughput (Figure 1b): batch x N / latency after an empty prompt, doubling the batch while the
   predicted memory (parameters + :func:`griffin.cache.cache_bytes` + decode activations) fits a budget;
3. the same Griffin weights in HF transformers' RecurrentGemma (built by HF, saved, loaded by griffin's
   importer) and in the official ``recurrentgemma`` package's PyTorch model (``recurrentgemma.torch.Griffin``,
   given griffin's weights): greedy outputs compared, and each peer's generation timed beside griffin's at the
   same batch and lengths (HF through its ``generate``; the official model through its own cache, one call per
   token, as its ``Sampler`` does);
4. the memory bandwidth a decode step achieves (Section 5.1: it must read the parameters and the whole cache
   once) as a fraction of the machine's measured copy bandwidth.

Everything is timed with ``time.perf_counter`` after warm-up runs (medians over ``--repeats``). griffin is timed
through :func:`griffin.inference.generate.generate_stream`
at temperature 0, the loop that ``griffin.generate`` consumes;
its per-token timestamps give the prefill time and the median decode step at no extra cost.

Run from the repository root (the generic helpers are in ``benchmarks/common.py``):

    python benchmarks/inference.py                       # CPU-sized defaults (about 8 minutes on 2 cores)
    python benchmarks/inference.py --scale paper-1b --device cuda --dtype bfloat16    # the paper's 1B setting
    python benchmarks/inference.py --help                # every flag
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.cache import cache_bytes
from griffin.config import ModelConfig, nominal_size
from griffin.inference.generate import generate_stream
from griffin.interop import load_pretrained
from griffin.interop.official import import_official_torch, to_official_state
from griffin.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, label, machine_info, median_run, progress, sync, table  # noqa: E402

FAMILIES = ("mqa", "hawk", "griffin")
BOS, EOS, PAD = 2, 1, 0  # RecurrentGemma's special tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Defaults of each --scale; every value can be overridden by its own flag.
SCALES: dict[str, dict[str, Any]] = {
    # Small enough that the whole run takes under 10 minutes on a 2-core CPU; window, prompt and throughput lengths
    # are the paper's divided by 4.
    # The budget is set so that it binds MQA first, then Griffin, as on the paper's accelerator.
    "cpu": dict(width=256, depth=6, heads=4, rnn_width=None, vocab=4096, window=256, batch=16, prompt=1024,
                lengths=[128, 256, 512, 1024], throughput_lengths=[128, 256, 512], memory_gb=0.05,
                min_batch=8, max_batch=128, hf_lengths=[128, 512]),
    # Section 5: 1B models (Appendix C's 1.3B row), batch 16, 4K prompt, 512..4096 sampled tokens, one device.
    "paper-1b": dict(width=2048, depth=24, heads=16, rnn_width=2560, vocab=32_000, window=1024, batch=16,
                     prompt=4096, lengths=[256, 512, 1024, 2048, 4096], throughput_lengths=[512, 1024, 2048, 4096],
                     memory_gb=16.0, min_batch=16, max_batch=4096, hf_lengths=[256, 1024]),
}


# Models ------------------------------------------------------------------------------------------------------
def family_config(args: argparse.Namespace, family: str) -> ModelConfig:
    """A model of ``family`` at the benchmark size, in HF RecurrentGemma's conventions (embedding scale, logit
    soft-cap, one gate block per head, no Conv1D document reset) so that the Griffin one is HF-expressible."""
    return ModelConfig(
        family=family, vocab_size=args.vocab, width=args.width, depth=args.depth, rnn_width=args.rnn_width,
        num_heads=args.heads, head_dim=args.width // args.heads, num_kv_heads=1, attention_window=args.window,
        gate_blocks=args.heads, embed_scale=True, logits_soft_cap=30.0, conv1d_document_reset=False,
        name=f"{family}-bench",
    )


def hf_griffin(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> tuple[Any, CausalLM]:
    """An HF RecurrentGemma Griffin built by transformers, saved, and loaded into griffin via ``from_pretrained``."""
    import transformers

    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=6 * args.width, num_hidden_layers=args.depth,
        num_attention_heads=args.heads, num_key_value_heads=1, lru_width=args.rnn_width,
        attention_window_size=args.window, block_types=["recurrent", "recurrent", "attention"],
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    torch.manual_seed(args.seed)
    hf = transformers.RecurrentGemmaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_pretrained(tmp, dtype=dtype)
    expected = family_config(args, "griffin")
    if ours.config.replace(name="") != expected.replace(name=""):
        raise RuntimeError(f"the HF import gave {ours.config}, not the benchmark's Griffin {expected}")
    hf.generation_config.eos_token_id = None  # sample exactly max_new_tokens, like griffin without stop tokens
    return hf.to(device, dtype), ours.to(device).eval()


def build_models(args: argparse.Namespace, dtype: torch.dtype, device: torch.device,
                 hf: bool) -> tuple[dict[str, CausalLM], Any]:
    """The benchmark's models by family (randomly initialised, seeded) and the HF model (None if not ``hf``)."""
    models, hf_model = {}, None
    for family in args.families:
        if family == "griffin" and hf:
            hf_model, models[family] = hf_griffin(args, dtype, device)
            continue
        torch.manual_seed(args.seed)
        models[family] = CausalLM(family_config(args, family)).to(device, dtype).eval()
    return models, hf_model


def official_griffin(model: CausalLM) -> Any:
    """``recurrentgemma.torch.Griffin`` with ``model``'s weights (a model in RecurrentGemma's conventions, e.g. one
    loaded from HF), for inference: no gradient checkpointing."""
    rg = import_official_torch()
    kinds = {"recurrent": rg.TemporalBlockType.RECURRENT, "local_attention": rg.TemporalBlockType.ATTENTION}
    c = model.config
    config = rg.GriffinConfig(
        vocab_size=c.vocab_size, width=c.width, mlp_expanded_width=c.mlp_width, num_heads=c.num_heads,
        block_types=tuple(kinds[b] for b in c.block_types), embeddings_scale_by_sqrt_dim=c.embed_scale,
        attention_window_size=c.attention_window - 1,  # the official mask admits window_size + 1 keys
        logits_soft_cap=c.logits_soft_cap, lru_width=c.rnn_width,
    )
    official = rg.Griffin(config, gradient_checkpointing=False, device=model.device, dtype=model.dtype)
    official.load_state_dict(to_official_state(model))
    return official.eval()


# Memory model ------------------------------------------------------------------------------------------------
def param_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_bytes(config: ModelConfig, batch: int, length: int, dtype: torch.dtype) -> int:
    """Peak live activations of one decode step (an estimate): three float32 copies of the logits (projection,
    soft-cap, sampling), four hidden tensors of the widest layer, and float32 scores and a mask over the keys
    one attention block reads."""
    item = torch.empty(0, dtype=dtype).element_size()
    keys = 0
    if "attention" in config.block_types:
        keys = length
    if "local_attention" in config.block_types:
        keys = max(keys, min(length, config.attention_window))
    widest = max(config.mlp_width, config.rnn_width, config.num_heads * config.head_dim)
    return batch * (3 * 4 * config.vocab_size + 4 * item * widest + 9 * config.num_heads * keys)


def predicted_memory(model: CausalLM, batch: int, length: int) -> int:
    """Bytes needed to sample ``length`` tokens at ``batch``: parameters + cache (Appendix G.3) + activations."""
    cfg, dtype = model.config, model.dtype
    return param_bytes(model) + cache_bytes(cfg, batch, length, dtype) + activation_bytes(cfg, batch, length, dtype)


# Timing ------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One timed greedy generation."""

    total_s: float  # prompt in, N tokens out
    first_s: float  # prefill and the first token
    step_s: float  # median time of one decode step (forward of one token + sampling)
    tokens: Tensor  # (B, N)


def run_griffin(model: CausalLM, prompts: Tensor, n: int, compile: bool = False) -> Run:
    """Sample ``n`` tokens greedily with :func:`griffin.inference.generate.generate_stream` (what ``generate`` runs);
    ``compile``: with the ``torch.compile``d decode step, compiled for these shapes first (untimed)."""
    device = model.device
    if compile:
        for _ in generate_stream(model, prompts, 2, temperature=0.0, max_length=prompts.shape[1] + n, compile=True):
            pass
    sync(device)
    start = time.perf_counter()
    stamps, out = [], []
    for step in generate_stream(model, prompts, n, temperature=0.0, compile=compile):  # each step syncs
        stamps.append(time.perf_counter())
        out.append(step)
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return Run(stamps[-1] - start, stamps[0] - start, statistics.median(steps) if steps else float("nan"),
               torch.tensor(out).T)


def run_hf(hf: Any, prompts: Tensor, n: int) -> Run:
    """Sample ``n`` tokens greedily with HF's own ``generate`` (its cached, token-by-token decoding)."""
    device = prompts.device
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n)
    sync(device)
    total = time.perf_counter() - start
    return Run(total, float("nan"), float("nan"), out[:, prompts.shape[1] :].cpu())


def run_official(official: Any, prompts: Tensor, n: int) -> Run:
    """Sample ``n`` tokens greedily with the official model and its cache: the prompt in one call, then one call
    per token (what its ``Sampler`` does, without the tokenizer); tokens go to Python every step, as griffin's."""
    batch, length = prompts.shape
    device = prompts.device
    sync(device)
    start = time.perf_counter()
    out = []
    with torch.no_grad():
        logits, cache = official(prompts, torch.arange(length, device=device).expand(batch, length))
        for step in range(n):
            tokens = logits[:, -1].argmax(-1)
            out.append(tokens.tolist())
            if step < n - 1:
                position = torch.full((batch, 1), length + step, device=device)
                logits, cache = official(tokens[:, None], position, cache)
    total = time.perf_counter() - start
    return Run(total, float("nan"), float("nan"), torch.tensor(out).T)


def make_prompts(args: argparse.Namespace, batch: int, length: int, device: torch.device) -> Tensor:
    """BOS then random token ids (seeded): the same prompts for every model."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, args.vocab, (batch, length), generator=gen)
    ids[:, 0] = BOS
    return ids.to(device)


# Benchmarks --------------------------------------------------------------------------------------------------
def bench_latency(args: argparse.Namespace, models: dict[str, CausalLM], device: torch.device) -> list[dict]:
    """Figure 4: time to sample N tokens at ``--batch`` after an empty prompt and after a ``--prompt`` prompt."""
    prompts = {1: make_prompts(args, args.batch, 1, device), args.prompt: make_prompts(args, args.batch, args.prompt,
                                                                                        device)}
    rows = []
    with progress(len(models) * len(prompts) * len(args.lengths) * args.repeats, "latency") as bar:
        for family, model in models.items():
            for prompt_len, ids in prompts.items():
                for n in args.lengths:
                    def once(model=model, ids=ids, n=n) -> Run:
                        bar.update()
                        return run_griffin(model, ids, n, args.compile)

                    run = median_run(once, args.repeats)
                    rows.append(dict(family=family, batch=args.batch, prompt=prompt_len, tokens=n,
                                     latency_s=run.total_s, prefill_s=run.first_s, step_ms=1e3 * run.step_s))
    return rows


def bench_throughput(args: argparse.Namespace, models: dict[str, CausalLM], device: torch.device) -> list[dict]:
    """Figure 1b: tokens/s = batch x N / latency after an empty prompt, the batch doubled from ``--min-batch``
    while the predicted memory fits ``--memory-gb`` (and the batch ``--max-batch``)."""
    budget = int(args.memory_gb * 2**30)
    plan = []
    for family, model in models.items():
        for n in args.throughput_lengths:
            batch = args.min_batch
            while batch <= args.max_batch and predicted_memory(model, batch, 1 + n) <= budget:
                plan.append((family, n, batch))
                batch *= 2
            if not any(p[:2] == (family, n) for p in plan):
                print(f"throughput: {family} does not fit {args.memory_gb} GiB at batch {args.min_batch}, N={n}")
    rows = []
    with progress(len(plan) * args.repeats, "throughput") as bar:
        for family, n, batch in plan:
            model = models[family]
            ids = torch.full((batch, 1), BOS, device=device)

            def once(model=model, ids=ids, n=n) -> Run:
                bar.update()
                return run_griffin(model, ids, n, args.compile)

            run = median_run(once, args.repeats)
            rows.append(dict(family=family, tokens=n, batch=batch, latency_s=run.total_s,
                             tokens_per_s=batch * n / run.total_s,
                             predicted_gb=predicted_memory(model, batch, 1 + n) / 2**30))
    return rows


def max_throughput(rows: list[dict]) -> list[dict]:
    """The best row of each (family, N)."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["family"], r["tokens"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    return list(best.values())


@dataclass
class Peer:
    """Another implementation of the benchmark's Griffin: its prompt logits and its greedy generation."""

    name: str
    logits: Callable[[Tensor], Tensor]
    run: Callable[[Tensor, int], Run]


def peers(hf: Any, official: Any) -> list[Peer]:
    out = []
    if hf is not None:
        out.append(Peer("HF", lambda ids: hf(ids, use_cache=False).logits, lambda ids, n: run_hf(hf, ids, n)))
    if official is not None:
        def official_logits(ids: Tensor) -> Tensor:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
            return official(ids, positions, return_cache=False)[0]

        out.append(Peer("official", official_logits, lambda ids, n: run_official(official, ids, n)))
    return out


def check_peer(args: argparse.Namespace, peer: Peer, model: CausalLM, device: torch.device) -> dict:
    """Same weights, same prompts: the prompt logits and ``--check-tokens`` greedy tokens of a peer and griffin."""
    ids = make_prompts(args, args.batch, 64, device)
    with torch.no_grad():
        diff = (peer.logits(ids).float() - model(ids).float()).abs().max().item()
    ours = run_griffin(model, ids, args.check_tokens, args.compile).tokens
    theirs = peer.run(ids, args.check_tokens).tokens
    return dict(peer=peer.name, max_logit_diff=diff, tokens=args.check_tokens, batch=args.batch,
                token_agreement=(ours == theirs).float().mean().item())


def bench_peers(args: argparse.Namespace, peer_list: list[Peer], model: CausalLM, device: torch.device) -> list[dict]:
    """griffin's and each peer's greedy generation of the same model, same batch, prompts and lengths, in turn."""
    prompts = {1: make_prompts(args, args.batch, 1, device), args.prompt: make_prompts(args, args.batch, args.prompt,
                                                                                        device)}
    rows = []
    total = len(prompts) * len(args.hf_lengths) * (1 + len(peer_list)) * args.repeats
    with progress(total, "peers vs griffin") as bar:
        for prompt_len, ids in prompts.items():
            for n in args.hf_lengths:
                def ours(ids=ids, n=n) -> Run:
                    bar.update()
                    return run_griffin(model, ids, n, args.compile)

                a = median_run(ours, args.repeats)
                tokens = args.batch * n
                row = dict(batch=args.batch, prompt=prompt_len, tokens=n, griffin_s=a.total_s,
                           griffin_tok_s=tokens / a.total_s)
                for peer in peer_list:
                    def theirs(ids=ids, n=n, peer=peer) -> Run:
                        bar.update()
                        return peer.run(ids, n)

                    b = median_run(theirs, args.repeats)
                    row.update({f"{peer.name}_s": b.total_s, f"{peer.name}_tok_s": tokens / b.total_s,
                                f"ratio_{peer.name}": b.total_s / a.total_s,
                                f"agree_{peer.name}": (a.tokens == b.tokens).float().mean().item()})
                rows.append(row)
    return rows


def bench_bandwidth(args: argparse.Namespace, models: dict[str, CausalLM], latency: list[dict],
                    copy_bw: float) -> list[dict]:
    """Section 5.1: bytes a decode step must read (parameters + batch x cache at the median step's length)
    over the median step time of the longest latency runs, against the measured copy bandwidth."""
    rows = []
    n = max(args.lengths)
    for r in latency:
        if r["tokens"] != n:
            continue
        model = models[r["family"]]
        length = r["prompt"] + n // 2
        cache = cache_bytes(model.config, args.batch, length, model.dtype)
        read = param_bytes(model) + cache
        achieved = read / (r["step_ms"] / 1e3)
        rows.append(dict(family=r["family"], batch=args.batch, prompt=r["prompt"], length=length,
                         param_mb=param_bytes(model) / 2**20, cache_mb=cache / 2**20, step_ms=r["step_ms"],
                         achieved_gb_s=achieved / 1e9, fraction_of_copy=achieved / copy_bw))
    return rows


# Reporting ---------------------------------------------------------------------------------------------------
def plot_latency(rows: list[dict], path: Path) -> None:
    """Figure 4: latency vs tokens sampled, one panel per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = sorted({r["prompt"] for r in rows})
    fig, axes = plt.subplots(1, len(prompts), figsize=(4.2 * len(prompts), 3.2), sharey=True)
    for ax, prompt in zip(axes, prompts, strict=True):
        for family in FAMILIES:
            pts = sorted((r["tokens"], r["latency_s"]) for r in rows if r["family"] == family and r["prompt"] == prompt)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label(family))
        ax.set_title("empty prompt" if prompt == 1 else f"{prompt}-token prompt")
        ax.set_xlabel("tokens sampled")
        ax.set_xscale("log", base=2)
        lengths = sorted({r["tokens"] for r in rows})
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"latency (s), batch {rows[0]['batch']}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_throughput(best: list[dict], path: Path) -> None:
    """Figure 1b: maximum tokens/s vs tokens sampled, grouped bars per family, each labelled with its batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["tokens"] for r in best})
    families = [f for f in FAMILIES if any(r["family"] == f for r in best)]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    width = 0.8 / len(families)
    for i, family in enumerate(families):
        by_n = {r["tokens"]: r for r in best if r["family"] == family}
        xs = [j + (i - (len(families) - 1) / 2) * width for j in range(len(lengths))]
        bars = ax.bar(xs, [by_n[n]["tokens_per_s"] if n in by_n else 0.0 for n in lengths], width,
                      label=label(family))
        ax.bar_label(bars, [f"B={by_n[n]['batch']}" if n in by_n else "" for n in lengths], fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("tokens sampled (empty prompt)")
    ax.set_ylabel("max throughput (tokens/s)")
    ax.set_ylim(0, 1.3 * max(r["tokens_per_s"] for r in best))
    ax.legend(ncol=len(families), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# Command line ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/inference.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="defaults for the flags below")
    m = p.add_argument_group("models (same width and depth for every family)")
    m.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    m.add_argument("--width", type=int, help="model width D")
    m.add_argument("--depth", type=int, help="residual blocks N")
    m.add_argument("--heads", type=int, help="attention heads (head dim = width / heads; one KV head)")
    m.add_argument("--rnn-width", type=int, help="recurrence width D_RNN (default: width, as RecurrentGemma)")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument("--window", type=int, help="Griffin's local attention window")
    r = p.add_argument_group("runs")
    r.add_argument("--batch", type=int, help="batch of the latency and HF runs (paper: 16)")
    r.add_argument("--prompt", type=int, help="tokens of the long prompt (paper: 4096)")
    r.add_argument("--lengths", type=int, nargs="+", help="tokens sampled in the latency runs")
    r.add_argument("--throughput-lengths", type=int, nargs="+", help="tokens sampled in the throughput runs")
    r.add_argument("--memory-gb", type=float, help="memory budget (GiB) that caps the throughput batch")
    r.add_argument("--min-batch", type=int, help="first throughput batch, then doubled")
    r.add_argument("--max-batch", type=int, help="largest throughput batch")
    r.add_argument("--hf-lengths", type=int, nargs="+", help="tokens sampled in the HF / official comparison")
    r.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    r.add_argument("--no-official", action="store_true",
                   help="skip the comparison with the official recurrentgemma package's PyTorch model")
    r.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared between each peer and griffin")
    r.add_argument("--repeats", type=int, default=1, help="timed runs per point (the median is kept)")
    r.add_argument("--copy-mb", type=int, default=1024, help="buffer size of the copy-bandwidth measurement")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--compile", action="store_true",
                   help="decode with the torch.compile'd step (CUDA graphs on GPU), compiled before each timed run")
    e = p.add_argument_group("environment and output")
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    e.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads (default: all cores)")
    e.add_argument("--out", default="benchmarks/results/inference.json", help="JSON results")
    e.add_argument("--figures", default="docs/figures", help="folder of the PNG plots ('' for none)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in SCALES[args.scale].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rnn_width is None:
        args.rnn_width = args.width
    if args.width % args.heads:
        raise ValueError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if min(args.batch, args.prompt, args.min_batch, args.repeats, *args.lengths, *args.throughput_lengths) < 1:
        raise ValueError("batches, prompt, lengths and repeats must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print Markdown tables, write the JSON results and the plots."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.compile:  # one compilation per family, batch and KV-cache size
        torch._dynamo.config.recompile_limit = 256
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    hf_reason = None
    if args.no_hf:
        hf_reason = "--no-hf"
    elif "griffin" not in args.families:
        hf_reason = "no griffin family"
    elif args.rnn_width != args.width:
        hf_reason = "HF RecurrentGemma's cached decoding needs lru_width == hidden_size"
    if hf_reason:
        print(f"HF comparison skipped: {hf_reason}")
    models, hf = build_models(args, dtype, device, hf_reason is None)
    official = None
    if args.no_official or "griffin" not in models:
        print(f"official-package comparison skipped: {'--no-official' if args.no_official else 'no griffin family'}")
    else:
        try:
            official = official_griffin(models["griffin"])
        except ImportError as err:
            print(f"official-package comparison skipped: {err}")
    peer_list = peers(hf, official)
    info = machine_info(device)
    print(f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads, {device}, {args.dtype}; "
          f"load average {info['load_average'][0]:.2f}")
    model_rows = [dict(family=f, params=m.num_parameters(), size=nominal_size(m.num_parameters()),
                       cache_mb_per_row=cache_bytes(m.config, 1, args.prompt + max(args.lengths), dtype) / 2**20)
                  for f, m in models.items()]
    print(f"\nModels: D={args.width}, D_RNN={args.rnn_width}, N={args.depth}, {args.heads} heads, "
          f"vocab {args.vocab}, Griffin window {args.window}")
    print(table(model_rows, [("family", "family", ""), ("parameters", "params", ","), ("", "size", ""),
                             (f"cache MiB/row at T={args.prompt + max(args.lengths)}", "cache_mb_per_row", ".2f")]))

    for model in models.values():  # warm-up: allocator, numba kernels of the prefill scan and decode step
        run_griffin(model, make_prompts(args, args.batch, min(64, args.prompt), device), 4, args.compile)
    copy_bw = copy_bandwidth(args.copy_mb * 2**20, device)
    results: dict[str, Any] = dict(machine=info, args=vars(args), models=model_rows, copy_gb_s=copy_bw / 1e9)

    results["peer_checks"] = []
    for peer in peer_list:
        check = check_peer(args, peer, models["griffin"], device)
        results["peer_checks"].append(check)
        print(f"\n{peer.name} check: max |logit diff| {check['max_logit_diff']:.1e} on a 64-token prompt, "
              f"{100 * check['token_agreement']:.1f}% of {check['tokens']} greedy tokens agree (batch {args.batch})")

    results["latency"] = latency = bench_latency(args, models, device)
    print(f"\nLatency (Figure 4): batch {args.batch}, greedy, seconds to sample N tokens")
    print(table(latency, [("family", "family", ""), ("prompt", "prompt", "d"), ("N", "tokens", "d"),
                          ("latency s", "latency_s", ".2f"), ("prefill s", "prefill_s", ".3f"),
                          ("decode step ms", "step_ms", ".2f")]))

    results["bandwidth"] = bandwidth = bench_bandwidth(args, models, latency, copy_bw)
    print(f"\nDecode memory bandwidth (Section 5.1): copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")
    print(table(bandwidth, [("family", "family", ""), ("prompt", "prompt", "d"), ("cache length", "length", "d"),
                            ("params MiB", "param_mb", ".1f"), ("cache MiB", "cache_mb", ".1f"),
                            ("step ms", "step_ms", ".2f"), ("GB/s", "achieved_gb_s", ".2f"),
                            ("of copy", "fraction_of_copy", ".0%")]))

    results["throughput"] = throughput = bench_throughput(args, models, device)
    results["max_throughput"] = best = max_throughput(throughput)
    print(f"\nThroughput (Figure 1b): empty prompt, batch doubled from {args.min_batch} up to {args.max_batch} "
          f"while the predicted memory fits {args.memory_gb} GiB")
    print(table(throughput, [("family", "family", ""), ("N", "tokens", "d"), ("batch", "batch", "d"),
                             ("predicted GiB", "predicted_gb", ".3f"), ("latency s", "latency_s", ".2f"),
                             ("tokens/s", "tokens_per_s", ",.0f")]))
    print("\nMaximum throughput")
    print(table(best, [("family", "family", ""), ("N", "tokens", "d"), ("batch", "batch", "d"),
                       ("tokens/s", "tokens_per_s", ",.0f")]))

    if peer_list:
        results["peers"] = peer_rows = bench_peers(args, peer_list, models["griffin"], device)
        names = [peer.name for peer in peer_list]
        print(f"\ngriffin vs {' and '.join(names)} (same Griffin weights), greedy, batch {args.batch}; ratio = "
              f"peer's time / griffin's")
        columns = [("prompt", "prompt", "d"), ("N", "tokens", "d"), ("griffin s", "griffin_s", ".2f")]
        columns += [(f"{name} s", f"{name}_s", ".2f") for name in names]
        columns += [("griffin tok/s", "griffin_tok_s", ",.0f")]
        columns += [(f"{name} tok/s", f"{name}_tok_s", ",.0f") for name in names]
        columns += [(f"ratio {name}", f"ratio_{name}", ".2f") for name in names]
        columns += [(f"agree {name}", f"agree_{name}", ".1%") for name in names]
        print(table(peer_rows, columns))

    results["load_average_end"] = os.getloadavg()  # with this run's own threads: about --threads when alone
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    if args.figures:
        figures = Path(args.figures)
        figures.mkdir(parents=True, exist_ok=True)
        plot_latency(latency, figures / "inference_latency.png")
        plot_throughput(best, figures / "inference_throughput.png")
        print(f"wrote {figures / 'inference_latency.png'} and {figures / 'inference_throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
