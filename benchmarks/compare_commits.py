"""Two versions of griffin side by side in one run: the training step and the decode step (eager and compiled).

Each version runs in its own long-lived worker process that imports griffin from that version's source tree (``git
archive`` of ``--base``, and of ``--head`` if given, else the working tree), with a numba cache of its own that starts
empty (a kernel cached from an older version of a file it inlines from would run the older code: numba checks only
the file that defines it). The controller asks the workers for one measurement at a
time, alternating between them round after round, so that load from other processes hits both alike; the median of
the rounds is kept. The models are those of ``benchmarks/model_cpu.py`` (training: HF RecurrentGemma-style Griffin,
batch 4 × 1024 tokens) and of ``benchmarks/inference.py``'s CPU scale (decode: Griffin D = 256, 6 blocks, batch 16,
after a 1024-token prompt), built from the same seed in both versions; the ``decode_1p3b_blocks_*`` measurements decode
with 6 blocks of ``griffin-1.3b`` (bfloat16 or its int8 quantisation, 1 or 8 rows) through the ``Decoder``'s CPU path.

    python benchmarks/compare_commits.py --base ebf75ba            # base commit vs the working tree
    python benchmarks/compare_commits.py --base HEAD~3 --rounds 7 --out benchmarks/results/compare_commits.json
    python benchmarks/compare_commits.py --base 0fee1de --head 30f0f7d   # two commits
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]

# name -> what a worker measures (milliseconds per training step or per decode step)
MEASUREMENTS = {
    "train_w128": dict(kind="train", width=128),
    "train_w512": dict(kind="train", width=512),
    "decode_eager": dict(kind="decode", compile=False),
    "decode_compiled": dict(kind="decode", compile=True),
    # the blocks of griffin-1.3b (its width, recurrent width, MLP and heads; 6 blocks, a vocabulary of 4096 so that
    # the blocks' matmuls dominate), random weights, one token per row after a 16-token prompt
    "decode_1p3b_blocks_bf16_b1": dict(kind="blocks", weights="bfloat16", batch=1),
    "decode_1p3b_blocks_int8_b1": dict(kind="blocks", weights="int8", batch=1),
    "decode_1p3b_blocks_bf16_b8": dict(kind="blocks", weights="bfloat16", batch=8),
    "decode_1p3b_blocks_int8_b8": dict(kind="blocks", weights="int8", batch=8),
}


# Worker ----------------------------------------------------------------------------------------------------------
def worker() -> None:
    """Read one JSON request per line on stdin, answer one JSON line on stdout."""
    import torch
    import torch.nn.functional as F

    import griffin
    from griffin import CausalLM, ModelConfig

    try:  # the API of either version
        from griffin.inference import Decoder, prefill
    except ImportError:
        from griffin.generate import Decoder, prefill

    torch.set_num_threads(int(os.environ.get("COMPARE_THREADS", os.cpu_count() or 1)))
    cache: dict[str, object] = {}

    def train_model(width: int):
        key = f"train{width}"
        if key not in cache:
            heads = max(1, width // 128)
            torch.manual_seed(0)
            cfg = ModelConfig(family="griffin", vocab_size=1024, width=width, depth=3, rnn_width=width,
                              mlp_width=3 * width, num_heads=heads, head_dim=width // heads, attention_window=256,
                              gate_blocks=heads, embed_scale=True, logits_soft_cap=30.0, conv1d_document_reset=False)
            model = CausalLM(cfg).train()
            ids = torch.randint(0, 1024, (4, 1024), generator=torch.Generator().manual_seed(1))
            cache[key] = (model, ids)
        return cache[key]

    def train_step(width: int) -> None:
        model, ids = train_model(width)
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

    def decoder(compile: bool):
        key = f"decoder{compile}"
        if key not in cache:
            torch.manual_seed(0)
            cfg = ModelConfig(family="griffin", vocab_size=4096, width=256, depth=6, num_heads=4, head_dim=64,
                              attention_window=256, gate_blocks=4, embed_scale=True, logits_soft_cap=30.0,
                              conv1d_document_reset=False)
            model = CausalLM(cfg).eval()
            cache[key] = warm_decoder(model, (16, 1024), compile)
        return cache[key]

    def warm_decoder(model: CausalLM, prompt_shape: tuple[int, int], compile: bool = False) -> list:
        """[a Decoder after a prefill of random prompts (rows, tokens) and 3 warm-up steps (and compilation), the
        next tokens]"""
        prompts = torch.randint(0, 4096, prompt_shape, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            logits, kv = prefill(model, prompts, max_length=prompt_shape[1] + 4096)
        dec = Decoder(model, kv, compile=compile)
        tokens = logits.argmax(-1)
        for _ in range(3):
            tokens = dec(tokens).argmax(-1)
        return [dec, tokens]

    def blocks_decoder(weights: str, batch: int):
        key = f"blocks{weights}{batch}"
        if key not in cache:
            from griffin.quantize import quantize_int8

            torch.manual_seed(0)
            model = CausalLM(ModelConfig.from_preset("griffin-1.3b", depth=6, vocab_size=4096)).eval()
            model = model.to(torch.bfloat16)
            model = quantize_int8(model) if weights == "int8" else model
            cache[key] = warm_decoder(model, (batch, 16))
        return cache[key]

    def decode_steps(compile: bool, n: int = 24, entry: list | None = None) -> list[float]:
        entry = entry or decoder(compile)
        dec, tokens = entry
        times = []
        with torch.no_grad():
            for _ in range(n):
                start = time.perf_counter()
                tokens = dec(tokens).argmax(-1)
                tokens.tolist()  # the sampling loop's host sync
                times.append(time.perf_counter() - start)
        entry[1] = tokens
        return times

    print(json.dumps({"ready": griffin.__file__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        spec = MEASUREMENTS[request["name"]]
        if spec["kind"] == "train":
            train_step(spec["width"])  # warm
            times = []
            for _ in range(request.get("repeats", 2)):
                start = time.perf_counter()
                train_step(spec["width"])
                times.append(time.perf_counter() - start)
        elif spec["kind"] == "blocks":
            times = decode_steps(False, 12, blocks_decoder(spec["weights"], spec["batch"]))
        else:
            times = decode_steps(spec["compile"])
        print(json.dumps({"ms": 1e3 * statistics.median(times)}), flush=True)


# Controller ------------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, label: str, src: Path, threads: int, numba_cache: Path) -> None:
        # A numba cache of its own, empty: a kernel cached from an older version of a file it inlines from (numba
        # checks only the file that defines the kernel) would time the older code.
        # Both versions wait as the griffin command makes OpenMP wait (older versions set it on import, newer ones
        # in the command), before torch is imported.
        env = {**os.environ, "PYTHONPATH": str(src), "COMPARE_THREADS": str(threads),
               "NUMBA_CACHE_DIR": str(numba_cache), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive")}
        self.label = label
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
        ready = json.loads(self.proc.stdout.readline())
        print(f"{label}: griffin from {Path(ready['ready']).parent}", flush=True)

    def measure(self, name: str) -> float:
        self.proc.stdin.write(json.dumps({"name": name}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}'s worker died during {name}")
        return json.loads(line)["ms"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the git revision to compare against (required)")
    parser.add_argument("--head", default=None,
                        help="a git revision to compare instead of the working tree (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (the median is kept)")
    parser.add_argument("--only", nargs="+", choices=sorted(MEASUREMENTS), default=list(MEASUREMENTS))
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads per worker")
    parser.add_argument("--out", default="benchmarks/results/compare_commits.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # (imports griffin from the version it measures: the controller's helpers may need a newer one)
        worker()
        return
    if not args.base:
        parser.error("--base is required")
    import torch
    from common import git_source, machine_info, short_rev, table, write_json

    base_rev = short_rev(args.base)
    head_rev = short_rev(args.head or "HEAD")
    head_label = head_rev if args.head else f"{head_rev}+tree"

    with tempfile.TemporaryDirectory(prefix="griffin-compare-") as tmp:
        head_src = git_source(head_rev, Path(tmp) / "head") if args.head else ROOT / "src"
        workers = {"base": Worker(f"base {base_rev}", git_source(base_rev, Path(tmp) / "base"), args.threads,
                                  Path(tmp) / "numba-base"),
                   "head": Worker(f"head {head_label}", head_src, args.threads, Path(tmp) / "numba-head")}
        results: dict[str, dict[str, list[float]]] = {name: {"base": [], "head": []} for name in args.only}
        try:
            for r in range(args.rounds):
                for name in args.only:
                    order = ("base", "head") if r % 2 == 0 else ("head", "base")
                    for side in order:
                        results[name][side].append(workers[side].measure(name))
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {results[n]['base'][-1]:.1f}/{results[n]['head'][-1]:.1f} ms" for n in args.only),
                    flush=True)
        finally:
            for w in workers.values():
                w.close()
    rows = []
    for name in args.only:
        base, head = statistics.median(results[name]["base"]), statistics.median(results[name]["head"])
        rows.append({"measurement": name, "base_ms": base, "head_ms": head, "head_over_base": head / base})
    print(table(rows, [("measurement", "measurement", "s"), (f"{base_rev} ms", "base_ms", ".2f"),
                       (f"{head_label} ms", "head_ms", ".2f"), ("head / base", "head_over_base", ".3f")]))
    write_json(args.out, {"base": base_rev, "head": head_label, "rounds": args.rounds, "rows": rows, "raw": results,
                          "machine": machine_info(torch.device("cpu"))})


if __name__ == "__main__":
    main()
