"""How OpenMP's idle threads wait, and what it costs a forward pass, training steps and decode steps on CPU.

The griffin command sets ``OMP_WAIT_POLICY=passive`` (:func:`griffin.threads.prefer_passive_openmp_wait`): a worker
thread with nothing to do sleeps at once, so that torch's and numba's workers never spin against each other or
against other processes on a shared host. Waking a sleeping worker costs tens of microseconds per parallel region,
and a decode step at batch 1 runs about 130 of them (a numba kernel per weight-matrix group and per RG-LRU gate), a
compiled training step hundreds (each generated kernel, each matmul). ``GOMP_SPINCOUNT=N`` makes idle workers spin
about N pause instructions first, so that back-to-back regions find them awake. The commands that train (``griffin
train``, ``finetune``, ``synth``) spin torch's workers only, numba's staying passive
(:func:`griffin.threads.prefer_training_openmp_wait`): ``--torch-spins``.

The runtime reads both variables when it loads, so each setting runs in a child process of its own, whose OpenMP
runtimes display the settings they read (``OMP_DISPLAY_ENV=VERBOSE``, recorded as ``runtimes``). For each
setting and each load level (``--loads``: that many busy-looping processes started beside the child, standing in
for other tenants), the child times, on random weights:

- a forward pass of ``hawk-cpu`` over 2 x 1024 tokens, one torch thread (numba's RG-LRU kernel uses both cores);
- a training step (forward, backward, AdamW) of ``hawk-cpu`` on 16 x 256 tokens, ``--threads`` threads;
- the README main job's training step (``griffin-cpu``, 16 x 256 tokens of the embedded corpus, the trainer's
  ``train_step``) compiled (``--compile``), in bf16 where the CPU has a bf16 matmul, else fp32;
- a decode step of ``griffin-cpu`` at batch 4, and of ``--decode-preset`` (default ``griffin-1.3b``) at batch 1 in
  bfloat16 (the ``Decoder``'s matvec path), ``--threads`` threads.

    flock /tmp/griffin-bench.lock python benchmarks/openmp_wait.py
    python benchmarks/openmp_wait.py --spins 0 20000 --loads 0 --decode-preset griffin-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, median_time, progress, table, write_json  # noqa: E402

from griffin.threads import TRAINING_SPINCOUNT  # noqa: E402

PASSIVE = 0  # --spins value meaning griffin's default (passive, no GOMP_SPINCOUNT)
# A child whose torch alone spins: griffin train's setting, made before the benchmark (and torch) is imported
TORCH_ONLY = ("import sys, runpy, griffin.threads; griffin.threads.prefer_training_openmp_wait(int(sys.argv[1])); "
              "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def child(args: argparse.Namespace) -> dict:
    """The timings of one setting, in this process (whose environment already held the setting when torch loaded)."""
    import torch.nn.functional as F

    from griffin import CausalLM, ModelConfig

    torch.manual_seed(0)
    hawk = CausalLM(ModelConfig.from_preset("hawk-cpu"))
    ids = torch.randint(0, hawk.config.vocab_size, (2, 1024))
    torch.set_num_threads(1)
    with torch.no_grad():
        forward = 1e3 * median_time(lambda: hawk(ids), args.repeats)
    torch.set_num_threads(args.threads)
    opt = torch.optim.AdamW(hawk.parameters())
    batch = torch.randint(0, hawk.config.vocab_size, (16, 257))

    def train_step() -> None:
        logits = hawk(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    train = 1e3 * median_time(train_step, args.repeats)
    out = dict(forward_ms=forward, train_step_ms=train, env={k: os.environ.get(k) for k in ("OMP_WAIT_POLICY",
                                                                                          "GOMP_SPINCOUNT")})
    out["compiled_step_ms"], out["compiled_precision"] = compiled_step_ms(args.threads, args.repeats)
    for name, preset, rows, dtype in (("decode_cpu_b4", "griffin-cpu", 4, torch.float32),
                                      ("decode_b1", args.decode_preset, 1, torch.bfloat16)):
        out[f"{name}_ms"] = decode_ms(preset, rows, dtype, 3 * args.repeats)
    return out


def compiled_step_ms(threads: int, repeats: int) -> tuple[float, str]:
    """Median ms of the README main job's compiled training step (bf16 where native, else fp32) and its precision."""
    from griffin.training import TrainConfig, Trainer
    from griffin.training.fast import native_bf16
    from griffin.training.trainer import prepare_data

    precision = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(TrainConfig(out=f"{tmp}/prepare", progress=False), Path(tmp) / "prepare")
        t = Trainer(TrainConfig(data=str(data), out=f"{tmp}/run", progress=False, tensorboard=False, sample_tokens=0,
                                threads=threads, compile=True, precision=precision, eval_interval=10**6))
        t._check_compiles()
        t.train_step()
        return 1e3 * median_time(t.train_step, 3 * repeats), precision


def decode_ms(preset: str, rows: int, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of a decode step of ``preset`` (random weights in ``dtype``) at ``rows`` rows."""
    from griffin import CausalLM, ModelConfig
    from griffin.inference import Decoder, prefill

    model = CausalLM(ModelConfig.from_preset(preset)).eval().to(dtype)
    logits, cache = prefill(model, [[1, 2, 3, 4]] * rows, max_length=4 + repeats + 8)
    decoder = Decoder(model, cache)
    tokens = logits.argmax(-1)
    return 1e3 * median_time(lambda: decoder(tokens), repeats)


def run_setting(spin: int, load: int, args: argparse.Namespace, torch_only: bool = False) -> dict:
    """One child process under ``spin`` (PASSIVE: griffin's default) beside ``load`` busy-looping processes; with
    ``torch_only`` the spin is torch's runtime's alone (griffin train's setting), numba's passive."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if not torch_only:
        env["OMP_WAIT_POLICY"] = "passive"
        if spin != PASSIVE:
            env["GOMP_SPINCOUNT"] = str(spin)
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # each OpenMP runtime the child loads prints the settings it read (stderr)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        head = [sys.executable, "-c", TORCH_ONLY, str(spin)] if torch_only else [sys.executable]
        argv = [*head, __file__, "--child", "--threads", str(args.threads), "--repeats", str(args.repeats),
                "--decode-preset", args.decode_preset]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if done.returncode:
        raise RuntimeError(f"the child for GOMP_SPINCOUNT={spin}, load {load} failed:\n{done.stderr[-3000:]}")
    return dict(spin=spin, load=load, torch_only=torch_only, runtimes=openmp_displays(done.stderr),
                **json.loads(done.stdout.strip().splitlines()[-1]))


def openmp_displays(stderr: str) -> list[dict[str, str]]:
    """The settings each OpenMP runtime of a process displayed (``OMP_DISPLAY_ENV``): name -> value, one per runtime."""
    displays: list[dict[str, str]] = []
    inside = False
    for line in map(str.strip, stderr.splitlines()):
        if line in ("OPENMP DISPLAY ENVIRONMENT BEGIN", "OPENMP DISPLAY ENVIRONMENT END"):
            inside = line.endswith("BEGIN")
            displays += [{}] if inside else []
        elif inside and " = " in line:
            name, value = line.split(" = ", 1)
            displays[-1].setdefault(re.sub(r"^\[\w+\] ", "", name), value.strip("'"))  # (newer: [host] NAME)
    return displays


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spins", nargs="+", type=int, default=[PASSIVE, 20000, 100000],
                   help="GOMP_SPINCOUNT values for both runtimes (0: passive, griffin's default)")
    p.add_argument("--torch-spins", nargs="*", type=int, default=[TRAINING_SPINCOUNT],
                   help="GOMP_SPINCOUNT values for torch's runtime alone, numba's passive (griffin train's setting)")
    p.add_argument("--loads", nargs="+", type=int, default=[0, 2, 6], help="busy-looping processes beside the run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (decode steps: 3x as many), median kept")
    p.add_argument("--decode-preset", default="griffin-1.3b", help="the model decoded at batch 1 in bfloat16")
    p.add_argument("--out", default="benchmarks/results/openmp_wait.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    for v in args.spins + args.torch_spins + args.loads:
        if v < 0:
            raise SystemExit(f"--spins, --torch-spins and --loads take non-negative numbers, got {v}")
    if not args.spins:
        raise SystemExit("--spins: give at least one setting (the first is what the others are compared with)")
    settings = [(spin, False) for spin in args.spins] + [(spin, True) for spin in args.torch_spins if spin]
    started = time.perf_counter()
    rows = []
    bar = progress(len(settings) * len(args.loads), "settings")
    for load in args.loads:
        for spin, torch_only in settings:
            rows.append(run_setting(spin, load, args, torch_only))
            bar.update()
    bar.close()
    for r in rows:
        base = next(o for o in rows if o["load"] == r["load"] and o["spin"] == args.spins[0] and not o["torch_only"])
        r["setting"] = "passive" if r["spin"] == PASSIVE else f"GOMP_SPINCOUNT={r['spin']}"
        r["setting"] += " (torch only)" if r["torch_only"] else ""
        for key in ("forward_ms", "train_step_ms", "compiled_step_ms", "decode_cpu_b4_ms", "decode_b1_ms"):
            r[key.replace("_ms", "_vs_first")] = base[key] / r[key]
    wall = time.perf_counter() - started
    print(f"wall {wall / 60:.1f} min; speed-ups against the first setting at the same load")
    print(table(rows, [("load", "load", "d"), ("setting", "setting", ""),
                       ("hawk-cpu forward ms", "forward_ms", ".0f"), ("x", "forward_vs_first", ".2f"),
                       ("hawk-cpu train step ms", "train_step_ms", ".0f"), ("x", "train_step_vs_first", ".2f"),
                       (f"main job compiled {rows[0]['compiled_precision']} step ms", "compiled_step_ms", ".0f"),
                       ("x", "compiled_step_vs_first", ".2f"),
                       ("griffin-cpu decode b4 ms", "decode_cpu_b4_ms", ".1f"), ("x", "decode_cpu_b4_vs_first", ".2f"),
                       (f"{args.decode_preset} bf16 decode b1 ms", "decode_b1_ms", ".1f"),
                       ("x", "decode_b1_vs_first", ".2f")]))
    write_json(args.out, dict(args=vars(args), machine=machine_info(torch.device("cpu")), wall_s=wall, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
