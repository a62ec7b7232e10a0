"""LoRA fine-tuning on CPU, griffin against HF transformers + PEFT, side by side on the same model, data and adapters.

1. **Model.** A Griffin in RecurrentGemma's settings (``--preset``, default ``griffin-cpu``, with
   :func:`griffin.interop.hf.hf_overrides`: one RG-LRU gate block per head, embeddings × √D, logits soft-capped at 30,
   no Conv1D document reset; ``--width``/``--rnn-width``/``--depth`` override the preset), randomly initialised
   (seeded) and exported with :func:`griffin.interop.export_hf`: HF loads it as ``RecurrentGemmaForCausalLM``,
   griffin through its HF importer. Both run it in float32, frozen.
2. **Adapters.** LoRA of rank ``--rank`` (alpha ``--alpha``, no dropout) on ``--targets`` (default: every projection),
   made once in griffin (:func:`griffin.finetune.lora.apply_lora`: A as PEFT draws it; B drawn N(0, ``--init-b``²)
   instead of PEFT's zeros, so that every adapter acts from the first step on) and written with
   :func:`~griffin.finetune.lora.save_lora`; griffin reads them back (:func:`~griffin.finetune.lora.read_lora`), PEFT
   loads them onto the HF model (``PeftModel.from_pretrained(..., is_trainable=True)``). Step 0 is the same function.
3. **Data.** Byte tokens of the Python standard library's source (``--data stdlib``; ``random`` for a vocabulary
   under 256), unpacked: each row one sequence of T tokens, cut at a seeded random offset; every step its own
   ``--batch-size`` rows, the same rows for both. The loss is the mean next-token cross-entropy over the row's T - 1
   targets: ``model(ids, labels=ids).loss`` in HF, griffin's ``model(ids, targets=ids shifted, -100 last)`` summed
   loss over the number of targets, as ``griffin.training.Trainer.train_step`` computes it.
4. **Step.** forward, loss, backward, gradient clipping at ``--grad-clip``, AdamW (``--lr``, betas, eps, weight decay
   ``--weight-decay`` on the adapters, as griffin's ``build_optimizer`` groups them), constant learning rate; eager
   on both sides (no ``torch.compile``).
5. **Measurement.** At each T both frameworks start in fresh subprocesses of this script: load, one untimed forward
   and backward at T = 16 (JIT kernels, lazy imports; no update), then the baseline resident memory (after ``gc`` and
   ``malloc_trim``) and the kernel's peak-RSS mark reset (``/proc/self/clear_refs``; a thread sampling VmRSS where
   that is refused). Then ``--warmup`` + ``--steps`` steps from the initial adapters, the two processes taking turns
   step by step (one computes while the other waits; the first mover alternates), so that a change in host load hits
   both. Reported: every step's loss, tokens/s = B·T / the median timed step (and per CPU-second, less sensitive to a
   shared host), and the peak resident memory above the baseline (activations, gradients, AdamW's state,
   temporaries) as well as the process's whole peak. ``--rounds`` repeats this with fresh processes; timed steps pool
   over rounds, memory is the largest of the rounds. Both processes get the griffin command's OpenMP setting
   (``OMP_WAIT_POLICY=passive`` unless set: torch's spinning default starves a shared host, HF more than griffin).

    python benchmarks/finetune.py                 # griffin-cpu at T = 512 and 2048, batch 2
    python benchmarks/finetune.py --quick         # a smoke run (tests): a tiny model, T = 192
    python benchmarks/finetune.py --profile       # also the top operators of one extra step on each side

Writes JSON (``--out``, default ``benchmarks/results/finetune.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, table, write_json  # noqa: E402

FRAMEWORKS = ("griffin", "hf")
IGNORE_INDEX = -100
QUICK = dict(preset="griffin-cpu", width=32, rnn_width=32, depth=3, seq_lens=[192], batch_size=2, warmup=1, steps=2,
             rounds=1, rank=4)


# Model, adapters and data (the parent process) -------------------------------------------------------------------
def bench_config(args: argparse.Namespace):
    """The benchmark's model config: the preset with the size overrides and RecurrentGemma's settings."""
    from griffin.config import ModelConfig
    from griffin.interop.hf import hf_overrides, hf_problems

    changes = {k: v for k, v in (("width", args.width), ("rnn_width", args.rnn_width), ("depth", args.depth))
               if v is not None}
    config = ModelConfig.from_preset(args.preset, **changes)
    config = config.replace(**hf_overrides(config), conv1d_document_reset=False)
    problems = hf_problems(config)
    if problems:
        raise SystemExit(f"--preset {args.preset} with these sizes is not expressible in HF: {'; '.join(problems)}")
    return config


def make_model_and_adapters(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write the HF export (``work/hf``) and the initial adapters (``work/adapter``); returns the model's summary."""
    from griffin.finetune.lora import apply_lora, lora_pairs, save_lora
    from griffin.interop import export_hf
    from griffin.interop.adapters import LoraSettings
    from griffin.model import CausalLM

    config = bench_config(args)
    torch.manual_seed(args.seed)
    model = CausalLM(config)
    export_hf(model, work / "hf")
    modules = apply_lora(model, LoraSettings(args.rank, args.alpha, 0.0), args.targets)
    if args.init_b:
        gen = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for _, b in lora_pairs(model).values():
                b.copy_(torch.randn(b.shape, generator=gen) * args.init_b)
    save_lora(model, work / "adapter", base=str(work / "hf"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return dict(config=config.to_dict(), params=frozen, lora_params=trainable, lora_modules=len(modules),
                block_types=list(config.block_types))


def corpus_bytes(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's source (the embedded corpus), in a fixed order."""
    from griffin.data import default_corpus_files

    out, size = [], 0
    for path in sorted(default_corpus_files()):
        data = Path(path).read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(out)[:limit]


def make_rows(args: argparse.Namespace, vocab: int, seq_len: int, text: bytes | None) -> torch.Tensor:
    """(warmup + steps, batch, T) token ids: rows cut from ``text`` at seeded offsets, or random tokens."""
    shape = (args.warmup + args.steps, args.batch_size, seq_len)
    if text is None:
        return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(args.seed + seq_len))
    rng = random.Random(args.seed * 1_000_003 + seq_len)
    flat = []
    for _ in range(shape[0] * shape[1]):
        start = rng.randrange(0, len(text) - seq_len)
        flat.append(torch.frombuffer(bytearray(text[start: start + seq_len]), dtype=torch.uint8))
    return torch.stack(flat).long().view(shape)


# One framework at one T (a fresh subprocess) -----------------------------------------------------------------------
def status_kib() -> dict[str, int]:
    """The process's resident memory now (VmRSS) and its peak mark (VmHWM), KiB."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(key + r":\s+(\d+)", text).group(1)) for key in ("VmRSS", "VmHWM")}


class PeakRSS:
    """Peak resident memory from now on: the kernel's mark, reset here (``clear_refs`` 5), or, where the reset is
    refused, a thread sampling VmRSS every millisecond."""

    def __init__(self) -> None:
        self.method = "VmHWM reset"
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
        self.sampled = status_kib()["VmRSS"]
        self._stop = threading.Event()
        self._thread = None
        if self.method != "VmHWM reset":
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.sampled = max(self.sampled, status_kib()["VmRSS"])

    def peak_kib(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return max(self.sampled, status_kib()["VmRSS"])
        return status_kib()["VmHWM"]


def trim_heap() -> None:
    """Return freed heap memory to the system (glibc), so that the baseline counts what is held, not what was."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of each row, -100 (none) at the last position: the T - 1 targets HF's shifted labels give."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def load_griffin(args: argparse.Namespace, work: Path):
    """The exported model in griffin, with the saved adapters, and its step function (as ``Trainer.train_step``)."""
    from griffin.finetune.lora import apply_lora, lora_settings, read_lora
    from griffin.interop import load_pretrained
    from griffin.interop.adapters import read_adapter
    from griffin.training.config import TrainConfig
    from griffin.training.trainer import build_optimizer

    model = load_pretrained(work / "hf", torch.float32)
    adapter = read_adapter(work / "adapter", model.config)
    apply_lora(model, adapter.settings, sorted({m.rsplit(".", 1)[-1] for m in adapter.pairs}))
    read_lora(work / "adapter", model)
    assert lora_settings(model) == adapter.settings
    model.train()
    cfg = TrainConfig(lr=args.lr, weight_decay=args.weight_decay, beta1=args.betas[0], beta2=args.betas[1],
                      adam_eps=args.eps, grad_clip=args.grad_clip)
    opt = build_optimizer(model, cfg)

    def forward_backward(ids: torch.Tensor) -> torch.Tensor:
        targets = shifted_targets(ids)
        loss = model(ids, targets=targets) / (targets != IGNORE_INDEX).sum()
        loss.backward()
        return loss

    return model, opt, forward_backward


def load_hf(args: argparse.Namespace, work: Path):
    """The exported model in HF transformers with the saved adapters through PEFT, and its step function."""
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    base = transformers.RecurrentGemmaForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, work / "adapter", is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
                            weight_decay=args.weight_decay)

    def forward_backward(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    return model, opt, forward_backward


def profile_step(step, ids: torch.Tensor, rows: int = 20) -> dict[str, Any]:
    """One more step under torch's profiler: its operators' self CPU time, the top ``rows``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step(ids)
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    top = [dict(op=e.key, calls=e.count, self_ms=e.self_cpu_time_total / 1e3,
                share=e.self_cpu_time_total / total if total else 0.0) for e in events[:rows]]
    calls = sum(e.count for e in events)
    return dict(wall_s=wall, self_ms_total=total / 1e3, op_calls=calls, top=top)


def worker(args: argparse.Namespace) -> None:
    """One framework at one T in this (fresh) process, driven by the parent through stdin: load, pre-warm, take the
    baseline and say ``ready``; then one step per ``step`` line (its loss, wall and CPU seconds), and at ``end`` the
    peak memory (and, with ``--profile``, one more step under the profiler). One JSON line answers each."""
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    rows = torch.load(work / f"rows_{args.seq_len}.pt")
    start = time.perf_counter()
    model, opt, forward_backward = (load_griffin if args.worker == "griffin" else load_hf)(args, work)
    load_s = time.perf_counter() - start
    params = [p for p in model.parameters() if p.requires_grad]
    clip = args.grad_clip if args.grad_clip > 0 else float("inf")

    def step(ids: torch.Tensor) -> float:
        loss = forward_backward(ids)
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def say(payload: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    forward_backward(rows[0, :, :16])  # pre-warm: JIT kernels, lazy imports; no update
    opt.zero_grad(set_to_none=True)
    trim_heap()
    base = status_kib()["VmRSS"]
    peak = PeakRSS()
    say(dict(ready=True, framework=args.worker, load_s=load_s, base_mib=base / 1024,
             trainable=sum(p.numel() for p in params), threads=torch.get_num_threads()))
    done = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            wall, cpu = time.perf_counter(), time.process_time()
            loss = step(rows[done])
            say(dict(loss=loss, wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu))
            done += 1
        elif command == "end":
            peak_kib = peak.peak_kib()
            out = dict(peak_mib=peak_kib / 1024, peak_above_base_mib=(peak_kib - base) / 1024,
                       memory_method=peak.method)
            if args.profile:
                out["profile"] = profile_step(step, rows[-1])
            say(out)
            return


class Worker:
    """A :func:`worker` subprocess of this script."""

    def __init__(self, args: argparse.Namespace, framework: str, seq_len: int, work: Path) -> None:
        cmd = [sys.executable, __file__, "--worker", framework, "--work", str(work), "--seq-len", str(seq_len),
               "--threads", str(args.threads), "--lr", str(args.lr), "--betas", *map(str, args.betas), "--eps",
               str(args.eps), "--weight-decay", str(args.weight_decay), "--grad-clip", str(args.grad_clip),
               *(["--profile"] if args.profile else [])]
        self.framework, self.seq_len = framework, seq_len
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1)

    def ask(self, command: str | None) -> dict[str, Any]:
        """Send ``command`` (None: nothing, wait for the next answer) and return the answer."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"{self.framework} at T={self.seq_len} failed ({self.proc.returncode}):\n"
                               f"{self.stderr.read()[-4000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()


def run_pair(args: argparse.Namespace, seq_len: int, work: Path, first: str) -> dict[str, dict[str, Any]]:
    """Both frameworks at ``seq_len``, each in its own fresh process, their steps alternating (``first`` first, then
    the other way round at every step): only one computes at a time, and a change in host load hits both."""
    workers = {fw: Worker(args, fw, seq_len, work) for fw in FRAMEWORKS}
    try:
        runs = {fw: dict(w.ask(None), framework=fw, seq_len=seq_len, batch=args.batch_size, steps=[])
                for fw, w in workers.items()}
        order = [first, *(fw for fw in FRAMEWORKS if fw != first)]
        for i in range(args.warmup + args.steps):
            for fw in order if i % 2 == 0 else order[::-1]:
                runs[fw]["steps"].append(dict(workers[fw].ask("step"), load_average=os.getloadavg()[0]))
        for fw, w in workers.items():
            runs[fw].update(w.ask("end"))
    finally:
        for w in workers.values():
            w.close()
    for run in runs.values():
        timed = run["steps"][args.warmup:]
        run.update(losses=[s["loss"] for s in run["steps"]], times_s=[s["wall_s"] for s in timed],
                   cpu_s=[s["cpu_s"] for s in timed])
    return runs


# The comparison ----------------------------------------------------------------------------------------------------
def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per T: each framework's pooled timed steps, largest peak memory, first round's losses; the ratios."""
    rows = []
    for seq_len in args.seq_lens:
        row: dict[str, Any] = dict(seq_len=seq_len, batch=args.batch_size, tokens_per_step=args.batch_size * seq_len)
        for fw in FRAMEWORKS:
            mine = [r for r in runs if r["framework"] == fw and r["seq_len"] == seq_len]
            times = [t for r in mine for t in r["times_s"]]
            cpu = [t for r in mine for t in r["cpu_s"]]
            step = statistics.median(times)
            row[fw] = dict(step_median_s=step, step_min_s=min(times), step_max_s=max(times), times_s=times, cpu_s=cpu,
                           tokens_per_s=row["tokens_per_step"] / step,
                           tokens_per_s_best=row["tokens_per_step"] / min(times),
                           tokens_per_cpu_s=row["tokens_per_step"] / statistics.median(cpu),
                           peak_above_base_mib=max(r["peak_above_base_mib"] for r in mine),
                           peak_above_base_mib_rounds=[r["peak_above_base_mib"] for r in mine],
                           peak_mib=max(r["peak_mib"] for r in mine), base_mib=mine[0]["base_mib"],
                           load_s=mine[0]["load_s"], trainable=mine[0]["trainable"], losses=mine[0]["losses"],
                           losses_reproduced=all(r["losses"] == mine[0]["losses"] for r in mine),
                           memory_method=mine[0]["memory_method"],
                           load_average=[s["load_average"] for r in mine for s in r["steps"]])
            if "profile" in mine[0]:
                row[fw]["profile"] = mine[0]["profile"]
        g, h = row["griffin"], row["hf"]
        diffs = [rel_diff(a, b) for a, b in zip(g["losses"], h["losses"], strict=True)]
        row.update(loss_rel_diffs=diffs, max_loss_rel_diff=max(diffs), step0_loss_rel_diff=diffs[0],
                   speedup=g["tokens_per_s"] / h["tokens_per_s"],
                   speedup_best=g["tokens_per_s_best"] / h["tokens_per_s_best"],
                   speedup_cpu=g["tokens_per_cpu_s"] / h["tokens_per_cpu_s"],
                   memory_ratio=h["peak_above_base_mib"] / g["peak_above_base_mib"],
                   same_trainable=g["trainable"] == h["trainable"])
        rows.append(row)
    return rows


def report(results: dict[str, Any]) -> None:
    args, rows = results["args"], results["rows"]
    steps = args["warmup"] + args["steps"]
    print(f"\nStep losses (griffin / HF), {steps} steps from the same adapters:")
    for r in rows:
        pairs = " ".join(f"{g:.6f}/{h:.6f}" for g, h in zip(r["griffin"]["losses"], r["hf"]["losses"], strict=True))
        print(f"  T={r['seq_len']:>5}: {pairs}   max relative difference {r['max_loss_rel_diff']:.1e}")
    flat = [dict(T=r["seq_len"], batch=r["batch"], g_tok=r["griffin"]["tokens_per_s"], h_tok=r["hf"]["tokens_per_s"],
                 speedup=r["speedup"], cpu=r["speedup_cpu"], g_mem=r["griffin"]["peak_above_base_mib"],
                 h_mem=r["hf"]["peak_above_base_mib"], mem=r["memory_ratio"], loss=r["max_loss_rel_diff"],
                 g_rss=r["griffin"]["peak_mib"], h_rss=r["hf"]["peak_mib"])
            for r in rows]
    print(f"\nLoRA training step, tokens/s (median of {args['rounds'] * args['steps']} timed steps; per CPU-s: the "
          "ratio of tokens per CPU-second) and peak resident memory above the loaded model (MiB), and the process's "
          "whole peak (RSS):")
    print(table(flat, [("T", "T", "d"), ("batch", "batch", "d"), ("griffin tok/s", "g_tok", ",.0f"),
                       ("HF tok/s", "h_tok", ",.0f"), ("griffin / HF", "speedup", ".2f"),
                       ("per CPU-s", "cpu", ".2f"),
                       ("griffin MiB", "g_mem", ",.1f"), ("HF MiB", "h_mem", ",.1f"), ("HF / griffin", "mem", ".2f"),
                       ("griffin RSS", "g_rss", ",.0f"), ("HF RSS", "h_rss", ",.0f"),
                       ("loss rel. diff", "loss", ".1e")]))
    for r in rows:
        for fw in FRAMEWORKS:
            prof = r[fw].get("profile")
            if prof:
                print(f"\n{fw} at T={r['seq_len']}: one step {prof['wall_s']:.3f} s, {prof['op_calls']:,} operator "
                      "calls; top operators by self CPU time:")
                print(table(prof["top"][:12], [("operator", "op", ""), ("calls", "calls", ","),
                                               ("self ms", "self_ms", ",.1f"), ("share", "share", ".1%")]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model and adapters")
    m.add_argument("--preset", default="griffin-cpu", help="model preset (RecurrentGemma's settings are applied)")
    m.add_argument("--width", type=int, help="model width D (default: the preset's)")
    m.add_argument("--rnn-width", type=int, help="recurrence width D_RNN (default: the preset's)")
    m.add_argument("--depth", type=int, help="residual blocks (default: the preset's)")
    m.add_argument("--rank", type=int, default=8, help="LoRA rank")
    m.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    m.add_argument("--targets", default="all", help="LoRA targets: all, attention, mlp, recurrent or names")
    m.add_argument("--init-b", type=float, default=0.02,
                   help="std of the initial B matrices (0: PEFT's zeros, step 0 is then the base model)")
    r = p.add_argument_group("runs")
    r.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048], help="sequence lengths T")
    r.add_argument("--batch-size", type=int, default=2, help="rows per step")
    r.add_argument("--warmup", type=int, default=1, help="untimed steps (their losses are compared too)")
    r.add_argument("--steps", type=int, default=3, help="timed steps per run")
    r.add_argument("--rounds", type=int, default=2, help="runs of each (framework, T), order alternating")
    r.add_argument("--data", choices=("stdlib", "random"), default="stdlib",
                   help="byte tokens of the standard library's source, or random tokens (a vocabulary under 256)")
    r.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    r.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95], help="AdamW betas (griffin's defaults)")
    r.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    r.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on the adapters")
    r.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, one short T, 3 steps, 1 round")
    r.add_argument("--profile", action="store_true",
                   help="also profile one extra step of each framework (torch.profiler: top operators)")
    e = p.add_argument_group("environment and output")
    e.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads (default: all cores)")
    e.add_argument("--out", default="benchmarks/results/finetune.json", help="JSON results")
    e.add_argument("--keep", help="write the model, adapters and rows here (kept) instead of a temporary folder")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: one run, JSON on stdout
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:  # the quick run's sizes, unless given on the command line
        given = {a.dest for a in parser._actions if any(opt in (argv if argv is not None else sys.argv[1:])
                                                        for opt in a.option_strings)}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if args.worker is None:
        if min(args.seq_lens) < 17 or args.batch_size < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
            raise SystemExit("--seq-lens must be above 16, --batch-size, --steps and --rounds positive, --warmup >= 0")
        args.seq_lens = sorted(set(args.seq_lens))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import peft
    import transformers

    torch.set_num_threads(args.threads)
    info = machine_info(torch.device("cpu"))
    info.update(transformers=transformers.__version__, peft=peft.__version__, python=sys.version.split()[0])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="griffin-finetune-bench-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = make_model_and_adapters(args, work)
        vocab = model["config"]["vocab_size"]
        data = args.data if vocab >= 256 else "random"
        text = corpus_bytes(4_000_000) if data == "stdlib" else None
        for seq_len in args.seq_lens:
            torch.save(make_rows(args, vocab, seq_len, text), work / f"rows_{seq_len}.pt")
        c = model["config"]
        print(f"{info['cpu']}, {info['cores']} cores, {args.threads} threads; torch {info['torch']}, transformers "
              f"{info['transformers']}, peft {info['peft']}; load average {info['load_average'][0]:.2f}")
        print(f"Model: {args.preset} in RecurrentGemma's settings, D={c['width']}, D_RNN={c['rnn_width']}, "
              f"N={c['depth']} ({', '.join(model['block_types'])}), {c['num_heads']} heads, window "
              f"{c['attention_window']}, vocabulary {vocab}: {model['params']:,} frozen parameters; LoRA rank "
              f"{args.rank} alpha {args.alpha:g} on {model['lora_modules']} projections ({args.targets}): "
              f"{model['lora_params']:,} trainable. Data: {data}; batch {args.batch_size}, T = "
              f"{', '.join(map(str, args.seq_lens))}")
        runs = []
        for round_ in range(args.rounds):
            for i, seq_len in enumerate(args.seq_lens):
                pair = run_pair(args, seq_len, work, FRAMEWORKS[(round_ + i) % 2])
                for fw, run in pair.items():
                    runs.append(dict(run, round=round_))
                    print(f"  round {round_ + 1} {fw:>7} T={seq_len:>5}: step "
                          f"{' '.join(f'{t:.3f}' for t in run['times_s'])} s, peak +{run['peak_above_base_mib']:.1f} "
                          f"MiB, first loss {run['losses'][0]:.6f}", flush=True)
                print(f"  (load average {os.getloadavg()[0]:.2f})", flush=True)
    rows = summarize(args, runs)
    given = list(argv) if argv is not None else sys.argv[1:]
    results = dict(machine=info, command=shlex.join(["python", "benchmarks/finetune.py", *given]), args=vars(args),
                   model=model, data=data, rows=rows, runs=runs, wall_s=time.perf_counter() - started,
                   load_average_end=os.getloadavg())
    report(results)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
