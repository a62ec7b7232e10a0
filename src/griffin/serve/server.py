"""``griffin serve CKPT``: load a checkpoint and its tokenizer, build the engine and the app, run uvicorn
(docs/serving.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from griffin.data.tokenizer import Tokenizer, load_tokenizer
from griffin.interop import load_pretrained
from griffin.model import CausalLM
from griffin.ops.matvec import check_group_size
from griffin.quantize import quantization_of, quantize_int8
from griffin.serve.app import Server, build_app
from griffin.serve.chat import ChatTemplate, find_chat_template
from griffin.serve.engine import Engine
from griffin.serve.options import ServeConfig

log = logging.getLogger("griffin.serve")


def resolve_tokenizer(spec: str, checkpoint: str | Path) -> Tokenizer:
    """'auto': the tokenizer stored beside the checkpoint (``griffin train`` copies it there), else byte-level."""
    if spec == "auto":
        directory = Path(checkpoint)
        directory = directory if directory.is_dir() else directory.parent
        found = [directory / n for n in ("tokenizer.json", "tokenizer.model") if (directory / n).is_file()]
        spec = str(found[0]) if found else "bytes"
    return load_tokenizer(spec)


def load_model(cfg: ServeConfig) -> CausalLM:
    """The checkpoint's model on ``cfg.device`` in eval mode; with ``cfg.quantize == "int8"`` a float checkpoint is
    quantised on loading (:func:`griffin.quantize.quantize_int8`; an int8 checkpoint is used as it is). Int8 weights
    decode with the CPU kernel only, so they are refused on another device before anything is loaded."""
    if cfg.quantize not in (None, "int8"):
        raise ValueError(f"--quantize {cfg.quantize!r} is not supported: the one quantisation is int8")
    if cfg.quantize is None and cfg.group_size:
        raise ValueError(f"--group-size {cfg.group_size} applies to --quantize int8 only")
    if cfg.quantize is not None:
        check_group_size(cfg.group_size)
        if torch.device(cfg.device).type != "cpu":
            raise ValueError(f"--quantize int8 decodes with the CPU kernel only, not on --device {cfg.device}: serve "
                             "on the CPU, or the float checkpoint on this device")
    model = load_pretrained(cfg.checkpoint, dtype=cfg.dtype)
    quantized = quantization_of(model)
    if quantized is not None and torch.device(cfg.device).type != "cpu":
        raise ValueError(f"{cfg.checkpoint} holds {quantized['method']} weights, which decode with the CPU kernel "
                         f"only, not on --device {cfg.device}: serve it on the CPU, or serve the float checkpoint")
    if cfg.quantize == "int8" and quantized is None:
        model = quantize_int8(model, cfg.group_size, inplace=True)
    return model.to(cfg.device).eval()


def build_server(cfg: ServeConfig) -> Server:
    """Load the model and tokenizer and make the engine and the app's state (not started)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tokenizer = resolve_tokenizer(cfg.tokenizer, cfg.checkpoint)
    model = load_model(cfg)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}")
    max_length = cfg.max_length
    if "attention" in model.config.block_types and max_length is None:
        max_length = 4096
    engine = Engine(model, tokenizer, max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_length=max_length,
                    max_tokens_limit=cfg.max_tokens_limit, prefill_chunk=cfg.prefill_chunk,
                    prefix_cache_bytes=int(cfg.prefix_cache_mb * 2**20), compile=cfg.compile,
                    request_timeout=cfg.request_timeout)
    if cfg.chat_template == "plain":
        template = None
    elif cfg.chat_template:
        template = Path(cfg.chat_template).read_text(encoding="utf-8")
    else:
        tok_dir = None if cfg.tokenizer in ("auto", "bytes") else cfg.tokenizer
        template = find_chat_template(tok_dir, cfg.checkpoint)
    chat = ChatTemplate(tokenizer, template, add_bos=not cfg.no_bos)
    name = cfg.served_model_name or Path(cfg.checkpoint).resolve().name
    return Server(engine, tokenizer, name, chat, default_max_tokens=cfg.default_max_tokens, add_bos=not cfg.no_bos)


def run(cfg: ServeConfig) -> None:
    """Serve until interrupted (SIGINT/SIGTERM: running requests get ``shutdown_grace`` seconds to finish)."""
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = build_server(cfg)
    engine = server.engine
    log.info("warming up%s ...", " (compiling the decode step for every batch size)" if cfg.compile else "")
    engine.warmup()
    log.info("serving %s (%s, %s parameters) on http://%s:%d: max batch %d, prefix cache %.0f MiB%s",
             server.model_name, engine.config.family, f"{engine.model.num_parameters():,}", cfg.host, cfg.port,
             engine.max_batch, cfg.prefix_cache_mb,
             f", KV cache of {engine.max_length} tokens per row" if engine.max_length else "")
    app = build_app(server)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=cfg.shutdown_grace, access_log=False)
    uvicorn.Server(config).run()
