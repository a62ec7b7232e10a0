"""Small-model training on the CPU: tokens/s and MFU of the reference step and the fast step (``--compile``), side by
side in one run (Section 6.2's models; the README's main job).

Each case builds two :class:`griffin.training.Trainer` of the same configuration, one with ``compile=False`` (the
reference: eager model, AdamW over per-tensor operators) and one with ``compile=True`` (griffin.training.fast:
``torch.compile`` of the model, fused AdamW), compiles the fast one, then times their ``train_step`` (batch,
forward, loss, backward, clipping, update: the trainer's own step) in alternating rounds, so that a change of load
on a shared host falls on both. Each waits for OpenMP work and keeps the memory it frees as its revision's
``griffin train`` does (:func:`griffin.threads.prefer_training_openmp_wait`, :func:`griffin.heap.keep_freed_memory`;
a ``--base`` revision older than them: passive, glibc's defaults). Reported per case: tokens/s of each (the median
round), the ratio, and the MFU against the trainer's peak (:func:`griffin.flops.peak_flops`: the ISA peak for torch's
threads).

Cases: the ``{mqa,hawk,griffin}-synthetic`` presets (5 blocks, width 64, vocabulary 16) on induction heads at
T = 256 with batches of 16 and 64, and on selective copying at T = 1024 with batches of 16; the main job's model
(``griffin-cpu``, T = 256, batch 16) on the embedded corpus. ``--main-job`` also trains the README's main job to
the end each way, each a ``griffin train`` process (``--compile``; ``--precision bf16`` with ``--bf16``; the
``--base`` revision's too) after a short run that warms its caches: wall time from outside (imports, compilation
and evaluations included) and the final validation loss of each. Asked for by name, ``{hawk,griffin}-256x32-far``:
the far-recall stage of docs/experiments.md (induction heads at T = 256, batches of 32, each row continuing a prefix
stream that takes in 2,048 filler tokens a step without gradients, ``--stream-advance 2048 --stream-recall 64
--recall-draw uniform``); tokens/s and MFU count the training tokens only, the stream's forward is in the time.

    python benchmarks/train_small.py                      # every case, about 10 minutes on 2 cores
    python benchmarks/train_small.py --main-job           # and the main job each way (about 10 minutes more)
    python benchmarks/train_small.py --cases hawk-256x16 --rounds 5 --steps 10
    python benchmarks/train_small.py --cases hawk-256x16 --rounds 1 --profile 5   # where each step's time goes
    python benchmarks/train_small.py --bf16 --main-job    # and the fast step under bf16 autocast (AVX-512-BF16 or AMX)
    python benchmarks/train_small.py --cases hawk-256x16 --bf16 --base 39a51ae   # and an older version's step too

``--base REV`` adds the reference step of another git revision of griffin (the code as it was when the speed goal was
set, say), measured in a worker process that imports that version (``git archive``, a numba cache of its own) and
takes its turn in the same alternating rounds: the ratios against it are what the changes since REV bought, the
thread count it ended with is reported (a version that lost ``--threads`` shows it here). ``--base-step fast_bf16``
(or ``fast``) times that revision's compiled step instead: what a change of the fast path bought.

    python benchmarks/train_small.py --cases mqa-1024x16 --bf16 --base 0c3c8ca --base-step fast_bf16 --threads 1
    python benchmarks/train_small.py --cases griffin-256x32-far --bf16 --base 573da90 --base-step fast_bf16 --threads 1

Writes JSON (``--out``, default benchmarks/results/train_small.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import griffin.threads

USER_ENV = dict(os.environ)  # as given: the child processes (griffin train, the base worker) make their own setting
# griffin train's OpenMP setting, before torch loads; the worker of a revision older than it (--base): passive, as
# that revision's griffin train
getattr(griffin.threads, "prefer_training_openmp_wait", griffin.threads.prefer_passive_openmp_wait)()
import torch  # noqa: E402

from griffin.synth import InductionHeads, SelectiveCopying, TaskSource  # noqa: E402
from griffin.training import TrainConfig, Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    git_source,
    keep_freed_memory,
    machine_info,
    progress,
    short_rev,
    table,
    write_json,
)

keep_freed_memory()  # griffin train's C heap setting


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    seq_len: int
    batch_size: int
    task: str | None  # a synthetic task, or None: the embedded corpus (the main job's data)
    stream: tuple[tuple[str, Any], ...] = ()  # TaskSource's prefix-stream options (griffin synth --prefix-stream)


# the far-recall stage of docs/experiments.md ("Far answers"): each step's rows continue a stream that takes in 2,048
# filler tokens a row without gradients first
FAR_RECALL = (("prefix_stream", True), ("stream_advance", 2048), ("stream_recall", 64), ("recall_draw", "uniform"))


def cases() -> dict[str, Case]:
    out = {}
    for family in ("mqa", "hawk", "griffin"):
        for seq_len, batch, task in ((256, 16, "induction_heads"), (256, 64, "induction_heads"),
                                     (1024, 16, "selective_copying")):
            name = f"{family}-{seq_len}x{batch}"
            out[name] = Case(name, f"{family}-synthetic", seq_len, batch, task)
    out["main-job"] = Case("main-job", "griffin-cpu", 256, 16, None)
    for family in ("hawk", "griffin"):
        out[f"{family}-256x32-far"] = Case(f"{family}-256x32-far", f"{family}-synthetic", 256, 32,
                                           "induction_heads", FAR_RECALL)
    return out


DEFAULT_CASES = [name for name, case in cases().items() if not case.stream]  # the far-recall ones when asked for


def make_task(case: Case):
    if case.task == "induction_heads":
        return InductionHeads(seq_len=case.seq_len)
    return SelectiveCopying(seq_len=case.seq_len, num_data=16)


def trainer(case: Case, out: Path, data: Path | None, fast: bool, threads: int, precision: str = "fp32") -> Trainer:
    common = dict(seq_len=case.seq_len, batch_size=case.batch_size, max_steps=10**6, out=str(out), progress=False,
                  tensorboard=False, sample_tokens=0, threads=threads, compile=fast, eval_interval=10**6,
                  precision=precision)
    if case.task is None:
        return Trainer(TrainConfig(preset=case.preset, data=str(data), **common))
    task = make_task(case)
    cfg = TrainConfig(preset=case.preset, data=f"synthetic:{task.name}",
                      model={"vocab_size": task.vocab_size, "attention_window": task.window}, **common)
    return Trainer(cfg, source=TaskSource(task, case.batch_size, seed=0, eval_sequences=8, **dict(case.stream)))


def native_bf16(device: torch.device) -> bool:
    """griffin's check for a bf16 matmul (imported here: the base revision's worker may predate it)."""
    from griffin.training.fast import native_bf16 as check

    return check(device)


def rate(t: Trainer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        t.train_step()
    return steps * t.cfg.batch_size * t.cfg.seq_len / (time.perf_counter() - start)


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# what each share counts: operator names containing these (griffin's custom operators and their autograd nodes;
# the C++ kernels Inductor generates, named by the profiler when the fast step is compiled with kernel profiling)
GROUPS = {"inductor": ("cpp_fused",), "rg_lru": ("rg_lru_cpu",), "conv1d": ("conv1d_cpu",),
          "copies": ("aten::copy_", "aten::_to_copy")}


def profile_shares(t: Trainer, steps: int) -> dict[str, Any]:
    """Shares of ``steps`` training steps' self CPU time (torch.profiler): the matmuls, each of :data:`GROUPS` (the
    first that matches: a generated kernel named after the griffin operator it feeds counts as Inductor's), and the
    eight operators that take the most; and the model's FLOPs per step over the matmuls' time per step (what the
    step's matmuls compute per second if they did all its arithmetic; on one thread, where self CPU time is wall
    time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t.train_step()
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())

    def group(key: str) -> str | None:
        if key in MATMULS:
            return "matmuls"
        return next((name for name, parts in GROUPS.items() if any(part in key for part in parts)), None)

    shares = {name: 0.0 for name in ("matmuls", *GROUPS)}
    for key, value in ops.items():
        if (name := group(key)) is not None:
            shares[name] += value / total
    matmul_s = shares["matmuls"] * total / 1e6 / steps
    flops = t.flops_per_token * t.cfg.batch_size * t.cfg.seq_len
    return {**shares, "matmul_s_per_step": matmul_s, "flops_over_matmul_time": flops / matmul_s,
            "top": [(k, v / total) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:8]]}


# The base revision's step: a worker process that imports that version of griffin -------------------------------------
# the kinds of step a base revision's worker can time: (compiled, precision)
BASE_STEPS = {"reference": (False, "fp32"), "fast": (True, "fp32"), "fast_bf16": (True, "bf16")}


def worker(case_name: str, threads: int, step: str = "reference") -> None:
    """Build ``case_name``'s trainer of kind ``step`` (:data:`BASE_STEPS`) with the griffin on ``PYTHONPATH`` (this
    file's helpers use only what older versions have too; the compiled steps need a version that has them), then
    answer each line ``N`` on stdin with the tokens/s of N steps and the thread count torch has after them."""
    from griffin.training.trainer import prepare_data

    case = cases()[case_name]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = None
        if case.task is None:
            data = prepare_data(TrainConfig(out=str(root / "prepare"), progress=False), root / "prepare")
        fast, precision = BASE_STEPS[step]
        t = trainer(case, root / "run", data, fast, threads, precision)
        if fast:
            t._check_compiles()
        print(json.dumps({"griffin": str(Path(sys.modules["griffin"].__file__).parent)}), flush=True)
        for line in sys.stdin:
            tokens_per_s = rate(t, int(line))
            print(json.dumps({"tokens_per_s": tokens_per_s, "threads": torch.get_num_threads()}), flush=True)


class BaseStep:
    """A step of griffin at another revision (its source tree ``src``), for one case, in a worker."""

    def __init__(self, src: str, case: Case, threads: int, numba_cache: Path, step: str = "reference") -> None:
        env = {**USER_ENV, "PYTHONPATH": src, "NUMBA_CACHE_DIR": str(numba_cache)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", case.name, "--threads", str(threads),
                                      "--base-step", step],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the base revision's worker for {case.name} did not start (its stderr is above)")
        self.griffin = json.loads(ready)["griffin"]
        self.threads = threads

    def rate(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the base revision's worker died (its stderr is above)")
        answer = json.loads(line)
        self.threads = answer["threads"]
        return answer["tokens_per_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(case: Case, root: Path, data: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()  # each case compiles a new model: no cache limit reached (past it dynamo runs eagerly)
    base = (BaseStep(args.base_src, case, args.threads, root / f"numba-{case.name}", args.base_step)
            if args.base else None)
    ref = trainer(case, root / f"{case.name}-ref", data, False, args.threads)
    steps = {"reference": ref, "fast": trainer(case, root / f"{case.name}-fast", data, True, args.threads)}
    if args.bf16:
        steps["fast_bf16"] = trainer(case, root / f"{case.name}-fast-bf16", data, True, args.threads, "bf16")
    start = time.perf_counter()
    steps["fast"]._check_compiles()
    compile_s = time.perf_counter() - start
    if args.bf16:
        steps["fast_bf16"]._check_compiles()
    for t in steps.values():
        rate(t, args.warmup)
    rates: dict[str, list[float]] = {key: [] for key in steps}
    if base is not None:
        base.rate(args.warmup)
        rates["base"] = []
    try:
        for _ in range(args.rounds):
            for key, t in steps.items():
                rates[key].append(rate(t, args.steps))
            if base is not None:
                rates["base"].append(base.rate(args.steps))
    finally:
        if base is not None:
            base.close()
    row: dict[str, Any] = {"case": case.name, "preset": case.preset, "seq_len": case.seq_len,
                           "batch_size": case.batch_size, "task": case.task or "embedded corpus",
                           "parameters": ref.model.num_parameters(), "flops_per_token": ref.flops_per_token,
                           "peak_flops": ref.peak_flops, "peak_source": ref.peak_source, "compile_s": compile_s,
                           "rounds": rates}
    for key, values in rates.items():
        row[f"{key}_tokens_per_s"] = statistics.median(values)
        # against the fp32 peak for every step, the bf16 one too: the same yardstick for all (and the bf16 step's
        # against the bf16 peak below)
        row[f"{key}_mfu"] = row[f"{key}_tokens_per_s"] * ref.flops_per_token / ref.peak_flops
    row["speedup"] = row["fast_tokens_per_s"] / row["reference_tokens_per_s"]
    if args.bf16:
        bf16 = steps["fast_bf16"]  # its trainer's peak: what `griffin train --precision bf16` reports MFU against
        row.update(bf16_speedup=row["fast_bf16_tokens_per_s"] / row["reference_tokens_per_s"],
                   bf16_peak_flops=bf16.peak_flops, bf16_peak_source=bf16.peak_source,
                   fast_bf16_mfu_bf16_peak=row["fast_bf16_tokens_per_s"] * ref.flops_per_token / bf16.peak_flops)
    if base is not None:
        row.update(base_revision=args.base, base_step=args.base_step, base_griffin=base.griffin,
                   base_threads_after=base.threads)
        for key in steps:
            row[f"{key}_over_base"] = row[f"{key}_tokens_per_s"] / row["base_tokens_per_s"]
    if args.profile:
        row["profiles"] = {key: profile_shares(t, args.profile) for key, t in steps.items()}
    return row


def main_job(root: Path, threads: int, bf16: bool, base_src: str | None, steps: int = 0) -> dict[str, Any]:
    """The README's main job (``griffin train``'s defaults on the embedded corpus) trained to the end each way: the
    reference step, the fast one (and in bf16, with ``bf16``), and the base revision's ``griffin train`` (with
    ``base_src``). Each is a ``griffin train`` process timed from outside (imports, data preparation, compilation,
    evaluations, checkpoints and the sample included), after a 2-step run of the same way that warms every cache
    (Inductor's; the base revision's numba kernels, compiled into a cache of its own). ``steps``: a shorter job (0:
    its own 300)."""
    ways = [("reference", [], None), ("fast", ["--compile"], None)]
    ways += [("fast_bf16", ["--compile", "--precision", "bf16"], None)] if bf16 else []
    ways += [("base", [], base_src)] if base_src else []
    length = {True: ["--max-steps", "2", "--eval-interval", "1"], False: ["--max-steps", str(steps)] if steps else []}
    result: dict[str, Any] = {}
    for warm in (True, False):
        for name, flags, src in ways:
            out = root / f"main-{name}{'-warm' if warm else ''}"
            command = [sys.executable, "-m", "griffin.cli", "train", "--out", str(out), "--no-tensorboard",
                       "--threads", str(threads), *flags, *length[warm]]
            env = dict(USER_ENV, **({"PYTHONPATH": src, "NUMBA_CACHE_DIR": str(root / "numba-base")} if src else {}))
            start = time.perf_counter()
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            if not warm:
                end = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()][-1]
                result[name] = {"wall_s": time.perf_counter() - start, "val_loss": end["val_loss"],
                                "steps": end["step"]}
    for name in [w[0] for w in ways[1:]]:
        result[f"{name}_over_reference"] = result["reference"]["wall_s"] / result[name]["wall_s"]
        result[f"{name}_val_loss_difference"] = result[name]["val_loss"] - result["reference"]["val_loss"]
        if base_src and name != "base":
            result[f"{name}_over_base"] = result["base"]["wall_s"] / result[name]["wall_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    known = cases()
    p.add_argument("--cases", nargs="+", choices=sorted(known), default=DEFAULT_CASES, metavar="CASE",
                   help=f"cases to measure ({', '.join(known)}; default: all but the -far ones)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of reference and fast steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each before the rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    p.add_argument("--main-job", action="store_true", help="also train the README's main job to the end each way")
    p.add_argument("--main-job-steps", type=int, default=0, help="a shorter main job (0: its own 300 steps)")
    p.add_argument("--bf16", action="store_true",
                   help="also the fast step under bf16 autocast (a CPU with a bf16 matmul: AVX-512-BF16 or AMX)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N steps of each kind in each case: the shares of the matmuls, griffin's "
                        "kernels, Inductor's kernels and copies (Inductor's kernels then carry profiler markers, "
                        "in the timed rounds too)")
    p.add_argument("--base", metavar="REV", default=None,
                   help="also a step of this git revision of griffin, in a worker process")
    p.add_argument("--base-step", choices=sorted(BASE_STEPS), default="reference",
                   help="the base revision's step: its reference, or its compiled step in fp32 or bf16 (what a "
                        "change of the fast path bought)")
    p.add_argument("--out", default="benchmarks/results/train_small.json", help="JSON result")
    p.add_argument("--worker", metavar="CASE", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # imports griffin from the revision it measures: nothing newer than this file's helpers
        worker(args.worker, args.threads, args.base_step)
        return 0
    if args.main_job_steps < 0:
        p.error(f"--main-job-steps={args.main_job_steps} must be at least 0 (0: the job's own 300 steps)")
    if args.profile < 0:
        p.error(f"--profile={args.profile} must be at least 0")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be at least 1")
    if args.bf16 and not native_bf16(torch.device("cpu")):
        p.error("--bf16: this CPU has no native bf16 matmul (no AVX-512-BF16 or AMX): the compiled bf16 step is "
                "refused here")

    rows, job = [], None
    with contextlib.ExitStack() as stack:
        if args.profile:  # the generated kernels named in the profile
            from torch._inductor import config as inductor_config

            stack.enter_context(inductor_config.patch({"cpp.enable_kernel_profile": True}))
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        root = Path(tmp)
        if args.base:
            args.base = short_rev(args.base)
            args.base_src = str(git_source(args.base, root / "base"))
        data = None
        if "main-job" in args.cases:  # the embedded corpus, prepared once for every trainer
            from griffin.training.trainer import prepare_data

            data = prepare_data(TrainConfig(out=str(root / "prepare"), progress=False), root / "prepare")
        bar = progress(len(args.cases), "cases")
        for name in args.cases:
            rows.append(measure(known[name], root, data, args))
            bar.update(1)
        bar.close()
        if args.main_job:
            job = main_job(root, args.threads, args.bf16, args.base_src if args.base else None, args.main_job_steps)

    print(table(rows, [("case", "case", "s"), ("parameters", "parameters", ",d"),
                       ("reference tok/s", "reference_tokens_per_s", ",.0f"),
                       ("fast tok/s", "fast_tokens_per_s", ",.0f"),
                       ("fast / reference", "speedup", ".2f"), ("reference MFU", "reference_mfu", ".1%"),
                       ("fast MFU", "fast_mfu", ".1%"), ("compile s", "compile_s", ".0f")]
                + ([("fast bf16 tok/s", "fast_bf16_tokens_per_s", ",.0f"), ("bf16 / reference", "bf16_speedup", ".2f"),
                    ("fast bf16 MFU", "fast_bf16_mfu", ".1%"), ("of the bf16 peak", "fast_bf16_mfu_bf16_peak", ".1%")]
                   if args.bf16 else [])
                + ([(f"{args.base}{'' if args.base_step == 'reference' else ' ' + args.base_step} tok/s",
                     "base_tokens_per_s", ",.0f"), ("its threads", "base_threads_after", "d"),
                    ("reference / base", "reference_over_base", ".2f"), ("fast / base", "fast_over_base", ".2f")]
                   + ([("bf16 / base", "fast_bf16_over_base", ".2f")] if args.bf16 else []) if args.base else [])))
    if rows:
        print(f"MFU against {rows[0]['peak_flops'] / 1e9:,.0f} GFLOP/s ({rows[0]['peak_source']})"
              + (f"; the bf16 step's also against the bf16 peak, {rows[0]['bf16_peak_flops'] / 1e9:,.0f} GFLOP/s "
                 f"({rows[0]['bf16_peak_source']})" if args.bf16 else ""))
    for row in rows:
        for key, prof in row.get("profiles", {}).items():
            groups = ", ".join(f"{name} {prof[name]:.1%}" for name in ("matmuls", *GROUPS))
            top = ", ".join(f"{name[:60]} {share:.1%}" for name, share in prof["top"])
            print(f"{row['case']}, {key} step, shares of self CPU time: {groups}; model FLOPs over the matmuls' "
                  f"time {prof['flops_over_matmul_time'] / 1e9:.0f} GFLOP/s; most: {top}")
    if job is not None:
        print(f"main job (griffin train, {job['reference']['steps']} steps, wall time of each process):")
        for name in ("base", "reference", "fast", "fast_bf16"):
            if name in job:
                ratios = ", ".join(f"{job[key]:.2f}x over {over}" for over in ("reference", "base")
                                   if (key := f"{name}_over_{over}") in job)
                print(f"  {name}: {job[name]['wall_s']:.0f} s to validation loss {job[name]['val_loss']:.4f}"
                      + (f" ({ratios})" if ratios else ""))
    write_json(args.out, {"machine": machine_info(torch.device("cpu")), "args": vars(args), "cases": rows,
                            "main_job": job})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
