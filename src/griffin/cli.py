"""The ``griffin`` command line, and its error policy.

Exit status: 0 done; 2 a user error (a bad value, a missing, malformed or busy file or directory, a run that cannot
go on; argparse's usage errors too), printed as one line ``griffin CMD: error: MESSAGE`` naming the value or file;
130 interrupted (the first Ctrl-C says how to resume, a second one stops at once); 141 the output pipe was closed
(``griffin presets | head -1``), silently; 143 ``griffin train`` stopped by SIGTERM (a cluster's notice before
preemption: SLURM, Kubernetes) at its next step boundary, once the checkpoint of that step was written, with one line
saying how to resume. Anything else is a bug and shows its traceback (exit 1). ``--debug`` shows
the traceback of every error.

This module imports neither torch nor the model at its top: :func:`main` makes the process's OpenMP setting
(:func:`griffin.threads.prefer_passive_openmp_wait`, or for the commands that train
:func:`griffin.threads.prefer_training_openmp_wait`) before anything loads torch.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from griffin.arguments import renamed
from griffin.heap import keep_freed_memory
from griffin.threads import prefer_passive_openmp_wait, prefer_training_openmp_wait

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: `griffin train` stopped by SIGTERM, after writing a checkpoint
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `yes | head -1`


def preset_table(markdown: bool = False) -> str:
    """Each preset's parameter count beside the paper's nominal size (models built on the meta device)."""
    from griffin.config import PAPER_SIZES, PRESETS, nominal_size
    from griffin.model import count_parameters

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
    from griffin.interop import DTYPES, detect_format, export_hf, load_pretrained, save_official, save_pretrained
    from griffin.parallel.checkpoint import is_sharded, load_sharded_model

    overrides = {}
    if args.window is not None:
        if args.window <= 0:
            raise ValueError(f"--window {args.window} must be a positive number of tokens")
        overrides["attention_window_size"] = args.window
    if args.lossy and args.to != "official":
        raise ValueError(f"--lossy applies to --to official only, not --to {args.to} (which writes exactly the "
                         "model or refuses, saying why)")
    dtype = DTYPES[args.dtype] if args.dtype else None
    sharded = is_sharded(args.src)  # a checkpoint of `griffin train` on several devices: gathered into one
    if sharded and overrides:
        raise ValueError("--window applies to official checkpoints only, not to a sharded checkpoint")
    if overrides and not sharded and detect_format(args.src) != "official":
        raise ValueError(f"--window applies to official checkpoints only, not to {args.src} "
                         f"({detect_format(args.src)} format: its config holds the window)")
    model = load_sharded_model(args.src, dtype) if sharded else load_pretrained(args.src, dtype=dtype, **overrides)
    out = Path(args.dst)
    if args.to == "griffin":
        save_pretrained(model, out, overwrite=args.overwrite)
    elif args.to == "hf":
        export_hf(model, out, overwrite=args.overwrite)
    else:
        save_official(model, out, lossy=args.lossy, overwrite=args.overwrite)
    print(f"wrote {args.to} checkpoint of {model.num_parameters():,} parameters to {out}"
          + (" (gathered from a sharded checkpoint)" if sharded else ""))
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    import shutil

    from griffin.data.tokenizer import tokenizer_file
    from griffin.interop import DTYPES, adapter_base, export_hf, load_pretrained, save_pretrained
    from griffin.io import check_new_output

    base = args.base or adapter_base(args.adapter)
    if not base:
        raise ValueError(f"{args.adapter} does not name its base model: pass --base CHECKPOINT")
    check_new_output(args.dst, args.overwrite)
    model = load_pretrained(base, dtype=DTYPES[args.dtype] if args.dtype else None, adapter=args.adapter)
    out = Path(args.dst)
    if args.to == "hf":
        export_hf(model, out, overwrite=True)
    else:
        save_pretrained(model, out)
    copied = []
    sources = (Path(args.adapter), Path(base) if Path(base).is_dir() else Path(base).parent)
    for source in sources:  # the tokenizer beside the adapter, else the base's; its config and chat template with it
        found = tokenizer_file(source)
        if found is not None:
            for name in (found.name, "tokenizer_config.json", "special_tokens_map.json"):
                if (source / name).is_file():
                    shutil.copyfile(source / name, out / name)
                    copied.append(name)
            break
    template = next((s / "chat_template.jinja" for s in sources if (s / "chat_template.jinja").is_file()), None)
    if template is not None:  # the template the adapter was trained with, else the base's
        shutil.copyfile(template, out / template.name)
        copied.append(template.name)
    print(f"wrote {args.to} checkpoint {out}: {base} with the adapter {args.adapter} merged"
          + (f" (and {', '.join(copied)})" if copied else ""))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from griffin.interop import DTYPES, quantize_checkpoint

    if not args.int8:
        raise ValueError("choose the quantisation: --int8 (weight-only int8, the one there is)")
    model = quantize_checkpoint(args.src, args.dst, args.group_size, DTYPES[args.dtype] if args.dtype else None,
                                gates=not args.float_gates, overwrite=args.overwrite)
    groups = "one scale per output channel" if args.group_size == 0 else f"one scale per {args.group_size} inputs"
    gates = "RG-LRU gates in float" if args.float_gates else "RG-LRU gates int8"
    print(f"wrote {args.dst}: int8 weights, {groups}; {gates}; activations in {model.dtype}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from griffin.config import PRESETS, ModelConfig
    from griffin.interop import detect_format, load_pretrained
    from griffin.model import count_parameters
    from griffin.quantize import quantization_of

    if args.path in PRESETS:
        cfg = ModelConfig.from_preset(args.path)
        print(f"preset {args.path}: {count_parameters(cfg):,} parameters")
    else:
        close = difflib.get_close_matches(args.path, PRESETS, n=3)
        if close and not Path(args.path).exists():
            raise ValueError(f"no preset or checkpoint named {args.path!r}; did you mean {' or '.join(close)}?")
        path = Path(args.path)
        if path.is_dir() and not (path / "config.json").exists() and (path / "checkpoints").is_dir():
            best = path / "checkpoints" / "best"
            hint = f"; its best checkpoint: griffin info {best}" if best.exists() else ""
            raise ValueError(f"{path} is a training run, not a checkpoint{hint}")
        fmt = detect_format(args.path)
        print(f"format: {fmt}")
        if fmt == "adapter":
            from griffin.interop.adapters import adapter_summary

            for key, value in adapter_summary(args.path).items():
                print(f"  {key}: {value}")
            print("the base model with the adapter merged:")
        model = load_pretrained(args.path)
        cfg = model.config
        quantized = quantization_of(model)
        weights = str(model.dtype).removeprefix("torch.")
        if quantized:
            g = quantized["group_size"]
            weights = (f"{quantized['method']} weights, one scale per "
                       f"{'output channel' if g == 0 else f'{g} inputs'}; the rest {weights}")
        print(f"parameters: {model.num_parameters():,} ({weights})")
    for key, value in cfg.to_dict().items():
        print(f"  {key}: {value}")
    return 0


def _read_text(flag: str, path: str) -> str:
    """The text of a prompt file; an error that names the flag."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a text file")
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    prompts += [_read_text("--prompt-file", path) for path in args.prompt_file or []]
    if args.prompt_lines:
        prompts += [line for line in _read_text("--prompt-lines", args.prompt_lines).splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT, --prompt-file FILE (the file is one prompt) or "
                         "--prompt-lines FILE (one prompt per line)")
    return prompts


def _printable(text: str, final: bool) -> str:
    """Text for the terminal: undecodable bytes (surrogate escapes) become U+FFFD, except trailing ones while
    streaming, which may be the start of a character still being generated."""
    if not final:
        text = text.rstrip("".join(map(chr, range(0xDC80, 0xDD00))))
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def cmd_generate(args: argparse.Namespace) -> int:
    from griffin.data.tokenizer import encode_prompts
    from griffin.inference.generate import check_sampling, decode_stream
    from griffin.inference.state import prefill_with_state
    from griffin.loading import load_for_use

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompts = _read_prompts(args)
    loaded = load_for_use(args.checkpoint, tokenizer=args.tokenizer, dtype=args.dtype, quantize=args.quantize,
                          group_size=args.group_size, device=args.device, adapter=args.adapter)
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = encode_prompts(tokenizer, prompts, bos=not args.no_bos and not args.load_state)
    logits, cache = prefill_with_state(model, rows, args.max_new_tokens, load_state=args.load_state,
                                       save_state=args.save_state, chunk_size=args.chunk_size)
    if args.save_state:
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

    from griffin.training import StopRequest, TrainConfig, TrainingStopped, train
    from griffin.training.config import merge_settings, parse_model_override, read_toml

    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name != "model" and getattr(args, f.name, None) is not None}
    flags["model"] = dict(parse_model_override(item) for item in getattr(args, "model", None) or [])
    source = args.config or "the command line"
    given = merge_settings(read_toml(args.config), flags) if args.config else flags
    if args.command == "finetune":  # griffin train from the checkpoint, with fine-tuning's defaults
        from griffin.training.trainer import resume_checkpoint

        given = {"out": FINETUNE_DEFAULTS["out"], **given, "init": str(Path(args.checkpoint).absolute())}
        if not given["model"]:  # (a config file's [model] table is refused with --init)
            given.pop("model")
        if not (given.get("resume") and resume_checkpoint(given["out"], given["resume"])):  # else the run's own
            given = {**finetune_defaults(given), **given}
            if not given.get("data") and given.get("resume") != "auto":  # (--resume: its own error, naming OUT)
                raise ValueError("give the examples to fine-tune on: --data FILE.jsonl (chats, prompt/completion "
                                 "pairs or texts; docs/finetuning.md), or a dataset from `griffin prepare`")
    cfg = resumed_config(given) if given.get("resume") else TrainConfig.from_dict(given, source=source)
    args.interrupt_hint = lambda: _resume_hint(cfg.out)
    # SIGTERM (SLURM's or Kubernetes' notice before preemption): stop at the next step with its checkpoint written
    with StopRequest.on_signal(signal.SIGTERM) as stop:
        try:
            result = train(cfg, stop=stop)
        except TrainingStopped as stopped:
            print(f"griffin train: stopped by {stopped.reason} after step {stopped.step}; "
                  f"{_resume_hint(cfg.out, stopped.checkpoint)}", file=sys.stderr)
            return EXIT_TERMINATED
    print(f"\ntrained {result.step} steps: validation loss {result.val_loss:.4f} nats/token "
          f"(best {result.best_val_loss:.4f}; unigram baseline {result.unigram_loss:.4f})")
    print(f"checkpoint: {result.checkpoint}   logs: {result.out / 'log.jsonl'}   plot: {result.out / 'loss.png'}")
    if result.sample:
        print(f"sample:\n{_printable(result.sample, final=True)}")
    return 0


#: ``griffin finetune``'s defaults where they differ from ``griffin train``'s: LoRA of rank 16 at a learning rate of
#: 2e-4 (2e-5 for a full fine-tune, ``--lora-rank 0``), no weight decay, short warm-up, frequent evaluations.
FINETUNE_DEFAULTS = {"lora_rank": 16, "lr": 2e-4, "warmup_steps": 10, "max_steps": 200, "weight_decay": 0.0,
                     "val_fraction": 0.05, "seq_len": 512, "batch_size": 8, "eval_interval": 25, "ckpt_interval": 50,
                     "log_interval": 5, "out": "runs/finetune"}


def finetune_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The defaults of ``griffin finetune`` for the settings ``given``."""
    defaults = dict(FINETUNE_DEFAULTS)
    if given.get("lora_rank") == 0:
        defaults["lr"] = 2e-5
    return defaults


def resumed_config(given: dict[str, Any]):
    """``griffin train --resume``: the run's saved settings (from the checkpoint it resumes) with those ``given``
    again on top, which must agree where they define the run (:meth:`TrainConfig.resuming`). ``--resume`` (``auto``)
    with no checkpoint in OUT is a ValueError naming OUT (a mistyped ``--out`` would train from scratch);
    ``--resume if-any`` then starts a new run from ``given`` (a requeued cluster job running the same command)."""
    from griffin.training import TrainConfig
    from griffin.training.trainer import RESUME_NEWEST, resume_checkpoint, saved_run_config

    out = given.get("out", TrainConfig.__dataclass_fields__["out"].default)
    path = resume_checkpoint(out, given["resume"])
    if path is None:
        if given["resume"] == "auto":
            raise ValueError(f"--resume: no checkpoint to resume in {out} (nothing in "
                             f"{Path(out) / 'checkpoints'}); check --out, leave --resume out to start a new run, or "
                             "use --resume if-any to resume when there is a checkpoint and start a new run otherwise")
        return TrainConfig.from_dict(given, source="the command line")
    saved, model = saved_run_config(path)
    if given["resume"] in RESUME_NEWEST:
        given = {**given, "out": out}
    return TrainConfig.resuming(saved, given, model, source=str(path))


def _resume_hint(out: str, checkpoint: Path | None = None) -> str:
    """What a stopped ``griffin train`` says: how to continue from its newest checkpoint, if it wrote one
    (``checkpoint``: the one it stopped at, named with the command that continues from it)."""
    from griffin.training.checkpoint import list_checkpoints

    if checkpoint is not None:
        command = f"griffin train --out {shlex.quote(str(out))} --resume"
        if Path(checkpoint).resolve().parent != (Path(out) / "checkpoints").resolve():
            command += f" {shlex.quote(str(checkpoint))}"  # resumed from elsewhere, stopped before its first step
        return f"checkpoint: {checkpoint}; continue with: {command}"
    done = list_checkpoints(Path(out) / "checkpoints")
    if not done:
        return "no checkpoint was written yet; run the same command to start again"
    return (f"the checkpoints in {out}/checkpoints are kept (newest: {done[-1].name}); continue the run with its "
            f"own settings: griffin train --out {shlex.quote(str(out))} --resume")


def _overwrite_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (otherwise refused)")


def _default_note(value: Any) -> str:
    """`` (default: VALUE)`` as the help formatter writes it, or nothing for an empty default."""
    return f" (default: {value})" if value != "" else ""


def _add_train_options(p: argparse.ArgumentParser, changed: dict[str, Any] | None = None,
                       skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field (but ``skip``), its help taken from the field, its default from ``changed`` or
    the field's; unset flags leave the config file's value."""
    import dataclasses

    from griffin.training import TrainConfig
    from griffin.training.config import field_types

    defaults = TrainConfig()
    for key, value in (changed or {}).items():
        setattr(defaults, key, value)
    hints = field_types()
    p.add_argument("--config", metavar="TOML", help="a training config file (see configs/); flags override it; "
                   "with --resume, the run's saved settings replace it and what it sets must agree with them")
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.name == "model":
            p.add_argument(flag, action="append", metavar="KEY=VALUE", help=help_text + " (repeatable)")
        elif f.name == "resume":
            p.add_argument(flag, nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                           help=help_text + " (the flag alone means 'auto'); the run's saved settings are reused: "
                           "flags given again must agree with them, except steps, device, layout and logging")
        elif hints[f.name] is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text + _default_note(getattr(defaults, f.name)))
        else:
            p.add_argument(flag, type=hints[f.name], default=None, choices=f.metadata.get("choices"),
                           metavar=None if f.metadata.get("choices") else f.name.upper(),
                           help=help_text + _default_note(getattr(defaults, f.name)))


def cmd_prepare(args: argparse.Namespace) -> int:
    from griffin.data import prepare

    meta = prepare(args.inputs or None, args.out, args.tokenizer, val_fraction=args.val_fraction, seed=args.seed,
                   text_field=args.text_field, shard_tokens=args.shard_tokens, dtype=args.dtype,
                   overwrite=args.overwrite)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['tokens']:,} tokens in {info['documents']:,} documents")
    print(f"wrote {args.out} (vocabulary {meta['vocab_size']}, {meta['dtype']})")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from griffin.data.tokenizer import load_tokenizer, train_bpe

    path = train_bpe(args.inputs, Path(args.out) / "tokenizer.json", args.vocab_size, text_field=args.text_field,
                     overwrite=args.overwrite)
    print(f"wrote {path}: {load_tokenizer(path).vocab_size} tokens")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from griffin.serve.options import config_from_args

    try:
        from griffin.serve.server import run
    except ImportError as err:
        raise ValueError(f"griffin serve needs the 'serve' extra ({err}): pip install -e '.[serve]'") from err
    run(config_from_args(args))
    return 0


# The parser: help that explains itself ------------------------------------------------------------------------
def _plain(text: str) -> str:
    """Help text without reStructuredText markup: ``:func:`x``` and ````x```` become `x`."""
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where they say something, markup removed, and paragraphs with indented or bulleted lines
    (examples, lists) kept as written while the others are re-wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n[ \t]*\n", _plain(text).strip("\n")):
            lines = para.splitlines()
            if any(line.startswith((" ", "- ", "* ")) for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(argparse.HelpFormatter._fill_text(self, para, width, indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = _plain(action.help or "")
        if ("default" in text.lower() or action.default in (None, False, argparse.SUPPRESS)
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return text
        return text + " (default: %(default)s)"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


class _SubCommands(argparse._SubParsersAction):
    """Sub-commands, wherever they are added (here or by another package's hook), get the help formatter, a
    description (their help as a sentence unless they bring one), examples where :data:`EXAMPLES` has them, and
    ``--debug``."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if kwargs.get("help") and not kwargs.get("description"):
            kwargs["description"] = _sentence(kwargs["help"])
        if name in EXAMPLES and self.dest == "command":
            kwargs.setdefault("epilog", "examples:\n" + EXAMPLES[name])
        parser = super().add_parser(name, **kwargs)
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                            help="show the traceback of an error (also before the command: griffin --debug CMD)")
        return parser


class GriffinParser(argparse.ArgumentParser):
    """An ArgumentParser that suggests the closest names for a mistyped choice (difflib) and takes options only by
    their full names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `train --batch` is no `--batch-size`
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs: Any):
        kwargs.setdefault("action", _SubCommands)
        return super().add_subparsers(**kwargs)

    def error(self, message: str):
        match = re.search(r"invalid choice: '?(.*?)'? \(choose from", message)
        if match:
            named = [a for a in self._actions if a.choices and f"argument {argparse._get_action_name(a)}:" in message]
            names = [str(c) for a in named or self._actions if a.choices for c in a.choices]
            close = difflib.get_close_matches(match.group(1), names, n=3)
            if close:
                message += f"; did you mean {' or '.join(close)}?"
        super().error(message)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("griffin")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
        return "unknown (not installed)"


DESCRIPTION = """\
Griffin and Hawk (De et al., 2024): gated linear recurrences mixed with local attention. Train the paper's models
(or small ones on a CPU), prepare data, sample, convert checkpoints, serve them, evaluate them, plan a cluster."""

EPILOG = """\
examples:
  griffin presets                               the model sizes and their parameter counts
  griffin train                                 the CPU demo: a small Griffin on the stdlib's source
  griffin train --preset hawk-cpu --out runs/hawk
  griffin train --out runs/hawk --resume        continue a stopped run, with its own settings
  griffin prepare input.txt --out data && griffin train --data data --out runs/mine
  griffin generate runs/griffin-cpu/checkpoints/best --prompt "def " --max-new-tokens 200
  griffin experiment scaling --workers 2        the paper's scaling curves (Figure 1a) on a ladder for the CPU
  griffin COMMAND --help                        the options of a command

exit status: 0 done; 2 a bad value, a missing, malformed or busy file (one line naming it); 130 interrupted
(Ctrl-C: a second one stops at once); 141 the output pipe closed; 143 `griffin train` stopped by SIGTERM (a
cluster's preemption notice) after checkpointing the step it was at (--resume continues it exactly); 1 an unexpected
error (a bug: its traceback is shown). --debug shows the traceback of every error."""

EXAMPLES = {
    "presets": "  griffin presets\n  griffin presets --markdown > presets.md\n",
    "train": "  griffin train                                    the CPU demo (configs/cpu-demo.toml's settings)\n"
             "  griffin train --config configs/hawk-cpu.toml --out runs/hawk\n"
             "  griffin train --preset griffin-tiny --max-steps 50 --model width=64 --out runs/small\n"
             "  griffin train --data data --out runs/mine        a dataset from `griffin prepare`\n"
             "  griffin train --out runs/mine --resume           continue it (its saved settings; more steps:\n"
             "                                                   --max-steps N)\n",
    "prepare": "  griffin prepare input.txt --out data             one text file: cut into pieces, some held out\n"
               "  griffin prepare corpus/ --tokenizer tok --out data\n",
    "generate": "  griffin generate runs/griffin-cpu/checkpoints/best --prompt \"def \" --temperature 0.8\n"
                "  griffin generate CKPT --prompt-lines prompts.txt --max-new-tokens 32 --seed 0   one prompt a line\n"
                "  griffin generate CKPT --prompt-file book.txt --max-new-tokens 0 --save-state book.state\n",
    "convert": "  griffin convert runs/griffin-cpu/checkpoints/best hf-model --to hf\n"
               "  griffin convert 2b.pt recurrentgemma-2b            an official checkpoint to griffin's format\n",
    "quantize": "  griffin quantize runs/griffin-cpu/checkpoints/best int8-model --int8\n",
    "finetune": "  griffin finetune recurrentgemma-2b-it --data chats.jsonl --out runs/ft          LoRA, rank 16\n"
                "  griffin finetune runs/base/checkpoints/best --data pairs.jsonl --lora-rank 0 --out runs/full\n"
                "  griffin finetune CKPT --data chats.jsonl --out runs/ft --resume             continue it\n",
    "merge": "  griffin merge runs/ft/checkpoints/best merged --to hf\n",
    "info": "  griffin info griffin-1.3b\n  griffin info runs/griffin-cpu/checkpoints/best\n",
    "tokenizer": "  griffin tokenizer corpus/ --vocab-size 8192 --out tok     writes tok/tokenizer.json\n",
    "serve": "  griffin serve runs/griffin-cpu/checkpoints/best --port 8000\n",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``griffin`` parser with every sub-command (those of serve, synth, eval and plan from their packages)."""
    from griffin.data import VAL_FRACTION
    from griffin.interop import DTYPES

    parser = GriffinParser(prog="griffin", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"griffin {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--verbose", action="store_true",
                        help="show the compiler (numba) warnings of griffin's kernels, hidden by default")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                   help="--to official only: write the official format even where it cannot express the model "
                        "(with a warning); otherwise refused")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    _overwrite_option(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model's weights and write the checkpoint")
    p.add_argument("adapter", help="a LoRA adapter directory (PEFT's format: `griffin finetune`'s checkpoints)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--base", help="the base checkpoint (default: the one the adapter names)")
    p.add_argument("--to", choices=("griffin", "hf"), default="griffin", help="output format")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    _overwrite_option(p)
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("quantize", help="write a checkpoint with weight-only int8 weights (half the bytes of "
                       "bfloat16; CPU decode speed and quality: docs/performance.md)")
    p.add_argument("src", help="a float checkpoint (griffin, HF RecurrentGemma or official)")
    p.add_argument("dst", help="output directory (griffin format: int8 weights and their float32 scales)")
    p.add_argument("--int8", action="store_true",
                   help="weight-only int8: linear layers, embedding and output layer, RG-LRU gates")
    p.add_argument("--float-gates", action="store_true",
                   help="keep the RG-LRU's block-diagonal gates in float (their int8 quality: "
                        "docs/performance.md)")
    p.add_argument("--group-size", type=int, default=0,
                   help="inputs sharing one scale: 0 (default) for one scale per output channel, or a multiple of "
                        "8 dividing every layer's input width (e.g. 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of what stays in float (activations, norms, RG-LRU, biases); default: as stored")
    _overwrite_option(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint", help="a griffin, HF RecurrentGemma or official checkpoint (or a LoRA adapter "
                   "directory: its base model with it)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory (PEFT's format, "
                   "`griffin finetune`) merged into the checkpoint's weights")
    p.add_argument("--tokenizer", default="auto",
                   help="'bytes' (byte-level), a tokenizer.json, a SentencePiece .model, or a directory holding one; "
                        "'auto': the tokenizer stored beside the checkpoint (in its directory, or beside a .pt file), "
                        "else bytes")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", help="a text file, the whole of it one prompt (repeat for a "
                   "batch)")
    p.add_argument("--prompt-lines", metavar="FILE", help="a text file with one prompt per line (a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate after each prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 samples greedily")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop-token", type=int, action="append", help="stop a row after this token id (repeatable)")
    p.add_argument("--no-stop-at-eos", action="store_true", help="do not stop at the tokenizer's EOS token")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token")
    p.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk length (bounds memory)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
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

    p = sub.add_parser("finetune", help="fine-tune a checkpoint on chats, prompt/completion pairs or texts (JSONL), "
                       "with LoRA or all weights (docs/finetuning.md)",
                       description="Fine-tune a griffin, HF RecurrentGemma or official checkpoint: `griffin train "
                       "--init CHECKPOINT` with fine-tuning's defaults (LoRA of rank 16; --lora-rank 0 trains every "
                       "weight, at lr 2e-5 unless given). The loss falls on the replies; examples are packed whole, "
                       "each starting a document. Checkpoints hold the adapters in PEFT's format.")
    p.add_argument("checkpoint", help="the model to start from: a griffin, HF RecurrentGemma or official checkpoint "
                   "(its tokenizer and chat template are found beside it)")
    _add_train_options(p, FINETUNE_DEFAULTS, skip=("init", "preset", "model"))
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenize text, JSONL or parquet files into memory-mapped shards")
    p.add_argument("inputs", nargs="*", help="files or directories (none: the Python standard library's source)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json or a SentencePiece .model")
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION, help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument("--text-field", default="text", help="the text field of JSONL records and parquet tables")
    p.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    renamed(p, "--dtype", p.add_argument("--token-dtype", choices=("uint16", "uint32"), default=None, dest="dtype",
                                         help="dtype of the token ids (default: uint16 if the vocabulary fits, "
                                              "else uint32)"))
    _overwrite_option(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (HF tokenizers) on local files")
    p.add_argument("inputs", nargs="+", help="text, JSONL or parquet files or directories")
    p.add_argument("--out", required=True, help="output directory: its tokenizer.json (give the directory to "
                   "--tokenizer of prepare, train, generate)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size")
    p.add_argument("--text-field", default="text", help="the text field of JSONL records and parquet tables")
    _overwrite_option(p)
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

    from griffin.experiments.cli import add_experiment_parser  # griffin experiment scaling | long-context | window

    add_experiment_parser(sub)

    from griffin.parallel.commands import add_plan_parser  # griffin plan PRESET --gpus N --gpu h100 (Section 4.1)

    add_plan_parser(sub)
    return parser


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to fix (a bad value, a missing, malformed or busy file, a run that cannot go
    on: ValueError and its subclasses such as CheckpointError and FileFormatError, OSError, TrainingError) rather
    than a bug. A TypeError is a bug: where a wrong type comes from the user, it is refused as a ValueError."""
    if isinstance(err, (ValueError, OSError)):
        return True
    trainer = sys.modules.get("griffin.training.trainer")
    return trainer is not None and isinstance(err, trainer.TrainingError)


def _message(err: BaseException) -> str:
    """One line for a user error: an OSError as 'FILE: what happened' rather than '[Errno 17] ...'."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        files = f"{err.filename}" + (f" -> {err.filename2}" if err.filename2 is not None else "")
        return f"{files}: {err.strerror}"
    return str(err)


def _interrupt_once(signum: int, frame: Any) -> None:
    """The first Ctrl-C: a KeyboardInterrupt, with the default handler back so that a second one stops at once."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise KeyboardInterrupt


def _install_interrupt_handler() -> Callable[[], None]:
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None  # not ours to change (a thread, or a host program with its own handler)
    signal.signal(signal.SIGINT, _interrupt_once)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def _silence_stdout() -> None:
    """After the reader of stdout went away: point stdout at /dev/null so that the interpreter's last flush does not
    complain again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor (captured)
        pass


#: The commands that train on CPU: torch's idle OpenMP workers spin briefly there (prefer_training_openmp_wait), and
#: the C heap keeps what the steps free (griffin.heap.keep_freed_memory)
TRAINING_COMMANDS = ("train", "finetune", "synth")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``griffin`` with ``argv`` and return the exit status (see the module docstring for the error policy).
    OpenMP's idle threads sleep (:func:`griffin.threads.prefer_passive_openmp_wait`, set before torch loads), but for
    torch's in the commands that train (:func:`griffin.threads.prefer_training_openmp_wait`), which also keep the
    memory they free for reuse (:func:`griffin.heap.keep_freed_memory`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # global options take no value
    (prefer_training_openmp_wait if command in TRAINING_COMMANDS else prefer_passive_openmp_wait)()
    if command in TRAINING_COMMANDS:
        keep_freed_memory()
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # read where griffin's kernels compile (griffin.ops.jit.verbose), children too
        import os

        os.environ["GRIFFIN_VERBOSE"] = "1"
    debug = getattr(args, "debug", False)
    restore = _install_interrupt_handler()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        hint = getattr(args, "interrupt_hint", None)
        print(f"\ngriffin {args.command}: interrupted" + (f"; {hint()}" if hint else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        if debug:
            traceback.print_exc()
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as err:
        if not is_user_error(err):
            raise
        if debug:
            traceback.print_exc()
        print(f"griffin {args.command}: error: {_message(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
