"""The ``griffin`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from griffin.config import PAPER_SIZES, PRESETS, ModelConfig, count_parameters, nominal_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def preset_table(markdown: bool = False) -> str:
    """Each preset's parameter count beside the paper's nominal size (models built on the meta device)."""
    nominal = {size: size.upper() for size in PAPER_SIZES}
    nominal.update({"synthetic": "~250K", "tiny": "a few K", "2b": "2.7B", "9b": "8.6B"})
    rows = []
    for name, cfg in PRESETS.items():
        size = name.rsplit("-", 1)[1]
        n = count_parameters(cfg)
        rnn = cfg.rnn_width if "recurrent" in cfg.block_types else "-"
        rows.append((name, nominal[size], f"{n:,}", nominal_size(n), cfg.width, rnn, cfg.depth,
                     cfg.num_heads, cfg.head_dim, cfg.attention_window))
    header = ("preset", "nominal", "parameters", "", "D", "D_RNN", "N", "heads", "head dim", "window")
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*map(str, row)) for row in [header, *rows])


def cmd_presets(args: argparse.Namespace) -> int:
    print(preset_table(markdown=args.markdown))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from griffin.checkpoint import export_hf, load_pretrained, save_official

    overrides = {}
    if args.window is not None:
        overrides["attention_window_size"] = args.window
    model = load_pretrained(args.src, dtype=DTYPES[args.dtype] if args.dtype else None, **overrides)
    out = Path(args.dst)
    if args.to == "griffin":
        model.save_pretrained(out)
    elif args.to == "hf":
        export_hf(model, out)
    else:
        save_official(model, out)
    print(f"wrote {args.to} checkpoint of {model.num_parameters():,} parameters to {out}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from griffin.checkpoint import detect_format, load_pretrained

    if args.path in PRESETS:
        cfg = ModelConfig.from_preset(args.path)
        print(f"preset {args.path}: {count_parameters(cfg):,} parameters")
    else:
        print(f"format: {detect_format(args.path)}")
        model = load_pretrained(args.path)
        cfg = model.config
        print(f"parameters: {model.num_parameters():,} ({model.dtype})")
    for key, value in cfg.to_dict().items():
        print(f"  {key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="griffin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list the model presets with their parameter counts")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("convert", help="convert a checkpoint (griffin, HF RecurrentGemma or official .pt)")
    p.add_argument("src", help="checkpoint directory, HF directory or official .pt state dict")
    p.add_argument("dst", help="output directory (griffin, hf) or .pt file (official)")
    p.add_argument("--to", choices=("griffin", "hf", "official"), default="griffin", help="output format")
    p.add_argument("--window", type=int, default=None,
                   help="official checkpoints only: attention_window_size used in training (default 2048)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("info", help="show the config of a preset or a checkpoint")
    p.add_argument("path", help="a preset name or a checkpoint path")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"griffin {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
