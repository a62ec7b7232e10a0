"""Training-step speed of a small Griffin on CPU: griffin vs HF transformers' RecurrentGemma, same weights.

A training step is forward + cross-entropy + backward. Both models are the same RecurrentGemma-style Griffin
(recurrent, recurrent, local attention), built by HF and loaded into griffin through its HF importer, so they
compute the same function (checked in the run). Prints a table and writes JSON.

    python benchmarks/model_cpu.py                       # default sizes
    python benchmarks/model_cpu.py --widths 128 --seq 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, median_time  # noqa: E402


def train_step(model: torch.nn.Module, ids: torch.Tensor, logits_of) -> None:
    """Forward, next-token cross-entropy, backward."""
    model.zero_grad(set_to_none=True)
    logits = logits_of(model, ids)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()


def make_models(width: int, depth: int, vocab: int, window: int):
    import transformers

    from griffin import load_pretrained

    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=6 * width, num_hidden_layers=depth,
        num_attention_heads=max(1, width // 128), num_key_value_heads=1, lru_width=width,
        attention_window_size=window, block_types=["recurrent", "recurrent", "attention"],
    )
    torch.manual_seed(0)
    hf = transformers.RecurrentGemmaForCausalLM(cfg).train()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_pretrained(tmp).train()
    return hf, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/model_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    rows = []
    for width in args.widths:
        hf, ours = make_models(width, args.depth, args.vocab, args.window)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        with torch.no_grad():
            diff = (hf(ids, use_cache=False).logits - ours(ids)).abs().max().item()

        t_ours = median_time(partial(train_step, ours, ids, lambda m, x: m(x)), args.repeats)
        t_hf = median_time(partial(train_step, hf, ids, lambda m, x: m(x, use_cache=False).logits), args.repeats)
        tokens = args.batch * args.seq
        rows.append(dict(width=width, depth=args.depth, params=ours.num_parameters(), batch=args.batch,
                         seq=args.seq, max_logit_diff=diff, griffin_s=t_ours, hf_s=t_hf,
                         griffin_tok_s=tokens / t_ours, hf_tok_s=tokens / t_hf, speedup=t_hf / t_ours))

    print(f"\nTraining step (forward + backward), B={args.batch}, T={args.seq}, depth {args.depth}, "
          f"{torch.get_num_threads()} threads, {cpu_name()}")
    print(f"{'width':>6} {'params':>10} {'griffin tok/s':>14} {'HF tok/s':>10} {'speed-up':>9} {'max |dlogit|':>13}")
    for r in rows:
        print(f"{r['width']:>6} {r['params']:>10,} {r['griffin_tok_s']:>14,.0f} {r['hf_tok_s']:>10,.0f} "
              f"{r['speedup']:>8.1f}x {r['max_logit_diff']:>13.1e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__,
                                   rows=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
