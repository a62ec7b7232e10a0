"""Peak memory and time of the training loss with and without chunking (griffin.ops.cross_entropy).

Forward + backward of the soft-capped cross-entropy over ``--tokens`` hidden states of width ``--width`` and a
``--vocab`` vocabulary (RecurrentGemma's: 256,000), float32, on the CPU: the whole (tokens, vocab) logits at once
(``cross_entropy_ref``, what the trainer does with ``loss_chunk = 0``) against ``chunked_cross_entropy`` at several
chunk sizes. Each case runs in a fresh process and reports its peak resident memory above the inputs' (``ru_maxrss``
after minus before) and its median time.

    python benchmarks/loss_memory.py          # -> benchmarks/results/loss_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from griffin.ops.cross_entropy import chunked_cross_entropy, cross_entropy_ref

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, table, write_json  # noqa: E402


def run_case(tokens: int, width: int, vocab: int, chunk: int, repeats: int) -> dict:
    """One case in this process: peak RSS growth (MiB) and median seconds of forward + backward."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, width, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if chunk:
            loss = chunked_cross_entropy(h, weight, targets, 30.0, chunk)
        else:
            loss = cross_entropy_ref(h, weight, targets, 30.0)
        loss.backward()
        times.append(time.perf_counter() - start)
        h.grad = weight.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunk": chunk, "peak_mib": (peak - before) / 1024, "seconds": sorted(times)[len(times) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256_000)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024, 256], help="0: all logits at once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/loss_memory.json")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    args = p.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(args.tokens, args.width, args.vocab, args.case, args.repeats)))
        return
    rows = []
    for chunk in args.chunks:
        cmd = [sys.executable, __file__, "--case", str(chunk), "--tokens", str(args.tokens), "--width",
               str(args.width), "--vocab", str(args.vocab), "--repeats", str(args.repeats)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        rows[-1]["label"] = f"chunks of {chunk}" if chunk else "all at once"
    whole = rows[0]["peak_mib"] if rows[0]["chunk"] == 0 else float("nan")
    for r in rows:
        r["memory_vs_whole"] = r["peak_mib"] / whole
        r["time_vs_first"] = r["seconds"] / rows[0]["seconds"]
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; {args.tokens} tokens x vocab {args.vocab} "
          f"(float32 logits: {logits_mib:,.0f} MiB), width {args.width}")
    print(table(rows, [("loss", "label", ""), ("peak MiB", "peak_mib", ",.0f"), ("of all-at-once", "memory_vs_whole",
                                                                                 ".3f"),
                       ("seconds", "seconds", ".2f"), ("time ratio", "time_vs_first", ".2f")]))
    write_json(Path(args.out), dict(args=vars(args), logits_mib=logits_mib, rows=rows))


if __name__ == "__main__":
    main()
