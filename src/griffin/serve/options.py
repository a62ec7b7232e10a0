"""The options of ``griffin serve`` (argparse only: the command line builds its parser without importing the server's
dependencies, and :func:`griffin.serve.server.run` takes the :class:`ServeConfig` made here)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from griffin.arguments import renamed
from griffin.interop import DTYPES


@dataclass
class ServeConfig:
    """Every option of ``griffin serve`` (see :func:`add_serve_arguments` for their meaning)."""

    checkpoint: str
    adapter: str | None = None  # merged into the weights
    adapters: dict[str, str] = field(default_factory=dict)  # name -> directory: served unmerged, chosen per request
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str = "auto"
    served_model_name: str | None = None
    dtype: torch.dtype | None = None
    quantize: str | None = None
    group_size: int = 0
    device: str = "cpu"
    max_batch: int = 32
    max_queue: int = 256
    max_length: int | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    prefill_chunk: int = 512
    prefix_cache_mb: float = 256.0
    prefix_block: int = 64  # griffin.serve.engine.DEFAULT_PREFIX_BLOCK
    compile: bool = False
    request_timeout: float | None = 600.0
    shutdown_grace: float = 30.0
    chat_template: str | None = None
    no_bos: bool = False
    threads: int | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if isinstance(self.prefix_block, bool) or not isinstance(self.prefix_block, int) or self.prefix_block < 0:
            raise ValueError(f"--prefix-block {self.prefix_block!r} must be an integer >= 0 (tokens per prefix-cache "
                             f"block; 0: states only at chat message and prompt ends)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``griffin serve`` flags, one per :class:`ServeConfig` field."""
    d = ServeConfig("")
    p.add_argument("checkpoint", help="a griffin, HF RecurrentGemma or official checkpoint (or a LoRA adapter "
                   "directory: its base model with it)")
    p.add_argument("--adapter", metavar="[NAME=]DIR", action="append", default=None,
                   help="a LoRA adapter directory (PEFT's format, `griffin finetune`). NAME=DIR (repeatable): served "
                        "unmerged under NAME, which a request's model field picks, beside the base model; DIR alone "
                        "(once): merged into the checkpoint's weights")
    p.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=d.port, help="port")
    p.add_argument("--tokenizer", default=d.tokenizer,
                   help="'bytes', a tokenizer.json, a SentencePiece .model, or a directory holding one; 'auto': the "
                        "tokenizer stored beside the checkpoint (in its directory, or beside a .pt file), else bytes")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients give (default: the checkpoint directory's name)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)")
    p.add_argument("--quantize", choices=("int8",), default=None,
                   help="serve weight-only int8 weights, quantised on loading (CPU only; an int8 checkpoint from "
                        "`griffin quantize` needs no flag): about half bfloat16's bytes read per decode step")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help="with --quantize: inputs per int8 scale (0: one scale per output channel)")
    p.add_argument("--device", default=d.device, help="torch device")
    renamed(p, "--max-batch", p.add_argument("--max-batch-size", type=int, default=d.max_batch, dest="max_batch",
                                             help="rows of the running batch: requests decoded together"))
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests waiting for a row before the server answers 429")
    p.add_argument("--max-length", type=int, default=None,
                   help="models with global attention (MQA): tokens per row of the KV cache, prompt + output "
                        "(default: 4096); Hawk and Griffin have a bounded state and need none")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="the largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a chat request that gives none")
    renamed(p, "--prefill-chunk", p.add_argument(
        "--chunk-size", type=int, default=d.prefill_chunk, dest="prefill_chunk",
        help="prompt tokens per forward pass, and per step between two decode steps: smaller keeps the running "
             "requests' per-token latency low while long prompts are read"))
    p.add_argument("--prefix-cache-mb", type=float, default=d.prefix_cache_mb,
                   help="memory for the states after prompt prefixes (chat turns, system prompts) kept for reuse; "
                        "0 disables it")
    p.add_argument("--prefix-block", type=int, default=d.prefix_block, metavar="TOKENS",
                   help="prompts are cut and their states kept every TOKENS tokens, so a request reuses the state "
                        "after any prefix it shares with an earlier one (a few-shot preamble) down to the last whole "
                        "block; 0: states only at chat message and prompt ends")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step for each power-of-two batch size at start-up (slow to start)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may take from its arrival")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before they are cancelled")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or 'plain' (default: the tokenizer's, else plain; "
                        "docs/serving.md)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token to text prompts")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"),
                   help="uvicorn's and the engine's log level")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of parsed ``griffin serve`` arguments."""
    fields = {k: getattr(args, k) for k in ServeConfig.__dataclass_fields__ if hasattr(args, k)}
    fields["dtype"] = DTYPES[args.dtype] if args.dtype else None
    fields["adapter"], fields["adapters"] = split_adapters(getattr(args, "adapter", None) or [])
    return ServeConfig(**fields)


def split_adapters(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """``--adapter`` values as (the one merged adapter, named adapters served unmerged): ``NAME=DIR`` is named
    unless the whole value is an existing path; a plain ``DIR`` is merged. Two merged ones, a name given twice, or
    both kinds together are a ValueError naming them."""
    merged, named = [], {}
    for value in values:
        name, sep, directory = value.partition("=")
        if sep and name and directory and "/" not in name and not Path(value).exists():
            if name in named:
                raise ValueError(f"--adapter {name}= is given twice ({named[name]} and {directory})")
            named[name] = directory
        else:
            merged.append(value)
    if len(merged) > 1:
        raise ValueError(f"--adapter DIR merges one adapter into the weights, got {len(merged)} ({', '.join(merged)}): "
                         "serve several unmerged with --adapter NAME=DIR each")
    if merged and named:
        raise ValueError(f"--adapter {merged[0]} (merged) and named adapters ({', '.join(named)}) do not go together: "
                         "the named ones would be checked against a base with another adapter merged; name it too")
    return (merged[0] if merged else None), named
