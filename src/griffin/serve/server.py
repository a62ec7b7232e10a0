"""``griffin serve CKPT``: load a checkpoint and its tokenizer, build the engine and the app, run uvicorn
(docs/serving.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from griffin.data.chat import ChatTemplate, find_chat_template
from griffin.interop import adapter_base, is_adapter
from griffin.loading import load_for_use
from griffin.quantize import quantize_int8
from griffin.serve.adapters import load_adapters
from griffin.serve.app import Server, build_app
from griffin.serve.engine import Engine
from griffin.serve.options import ServeConfig

log = logging.getLogger("griffin.serve")


def build_server(cfg: ServeConfig) -> Server:
    """Load the model and tokenizer (:func:`griffin.load_for_use`: the checkpoint's own tokenizer for ``auto``, int8
    quantised on loading with ``--quantize int8``, CPU only) and make the engine and the app's state (not
    started)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # named adapters are checked against the float base weights they were trained on, then the base is quantised
    later = cfg.quantize if cfg.adapters else None
    if later is not None and str(cfg.device) != "cpu":
        raise ValueError(f"{later} weights decode with the CPU kernel only, not on device {cfg.device!r}")
    loaded = load_for_use(cfg.checkpoint, tokenizer=cfg.tokenizer, dtype=cfg.dtype,
                          quantize=None if later else cfg.quantize, group_size=0 if later else cfg.group_size,
                          device=cfg.device, adapter=cfg.adapter)
    model, tokenizer = loaded.model, loaded.tokenizer
    name = cfg.served_model_name or loaded.name
    adapters = load_adapters(model, cfg.adapters, name) if cfg.adapters else None
    if later is not None:
        model = quantize_int8(model, cfg.group_size, inplace=True)
    max_length = cfg.max_length
    if "attention" in model.config.block_types and max_length is None:
        max_length = 4096
    engine = Engine(model, tokenizer, max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_length=max_length,
                    max_tokens_limit=cfg.max_tokens_limit, prefill_chunk=cfg.prefill_chunk,
                    prefix_cache_bytes=int(cfg.prefix_cache_mb * 2**20),
                    prefix_block=cfg.prefix_block, compile=cfg.compile,
                    request_timeout=cfg.request_timeout, adapters=adapters)
    if cfg.chat_template == "plain":
        template = None
    elif cfg.chat_template:
        template = Path(cfg.chat_template).read_text(encoding="utf-8")
    else:
        tok_dir = None if cfg.tokenizer in ("auto", "bytes") else cfg.tokenizer
        # beside the tokenizer, the adapter (a fine-tune's checkpoint stores its chats' template), the checkpoint, or
        # the base model of a checkpoint that is an adapter
        base = adapter_base(cfg.checkpoint) if is_adapter(cfg.checkpoint) else None
        template = find_chat_template(tok_dir, cfg.adapter, cfg.checkpoint, base or None)
    chat = ChatTemplate(tokenizer, template, add_bos=not cfg.no_bos)
    # each named adapter: the template stored beside it (what it was fine-tuned with), else the base's; a
    # --chat-template given applies to every model served
    templates = {a.name: chat if cfg.chat_template or a.chat_template is None
                 else ChatTemplate(tokenizer, a.chat_template, add_bos=not cfg.no_bos)
                 for a in (adapters.adapters if adapters is not None else [])}
    return Server(engine, tokenizer, name, chat, default_max_tokens=cfg.default_max_tokens, add_bos=not cfg.no_bos,
                  adapter_templates=templates)


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
    if engine.adapters is not None:
        log.info("LoRA adapters served unmerged (the request's model field picks one): %s",
                 ", ".join(f"{a.name} ({a.path}, r={a.adapter.settings.r})" for a in engine.adapters.adapters))
    app = build_app(server)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=cfg.shutdown_grace, access_log=False)
    uvicorn.Server(config).run()
