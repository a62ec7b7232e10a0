"""The ``griffin`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from griffin.config import PAPER_SIZES, PRESETS, ModelConfig, nominal_size
from griffin.model import count_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def preset_table(markdown: bool = False) -> str:
    """Each preset's parameter count beside the paper's nominal size (models built on the meta device)."""
    nominal = {size: size.upper() for size in PAPER_SIZES}
    nominal.update({"cpu": "~1M", "synthetic": "~250K", "tiny": "a few K", "2b": "2.7B", "9b": "8.6B"})
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
    from griffin.interop import export_hf, load_pretrained, save_official, save_pretrained
    from griffin.parallel.checkpoint import is_sharded, load_sharded_model

    overrides = {}
    if args.window is not None:
        overrides["attention_window_size"] = args.window
    dtype = DTYPES[args.dtype] if args.dtype else None
    sharded = is_sharded(args.src)  # a checkpoint of `griffin train` on several devices: gathered into one
    if sharded and overrides:
        raise ValueError("--window applies to official checkpoints only, not to a sharded checkpoint")
    model = load_sharded_model(args.src, dtype) if sharded else load_pretrained(args.src, dtype=dtype, **overrides)
    out = Path(args.dst)
    if args.to == "griffin":
        save_pretrained(model, out)
    elif args.to == "hf":
        export_hf(model, out)
    else:
        save_official(model, out, lossy=args.lossy)
    print(f"wrote {args.to} checkpoint of {model.num_parameters():,} parameters to {out}"
          + (" (gathered from a sharded checkpoint)" if sharded else ""))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from griffin.interop import quantize_checkpoint

    if not args.int8:
        raise ValueError("choose the quantisation: --int8 (weight-only int8, the one there is)")
    model = quantize_checkpoint(args.src, args.dst, args.group_size, DTYPES[args.dtype] if args.dtype else None)
    groups = "one scale per output channel" if args.group_size == 0 else f"one scale per {args.group_size} inputs"
    print(f"wrote {args.dst}: int8 weights, {groups}; activations in {model.dtype}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from griffin.interop import detect_format, load_pretrained

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


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        text = Path(args.prompt_file).read_text(encoding="utf-8")
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a prompt with --prompt TEXT or --prompt-file FILE (one prompt per line)")
    return prompts


def _printable(text: str, final: bool) -> str:
    """Text for the terminal: undecodable bytes (surrogate escapes) become U+FFFD, except trailing ones while
    streaming, which may be the start of a character still being generated."""
    if not final:
        text = text.rstrip("".join(map(chr, range(0xDC80, 0xDD00))))
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _tokenizer_spec(spec: str, checkpoint: str) -> str:
    """'auto': the tokenizer stored beside the checkpoint (``griffin train`` copies it there), else bytes."""
    if spec != "auto":
        return spec
    directory = Path(checkpoint)
    found = [directory / n for n in ("tokenizer.json", "tokenizer.model") if (directory / n).is_file()]
    return str(found[0]) if found else "bytes"


def cmd_generate(args: argparse.Namespace) -> int:
    from griffin.cache import Cache
    from griffin.data.tokenizer import load_tokenizer
    from griffin.inference.generate import check_sampling, decode_stream, prefill
    from griffin.interop import load_pretrained
    from griffin.quantize import quantization_of, quantize_int8

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompts = _read_prompts(args)
    tokenizer = load_tokenizer(_tokenizer_spec(args.tokenizer, args.checkpoint))
    model = load_pretrained(args.checkpoint, dtype=DTYPES[args.dtype] if args.dtype else None)
    if args.quantize == "int8" and quantization_of(model) is None:  # an int8 checkpoint is used as it is
        model = quantize_int8(model, args.group_size, inplace=True)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}")
    cache = Cache.load(args.load_state, model.config, model.device) if args.load_state else None
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None and not args.no_bos and cache is None else []
    rows = [bos + tokenizer.encode(p) for p in prompts]
    if cache is not None and len(rows) > 1:
        cache = cache.fork(len(rows))
    if args.save_state and len(rows) > 1:
        raise ValueError("--save-state needs a single prompt")
    max_length = None if cache is not None else max(map(len, rows)) + args.max_new_tokens
    logits, cache = prefill(model, rows, cache, max_length, args.chunk_size)
    if args.save_state:
        cache.save(args.save_state)
        print(f"saved the state after {cache.length} tokens to {args.save_state}", file=sys.stderr)
    stops = list(args.stop_token or [])
    if tokenizer.eos_id is not None and not args.no_stop_at_eos:
        stops.append(tokenizer.eos_id)
    out: list[list[int]] = [[] for _ in rows]
    stream = len(rows) == 1
    if stream:
        print(prompts[0], end="", flush=True)
    shown = ""
    steps = decode_stream(model, logits, cache, args.max_new_tokens,
                          args.temperature, args.top_k, args.top_p, args.seed, stops, compile=args.compile)
    for step in steps:
        for i, token in enumerate(step):
            if token is not None:
                out[i].append(token)
        if stream:
            text = _printable(tokenizer.decode(out[0]), final=False)
            print(text[len(shown):] if text.startswith(shown) else text, end="", flush=True)
            shown = text
    if stream:
        text = _printable(tokenizer.decode(out[0]), final=True)
        print(text[len(shown):] if text.startswith(shown) else text)
    else:
        for prompt, ids in zip(prompts, out, strict=True):
            print(prompt + _printable(tokenizer.decode(ids), final=True))
            print("-" * 40)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from griffin.training import TrainConfig, train
    from griffin.training.config import parse_model_override

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if f.name != "model" and getattr(args, f.name, None) is not None}
    model = dict(parse_model_override(item) for item in args.model or [])
    if args.config:
        cfg = TrainConfig.from_toml(args.config, **overrides, model=model)
    else:
        cfg = TrainConfig(**overrides, model=model)
    result = train(cfg)
    print(f"\ntrained {result.step} steps: validation loss {result.val_loss:.4f} nats/token "
          f"(best {result.best_val_loss:.4f}; unigram baseline {result.unigram_loss:.4f})")
    print(f"checkpoint: {result.checkpoint}   logs: {result.out / 'log.jsonl'}   plot: {result.out / 'loss.png'}")
    if result.sample:
        print(f"sample:\n{_printable(result.sample, final=True)}")
    return 0


def _add_train_options(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, its help taken from the field; unset flags leave the config file's value."""
    import dataclasses

    from griffin.training import TrainConfig
    from griffin.training.config import field_types

    defaults = TrainConfig()
    hints = field_types()
    p.add_argument("--config", metavar="TOML", help="a training config file (see configs/); flags override it")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.name == "model":
            p.add_argument(flag, action="append", metavar="KEY=VALUE", help=help_text + " (repeatable)")
        elif f.name == "resume":
            p.add_argument(flag, nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                           help=help_text + " (the flag alone means 'auto')")
        elif hints[f.name] is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{help_text} (default: {getattr(defaults, f.name)})")
        else:
            p.add_argument(flag, type=hints[f.name], default=None, choices=f.metadata.get("choices"),
                           metavar=None if f.metadata.get("choices") else f.name.upper(),
                           help=f"{help_text} (default: {getattr(defaults, f.name)!r})")


def cmd_prepare(args: argparse.Namespace) -> int:
    from griffin.data import prepare

    meta = prepare(args.inputs or None, args.out, args.tokenizer, val_fraction=args.val_fraction, seed=args.seed,
                   text_field=args.text_field, shard_tokens=args.shard_tokens, dtype=args.dtype)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['tokens']:,} tokens in {info['documents']:,} documents")
    print(f"wrote {args.out} (vocabulary {meta['vocab_size']}, {meta['dtype']})")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from griffin.data.tokenizer import load_tokenizer, train_bpe

    path = train_bpe(args.inputs, args.out, args.vocab_size, text_field=args.text_field)
    print(f"wrote {path}: {load_tokenizer(path).vocab_size} tokens")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from griffin.serve.options import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="griffin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list the model presets with their parameter counts")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("convert", help="convert a checkpoint (griffin, sharded, HF RecurrentGemma or official .pt)")
    p.add_argument("src", help="checkpoint directory (griffin, or sharded: written by `griffin train` on several "
                   "devices), HF directory or official .pt state dict")
    p.add_argument("dst", help="output directory (griffin, hf) or .pt file (official)")
    p.add_argument("--to", choices=("griffin", "hf", "official"), default="griffin", help="output format")
    p.add_argument("--window", type=int, default=None,
                   help="official checkpoints only: attention_window_size used in training (default: the value in "
                        "the .json beside the .pt if any, else 2048)")
    p.add_argument("--lossy", action="store_true",
                   help="write a format that cannot express the model anyway (with a warning); otherwise refused")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("quantize", help="write a checkpoint with weight-only int8 weights (faster CPU decoding)")
    p.add_argument("src", help="a float checkpoint (griffin, HF RecurrentGemma or official)")
    p.add_argument("dst", help="output directory (griffin format: int8 weights and their float32 scales)")
    p.add_argument("--int8", action="store_true", help="weight-only int8: linear layers, embedding and output layer")
    p.add_argument("--group-size", type=int, default=0,
                   help="inputs sharing one scale: 0 (default) for one scale per output channel, or a multiple of "
                        "8 dividing every layer's input width (e.g. 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of what stays in float (activations, norms, RG-LRU, biases); default: as stored")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint", help="a griffin, HF RecurrentGemma or official checkpoint")
    p.add_argument("--tokenizer", default="auto",
                   help="'bytes' (byte-level), a tokenizer.json, a SentencePiece .model, or a directory holding one; "
                        "'auto': the checkpoint directory's tokenizer if it holds one, else bytes")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 samples greedily")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop-token", type=int, action="append", help="stop a row after this token id (repeatable)")
    p.add_argument("--no-stop-at-eos", action="store_true", help="do not stop at the tokenizer's EOS token")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token")
    p.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk length (bounds memory)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    p.add_argument("--save-state", help="save the model state after the prompt to this file (a snapshot)")
    p.add_argument("--load-state", help="continue from a saved state instead of an empty context")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (CUDA graphs on GPU): faster per token, after a one-time "
                        "compilation; for long generations")
    p.add_argument("--quantize", choices=("int8",), default=None,
                   help="decode with weight-only int8 weights, quantised on loading (CPU; an int8 checkpoint from "
                        "`griffin quantize` needs no flag)")
    p.add_argument("--group-size", type=int, default=0,
                   help="with --quantize: inputs per int8 scale (0: one scale per output channel)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train", help="train a model (Section 3); with no options, a small Griffin on the "
                       "Python standard library's source, on CPU, in a few minutes",
                       description="Train Hawk, Griffin or the MQA baseline. Every option below is also a key of "
                       "the TOML config file (--config); flags override the file, the file overrides the defaults.")
    _add_train_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenize text, JSONL or parquet files into memory-mapped shards")
    p.add_argument("inputs", nargs="*", help="files or directories (none: the Python standard library's source)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json or a SentencePiece .model")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument("--text-field", default="text", help="the text field of JSONL records and parquet tables")
    p.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="token dtype (default: uint16 if the vocabulary fits, else uint32)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (HF tokenizers) on local files")
    p.add_argument("inputs", nargs="+", help="text, JSONL or parquet files or directories")
    p.add_argument("--out", required=True, help="output tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size")
    p.add_argument("--text-field", default="text", help="the text field of JSONL records and parquet tables")
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("info", help="show the config of a preset or a checkpoint")
    p.add_argument("path", help="a preset name or a checkpoint path")
    p.set_defaults(func=cmd_info)

    from griffin.serve.options import add_serve_arguments

    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API, with continuous "
                       "batching and prefix-state caching (docs/serving.md)")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    from griffin.synth.cli import add_synth_parser  # griffin synth TASK | eval DIR | compare TASK (Section 6.2)

    add_synth_parser(sub)

    from griffin.evaluation.commands import add_eval_parser

    add_eval_parser(sub)

    from griffin.parallel.commands import add_plan_parser  # griffin plan PRESET --gpus N --gpu h100 (Section 4.1)

    add_plan_parser(sub)
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
