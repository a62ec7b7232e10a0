"""The paper's Figure 9b at small scale: Hawk training-step time with each RG-LRU / scan implementation,
relative to the native sequential scan.

The paper compares, on TPU-v3, its Pallas linear-scan kernel, the associative scan and the native Jax scan.
Here, on the same Hawk model and batch (forward + cross-entropy + backward + AdamW step):

    native       gate math in PyTorch + a Python loop over time (rg_lru backend "ref"; Jax's lax.scan analogue)
    associative  gate math in PyTorch + the associative (parallel prefix) scan (scan backend "assoc")
    numba scan   gate math in PyTorch + griffin's numba scan kernel (CPU only; rg_lru "torch", scan "cpu")
    fused        the fused RG-LRU kernel: gates and scan in one pass each way (numba on CPU, Triton on CUDA)

    python benchmarks/hawk_scan_backends.py                          # CPU defaults
    python benchmarks/hawk_scan_backends.py --device cuda --width 1024 --depth 12 --seq-len 2048 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from griffin import CausalLM, ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, median_time, sync  # noqa: E402

# name -> (GRIFFIN_RG_LRU_BACKEND, GRIFFIN_SCAN_BACKEND)
BACKENDS = {
    "native": ("ref", "ref"),
    "associative": ("torch", "assoc"),
    "numba scan": ("torch", "cpu"),
    "fused": (None, None),  # the default: "cpu" (numba) on CPU, "triton" on CUDA
}


def step_time(model: CausalLM, opt: torch.optim.Optimizer, ids: torch.Tensor, repeats: int,
              device: torch.device, dtype: torch.dtype | None) -> float:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(ids[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        sync(device)

    return median_time(step, repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (the default on CUDA)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--out", default="benchmarks/results/hawk_scan_backends.json")
    p.add_argument("--plot", default="docs/figures/hawk_scan_backends.png")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 or device.type == "cuda" else None
    backends = [b for b in args.backends if not (b == "numba scan" and device.type != "cpu")]
    config = ModelConfig(family="hawk", vocab_size=args.vocab, width=args.width, depth=args.depth,
                         rnn_width=args.width * 4 // 3 // 16 * 16, num_heads=max(1, args.width // 128),
                         gate_blocks=16 if args.width >= 256 else 4)
    torch.manual_seed(0)
    model = CausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=device)
    print(f"Hawk: {model.num_parameters():,} parameters, width {args.width}, depth {args.depth}, "
          f"batch {args.batch} x {args.seq_len} tokens, {device}{' bf16' if dtype else ' fp32'}")

    rows = []
    for name in backends:
        rg_lru_backend, scan_backend = BACKENDS[name]
        for var, value in (("GRIFFIN_RG_LRU_BACKEND", rg_lru_backend), ("GRIFFIN_SCAN_BACKEND", scan_backend)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        seconds = step_time(model, opt, ids, args.repeats, device, dtype)
        rows.append({"backend": name, "rg_lru_backend": rg_lru_backend or "default",
                     "scan_backend": scan_backend or "default", "step_s": seconds,
                     "tokens_per_s": args.batch * args.seq_len / seconds})
        print(f"  {name:<12} {seconds * 1e3:9.1f} ms/step")
    for var in ("GRIFFIN_RG_LRU_BACKEND", "GRIFFIN_SCAN_BACKEND"):
        os.environ.pop(var, None)

    base = next((r["step_s"] for r in rows if r["backend"] == "native"), rows[0]["step_s"])
    print(f"\n{'backend':<12} {'ms/step':>9} {'tokens/s':>10} {'time vs native':>15}")
    for r in rows:
        r["relative_to_native"] = r["step_s"] / base
        print(f"{r['backend']:<12} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:10,.0f} {r['relative_to_native']:15.2f}")

    result = {"machine": machine_info(device), "args": vars(args), "parameters": model.num_parameters(),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=120)
        ax.bar([r["backend"] for r in rows], [r["relative_to_native"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_ylabel("step time relative to native")
        ax.set_title(f"Hawk {model.num_parameters() / 1e6:.1f}M, T={args.seq_len}, {device.type}")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot)
        print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
