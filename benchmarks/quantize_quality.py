"""What weight-only int8 (griffin.quantize, Section 5) costs in quality, against tolerances stated beforehand.

1. **Held-out loss** of a trained checkpoint (default: the README's main job, ``griffin-cpu`` trained on the Python
   standard library, with its prepared data) before and after int8, each variant scored on the same validation
   documents by :func:`griffin.evaluation.loss.evaluate_loss`: per-channel scales, scales per group of inputs (the
   RG-LRU's block-diagonal gates int8 in both, as by default), and per-channel with the gates kept in float
   (``gates=False``: what quantising them costs). Tolerance: the loss rises by at most 1% (relative) with the default
   per-channel int8.
2. **Logits of a random-init large model** (default ``recurrentgemma-2b``'s shape, seeded), float32 weights and
   activations, against int8 weights (float32 activations, so that only the weights differ) and, as a yardstick,
   bfloat16 weights and activations: relative error ``||l' - l|| / ||l||`` over every position's logits and top-1
   agreement over positions. Tolerance: relative error <= 5% and top-1 agreement >= 90% with int8.

The float32 logits are computed first, then the int8 model (sharing the float parameters it keeps) and then the
bfloat16 copy, one at a time, so that the 2.7B shape fits 24 GiB.

    flock /tmp/griffin-bench.lock python benchmarks/quantize_quality.py
    python benchmarks/quantize_quality.py --large griffin-400m --tokens 32     # smaller, quicker
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from griffin import CausalLM, ModelConfig
from griffin.evaluation.documents import load_documents
from griffin.evaluation.loading import load_for_eval
from griffin.evaluation.loss import evaluate_loss
from griffin.quantize import quantize_int8

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, table, write_json  # noqa: E402

LOSS_TOLERANCE = 0.01  # relative rise of the held-out loss allowed for per-channel int8
LOGITS_TOLERANCE = 0.05  # relative error of the large model's logits allowed for int8
TOP1_TOLERANCE = 0.90  # top-1 agreement required for int8


def held_out_loss(args: argparse.Namespace) -> list[dict]:
    """The checkpoint's validation loss in float and in each int8 variant."""
    model, tok = load_for_eval(args.checkpoint)
    docs = list(load_documents(args.data, tok, split="val"))[: args.max_documents]
    variants = {"float": lambda: model, "int8 per-channel": lambda: quantize_int8(model, 0)}
    for g in args.group_sizes:
        variants[f"int8 group {g}"] = lambda g=g: quantize_int8(model, g)
    variants["int8 per-channel, gates in float"] = lambda: quantize_int8(model, 0, gates=False)
    rows = []
    for name, make in variants.items():
        start = time.perf_counter()
        r = evaluate_loss(make(), docs, tok, chunk_size=args.chunk_size, batch_size=args.batch_size)
        rows.append(dict(variant=name, loss=r.mean_loss, bits_per_byte=r.bits_per_byte, tokens=r.tokens,
                         documents=r.documents, seconds=time.perf_counter() - start))
    base = rows[0]["loss"]
    for r in rows:
        r["rise"] = r["loss"] / base - 1
    return rows


@torch.no_grad()
def logits_agreement(args: argparse.Namespace) -> list[dict]:
    """Relative error and top-1 agreement of the large random-init model's logits, int8 and bfloat16 against float32
    (float32 run first and kept; the variants made one at a time)."""
    config = ModelConfig.from_preset(args.large)
    torch.manual_seed(args.seed)
    model = CausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    ref = model(ids).float()

    def compare(name: str, logits: torch.Tensor) -> dict:
        logits = logits.float()
        rel = float((logits - ref).norm() / ref.norm())
        top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        return dict(variant=name, relative_error=rel, top1_agreement=top1, positions=ids.numel())

    rows = [compare("float32 (reference)", ref)]
    q = quantize_int8(model, args.large_group_size)  # float32 activations: only the weights differ
    rows.append(compare(f"int8 {'per-channel' if not args.large_group_size else f'group {args.large_group_size}'}",
                        q(ids)))
    del q
    gc.collect()
    model = model.to(torch.bfloat16)  # the float32 weights are freed
    gc.collect()
    rows.append(compare("bfloat16 weights and activations", model(ids)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/eval15/griffin-cpu/checkpoints/latest",
                   help="a trained griffin checkpoint (default: the README's main job; '' to skip)")
    p.add_argument("--data", default="runs/eval15/griffin-cpu/data", help="its prepared data (val split scored)")
    p.add_argument("--max-documents", type=int, default=None, help="score only the first N validation documents")
    p.add_argument("--group-sizes", type=int, nargs="*", default=[64], help="int8 group sizes also scored")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--large", default="recurrentgemma-2b", help="preset of the random-init model ('' to skip)")
    p.add_argument("--large-group-size", type=int, default=0)
    p.add_argument("--batch", type=int, default=2, help="rows of the large model's input")
    p.add_argument("--tokens", type=int, default=64, help="tokens per row of the large model's input")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/quantize_quality.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    info = machine_info(torch.device("cpu"))
    loss_rows: list[dict] = []
    checks: list[dict] = []
    if args.checkpoint:
        loss_rows = held_out_loss(args)
        print(f"held-out loss of {args.checkpoint} on {args.data} (val: {loss_rows[0]['documents']} documents, "
              f"{loss_rows[0]['tokens']:,} tokens)")
        print(table(loss_rows, [("weights", "variant", ""), ("loss (nats/token)", "loss", ".4f"),
                                ("bits/byte", "bits_per_byte", ".4f"), ("rise", "rise", "+.2%")]))
        checks.append(dict(check=f"held-out loss rise <= {LOSS_TOLERANCE:.0%} (int8 per-channel)",
                           value=loss_rows[1]["rise"], met=loss_rows[1]["rise"] <= LOSS_TOLERANCE))
    logit_rows: list[dict] = []
    if args.large:
        logit_rows = logits_agreement(args)
        print(f"\n{args.large} (random init, seed {args.seed}): logits on {args.batch}x{args.tokens} random tokens "
              "against float32")
        print(table(logit_rows, [("weights", "variant", ""), ("relative error", "relative_error", ".4f"),
                                 ("top-1 agreement", "top1_agreement", ".1%")]))
        int8 = logit_rows[1]
        checks.append(dict(check=f"{args.large} logits relative error <= {LOGITS_TOLERANCE:.0%} (int8)",
                           value=int8["relative_error"], met=int8["relative_error"] <= LOGITS_TOLERANCE))
        checks.append(dict(check=f"{args.large} top-1 agreement >= {TOP1_TOLERANCE:.0%} (int8)",
                           value=int8["top1_agreement"], met=int8["top1_agreement"] >= TOP1_TOLERANCE))
    for c in checks:
        print(f"{c['check']}: {c['value']:.4f} {'met' if c['met'] else 'NOT met'}")
    wall = time.perf_counter() - started
    print(f"wall {wall / 60:.1f} min")
    write_json(args.out, dict(args=vars(args), machine=info, wall_s=wall, held_out_loss=loss_rows,
                              logits=logit_rows, checks=checks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
