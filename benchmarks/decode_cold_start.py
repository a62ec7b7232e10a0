"""The first CPU decode of a fresh install: what compiling griffin's numba kernels costs before the first token.

Each weight dtype gets its own new numba cache directory (``NUMBA_CACHE_DIR``) and two fresh processes in turn: the
first compiles every kernel the decode step needs and writes them to the cache (a new install's first ``generate``),
the second loads them from it (every later process); each also times a second ``generate`` in the same process (the
steady state). The two must generate the same tokens. Printed: the seconds of each, and cold / cached.

    python benchmarks/decode_cold_start.py --models griffin-tiny --dtypes float32 bfloat16 int8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, table, write_json  # noqa: E402

# One process: import griffin, build the model, time two `generate` calls; prints one JSON line.
WORKER = """
import json, sys, time
start = time.perf_counter()
import torch
from griffin import CausalLM, ModelConfig
from griffin.inference.generate import generate
from griffin.quantize import quantize_int8
imported = time.perf_counter() - start
preset, dtype, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = CausalLM(ModelConfig.from_preset(preset)).eval()
model = quantize_int8(model.to(torch.bfloat16)) if dtype == "int8" else model.to(getattr(torch, dtype))
times = []
for _ in range(2):
    t = time.perf_counter()
    out = generate(model, [[1, 2, 3]], max_new_tokens=tokens)
    times.append(time.perf_counter() - t)
print(json.dumps({"import_s": imported, "first_s": times[0], "second_s": times[1], "tokens": out[0]}))
"""


def run_worker(preset: str, dtype: str, tokens: int, threads: int, cache: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", WORKER, preset, dtype, str(tokens), str(threads)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"decode_cold_start: the worker for {preset} {dtype} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["griffin-tiny"], help="presets (default: griffin-tiny)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=["float32", "bfloat16", "int8"], help="weight dtypes, each with a new cache")
    parser.add_argument("--tokens", type=int, default=4, help="tokens generated per call (default: 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    parser.add_argument("--out", default="benchmarks/results/decode_cold_start.json")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.threads < 1:
        parser.error(f"--tokens and --threads must be >= 1, got {args.tokens} and {args.threads}")
    rows = []
    for preset in args.models:
        for dtype in args.dtypes:
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
                cold = run_worker(preset, dtype, args.tokens, args.threads, Path(cache))
                cached = run_worker(preset, dtype, args.tokens, args.threads, Path(cache))
                cache_mb = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file()) / 2**20
            if cold["tokens"] != cached["tokens"]:
                raise SystemExit(f"decode_cold_start: {preset} {dtype}: the cached kernels generated "
                                 f"{cached['tokens']}, the freshly compiled ones {cold['tokens']}")
            rows.append({"model": preset, "dtype": dtype, "cold_first_s": cold["first_s"],
                         "cached_first_s": cached["first_s"], "steady_s": cached["second_s"],
                         "import_s": cached["import_s"], "cache_mb": cache_mb,
                         "cold_over_cached": cold["first_s"] / cached["first_s"]})
            print(f"{preset} {dtype}: first generate {cold['first_s']:.1f} s compiling, {cached['first_s']:.2f} s "
                  f"from the cache ({cache_mb:.0f} MB), {cached['second_s']:.3f} s after", flush=True)
    print(table(rows, [("model", "model", "s"), ("dtype", "dtype", "s"),
                       ("first generate, new cache (s)", "cold_first_s", ".1f"),
                       ("first generate, cached (s)", "cached_first_s", ".2f"),
                       ("second generate (s)", "steady_s", ".3f"), ("cache (MB)", "cache_mb", ".0f"),
                       ("cold / cached", "cold_over_cached", ".0f")]))
    write_json(args.out, {"machine": machine_info(torch.device("cpu")), "tokens": args.tokens,
                          "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
