"""The OpenAI-compatible HTTP API over an :class:`griffin.serve.engine.Engine` (a Starlette ASGI app):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed as server-sent events with ``stream``;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text);
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (as vLLM has them: lm-evaluation-harness'
  ``local-completions`` tokenizes through them).

Errors are OpenAI error bodies: 400 for a bad request (malformed JSON, a field out of range, a prompt the model cannot
take), 404 for an unknown model or path, 429 with ``Retry-After`` when the queue is full, 503 while shutting down.
A client that disconnects cancels its request: its rows are freed at the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from griffin.data.chat import ChatTemplate
from griffin.data.tokenizer import Tokenizer
from griffin.serve.engine import (
    ChoiceOutput,
    Engine,
    EngineClosed,
    QueueFull,
    RequestFailed,
    RequestHandle,
    RequestOutput,
    Update,
)
from griffin.serve.grammar import GrammarError
from griffin.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    new_id,
    now,
    usage,
    validation_error,
)
from griffin.serve.text import clean, decode, token_bytes, token_text

log = logging.getLogger("griffin.serve")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class Server:
    """The app's state and handlers: the engine, the tokenizer, the chat template, the served model's name."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, chat_template: ChatTemplate | None = None,
                 default_max_tokens: int = 256, add_bos: bool = True,
                 adapter_templates: Mapping[str, ChatTemplate] | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template = chat_template or ChatTemplate(tokenizer, None, add_bos)
        # the engine's LoRA adapters, by the model name that picks them, each with its chat template (default: the
        # base's)
        names = engine.adapters.names if engine.adapters is not None else []
        self.adapter_templates = {name: (adapter_templates or {}).get(name, self.chat_template) for name in names}
        self.default_max_tokens = default_max_tokens
        self.bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
        self.created = now()
        self.closing = False

    # Helpers ----------------------------------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return token_text(self.tokenizer, token)

    def token_bytes(self, token: int) -> list[int]:
        return token_bytes(self.tokenizer, token)

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            parsed = model.model_validate(data)
        except ValidationError as err:
            raise validation_error(err) from err
        if getattr(parsed, "model", None) not in (None, self.model_name, *self.adapter_templates):
            served = ", ".join(f"`{m}`" for m in (self.model_name, *self.adapter_templates))
            raise APIError(404, f"the model `{parsed.model}` does not exist: this server serves {served}",
                           param="model", code="model_not_found")
        parsed.unsupported()
        return parsed

    def served(self, req: Any) -> str:
        """The model a (parsed) request asks for: the base model's name, or a LoRA adapter's."""
        return getattr(req, "model", None) or self.model_name

    def adapter_of(self, req: Any) -> str | None:
        """The LoRA adapter a request picks with its model field (None: the base model)."""
        model = getattr(req, "model", None)
        return model if model in self.adapter_templates else None

    def template_for(self, req: Any) -> ChatTemplate:
        """The chat template of the model a request picks: an adapter's own, else the base's."""
        return self.adapter_templates.get(self.adapter_of(req), self.chat_template)

    def encode(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"prompt {index} is empty: give some text", param="prompt")
            return self.bos + self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise APIError(400, f"prompt {index} is empty: give at least one token", param="prompt")
        return prompt

    def submit(self, prompts: list[list[int]], params, timeout: float | None,
               adapter: str | None = None) -> list[RequestHandle]:
        """Queue one engine request per prompt (all or none), on the LoRA adapter ``adapter`` (None: the base)."""
        if self.closing:
            raise APIError(503, "the server is shutting down", type="server_error")
        for i, p in enumerate(prompts):
            try:
                self.engine.check(p, params)
            except GrammarError as err:  # a schema llguidance cannot compile (400), or no llguidance (501)
                raise APIError(err.status, str(err), param="response_format") from err
            except ValueError as err:
                param = "max_tokens" if "max_tokens" in str(err) else "prompt"
                raise APIError(400, f"prompt {i}: {err}" if len(prompts) > 1 else str(err), param=param) from err
        loop = asyncio.get_running_loop()
        handles: list[RequestHandle] = []
        try:
            for p in prompts:
                handles.append(self.engine.submit(p, params, loop=loop, timeout=timeout, adapter=adapter))
        except QueueFull as err:
            for h in handles:
                h.cancel()
            raise APIError(429, str(err), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after)}) from err
        except EngineClosed as err:
            for h in handles:
                h.cancel()
            raise APIError(503, str(err), type="server_error") from err
        return handles

    async def collect(self, request: Request, handles: list[RequestHandle], params) -> list[RequestOutput] | None:
        """Wait for every request's whole output; None (and the requests cancelled) if the client goes away."""
        results = [RequestOutput([ChoiceOutput(i, [], "", [] if params.logprobs is not None else None)
                                  for i in range(params.n)]) for _ in handles]

        async def drain(handle: RequestHandle, result: RequestOutput) -> None:
            async for update in handle.updates():
                result.add(update)
            result.prefix_hit = handle.prefix_hit

        task = asyncio.ensure_future(asyncio.gather(*(drain(h, r) for h, r in zip(handles, results, strict=True))))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return results
                if await request.is_disconnected():
                    return None
        except RequestFailed as err:
            raise APIError(err.status, str(err), type="server_error") from err
        finally:
            if not task.done():
                task.cancel()
                # a cancelled gather ends with a CancelledError that nobody awaits: retrieve it, or asyncio logs an
                # ERROR with a traceback ("exception was never retrieved") for every client that went away
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            for h in handles:
                h.cancel()

    async def merged(self, handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Update]]:
        """The updates of several requests as they come, tagged with the request's index."""
        queue: asyncio.Queue[tuple[int, Update | None]] = asyncio.Queue()

        async def forward(k: int, handle: RequestHandle) -> None:
            async for update in handle.updates():
                await queue.put((k, update))
            await queue.put((k, None))

        tasks = [asyncio.ensure_future(forward(k, h)) for k, h in enumerate(handles)]
        try:
            open_ = len(handles)
            while open_:
                k, update = await queue.get()
                if update is None:
                    open_ -= 1
                    continue
                yield k, update
        finally:
            for t in tasks:
                t.cancel()
            for h in handles:
                h.cancel()

    # Endpoints --------------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        texts = req.prompts()
        prompts = [self.encode(p, i) for i, p in enumerate(texts)]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens < 0:
            raise APIError(400, f"max_tokens={max_tokens} must be >= 0", param="max_tokens")
        params = req.sampling(max_tokens, req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None)
        handles = self.submit(prompts, params, req.timeout, self.adapter_of(req))
        cid, created = new_id("cmpl"), now()
        echo_texts = [t if isinstance(t, str) else clean(decode(self.tokenizer, p))
                      for t, p in zip(texts, prompts, strict=True)]
        if req.stream:
            return StreamingResponse(self.stream_completions(req, handles, prompts, echo_texts, cid, created),
                                     media_type="text/event-stream")
        results = await self.collect(request, handles, params)
        if results is None:
            return Response(status_code=499)  # the client closed the connection: nobody reads this
        choices, completion_tokens = [], 0
        for k, result in enumerate(results):
            for c in result.choices:
                completion_tokens += len(c.token_ids)
                text, lp = c.text, None
                if req.logprobs is not None:
                    lp = CompletionLogprobs(self.token_text)
                    offset = 0
                    if req.echo:
                        offset = lp.add(result.prompt_logprobs or [], 0)
                    lp.add(c.logprobs or [], offset)
                    lp = lp.body()
                if req.echo:
                    text = echo_texts[k] + text
                choices.append({"index": k * req.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        body = {"id": cid, "object": "text_completion", "created": created, "model": self.served(req),
                "choices": choices,
                "usage": usage(sum(map(len, prompts)), completion_tokens, sum(r.prefix_hit for r in results))}
        return JSONResponse(body)

    async def stream_completions(self, req: CompletionRequest, handles: list[RequestHandle],
                                 prompts: list[list[int]], echo_texts: list[str], cid: str,
                                 created: int) -> AsyncIterator[str]:
        n, started = req.n, set()
        lps = {}
        offsets: dict[int, int] = {}
        completion_tokens = 0
        async for k, update in self.merged(handles):
            if update.error:
                yield sse({"error": {"message": update.error, "type": "server_error", "param": None,
                                     "code": None}})
                break
            if req.echo and k not in started:
                started.add(k)
                for j in range(n):
                    index = k * n + j
                    body = None
                    if req.logprobs is not None:
                        lps[index] = CompletionLogprobs(self.token_text)
                        offsets[index] = lps[index].add(update.prompt_logprobs or [], 0)
                        body = lps[index].body()
                    yield sse(completion_chunk(cid, created, self.served(req), index, echo_texts[k], body, None))
            for c in update.choices:
                index = k * n + c.index
                completion_tokens += len(c.token_ids)
                body = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs(self.token_text)
                    offsets[index] = lp.add(c.logprobs or [], offsets.get(index, 0))
                    body = lp.body()
                if c.text or c.finish_reason or body:
                    yield sse(completion_chunk(cid, created, self.served(req), index, c.text, body, c.finish_reason))
        if req.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": self.served(req),
                       "choices": [], "usage": usage(sum(map(len, prompts)), completion_tokens,
                                                     sum(h.prefix_hit for h in handles))})
        yield sse("[DONE]")

    def chat_params(self, req: ChatCompletionRequest) -> tuple[list[int], Any]:
        try:
            ids, boundaries = self.template_for(req)(req.messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, self.engine.max_tokens_limit)
            if self.engine.max_length is not None:
                max_tokens = max(0, min(max_tokens, self.engine.max_length - len(ids)))
        if max_tokens < 0:
            raise APIError(400, f"max_tokens={max_tokens} must be >= 0", param="max_tokens")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # with a response_format the grammar ends the turn: the template's stop strings could cut a JSON string
        stops = () if req.grammar() is not None else self.template_for(req).stop
        params = req.sampling(max_tokens, logprobs, False, stops=stops, boundaries=tuple(boundaries))
        return ids, params

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        ids, params = self.chat_params(req)
        handles = self.submit([ids], params, req.timeout, self.adapter_of(req))
        cid, created = new_id("chatcmpl"), now()
        if req.stream:
            return StreamingResponse(self.stream_chat(req, handles, len(ids), cid, created),
                                     media_type="text/event-stream")
        results = await self.collect(request, handles, params)
        if results is None:
            return Response(status_code=499)
        (result,) = results
        choices = []
        for c in result.choices:
            lp = ({"content": chat_logprobs(c.logprobs or [], self.token_text, self.token_bytes)}
                  if req.logprobs else None)
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        body = {"id": cid, "object": "chat.completion", "created": created, "model": self.served(req),
                "choices": choices,
                "usage": usage(len(ids), sum(len(c.token_ids) for c in result.choices), result.prefix_hit)}
        return JSONResponse(body)

    async def stream_chat(self, req: ChatCompletionRequest, handles: list[RequestHandle], prompt_tokens: int,
                          cid: str, created: int) -> AsyncIterator[str]:
        for j in range(req.n):
            yield sse(chat_chunk(cid, created, self.served(req), j, {"role": "assistant", "content": ""}, None, None))
        completion_tokens = 0
        async for _, update in self.merged(handles):
            if update.error:
                yield sse({"error": {"message": update.error, "type": "server_error", "param": None,
                                     "code": None}})
                break
            for c in update.choices:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs and c.logprobs:
                    lp = {"content": chat_logprobs(c.logprobs, self.token_text, self.token_bytes)}
                if c.text or lp:
                    yield sse(chat_chunk(cid, created, self.served(req), c.index, {"content": c.text}, lp, None))
                if c.finish_reason:
                    yield sse(chat_chunk(cid, created, self.served(req), c.index, {}, None, c.finish_reason))
        if req.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served(req),
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens, handles[0].prefix_hit)})
        yield sse("[DONE]")

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "griffin",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_length}
        # each LoRA adapter served, with the base as its parent (as vLLM lists them)
        adapters = [{**card, "id": name, "root": name, "parent": self.model_name} for name in self.adapter_templates]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def health(self, request: Request) -> Response:
        if self.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "running": self.engine.running, "queued": self.engine.queue_length})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: Request) -> Response:
        data = await self.parse_object(request)
        if "messages" in data:
            template = self.adapter_templates.get(data.get("model"), self.chat_template)
            ids, _ = template(data["messages"])
        elif isinstance(data.get("prompt"), str):
            ids = (self.bos if data.get("add_special_tokens", False) else []) + self.tokenizer.encode(data["prompt"])
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_length})

    async def detokenize(self, request: Request) -> Response:
        data = await self.parse_object(request)
        tokens = data.get("tokens")
        vocab = self.engine.config.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": clean(decode(self.tokenizer, tokens))})

    async def tokenizer_info(self, request: Request) -> Response:
        def name(token: int | None) -> str | None:
            return None if token is None else self.tokenizer.decode([token])

        return JSONResponse({"tokenizer_class": type(self.tokenizer).__name__,
                             "bos_token": name(self.tokenizer.bos_id), "eos_token": name(self.tokenizer.eos_id),
                             "pad_token": None, "chat_template": self.chat_template.source,
                             "model_max_length": self.engine.max_length, "vocab_size": self.tokenizer.vocab_size})

    async def parse_object(self, request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data


def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, APIError)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    kind = "not_found" if err.status_code == 404 else None
    body = APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=kind).body()
    return JSONResponse(body, status_code=err.status_code)


def _server_error(request: Request, err: Exception) -> Response:
    log.exception("unhandled error", exc_info=err)
    body = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error").body()
    return JSONResponse(body, status_code=500)


def build_app(server: Server, shutdown_grace: float = 0.0,
              on_shutdown: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app. Its lifespan starts the engine thread and, at shutdown (after the HTTP server has let running
    requests finish, for up to its own grace period), ends what is left and stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.engine.start()
        try:
            yield
        finally:
            server.closing = True
            await asyncio.get_running_loop().run_in_executor(None, server.engine.stop, shutdown_grace)
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.server = server
    return app
