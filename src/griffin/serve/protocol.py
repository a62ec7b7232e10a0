"""The OpenAI API's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``, and its error
body. Requests are validated here (types, ranges, NaN), before anything reaches the engine; a few of vLLM's extra
fields are accepted too (``top_k``, ``ignore_eos``, ``stop_token_ids``)."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from griffin.serve.engine import ChoiceOutput, TokenLogprob
from griffin.serve.grammar import GrammarError, ResponseFormat, parse_response_format
from griffin.serve.sampling import SamplingParams


class APIError(Exception):
    """An error for the client: HTTP ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(err: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}{shown}", param=param)


class _Request(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    timeout: float | None = Field(None, gt=0)
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def unsupported(self) -> None:
        """Refuse the OpenAI parameters this server does not implement, rather than ignore them."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (use 0 or leave it out)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")

    def grammar(self) -> ResponseFormat | None:
        """The parsed ``response_format`` (None for free text), or a 400 naming what is wrong with it."""
        try:
            return parse_response_format(self.response_format)
        except GrammarError as err:
            raise APIError(err.status, str(err), param="response_format") from err

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: bool, stops: tuple[str, ...] = (),
                 boundaries: tuple[int, ...] = ()) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        response_format = self.grammar()
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed, n=self.n,
                stop=stop + tuple(s for s in stops if s not in stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, boundaries=boundaries,
                response_format=response_format,
            )
        except ValueError as err:
            raise APIError(400, str(err), param=str(err).split("=", 1)[0]) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or one token list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)

    def unsupported(self) -> None:
        super().unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported by this server (leave it out, or equal to n)",
                           param="best_of")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", param="tools")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finite(x: float | None) -> float | None:
    """A log-probability for JSON: -inf (a token the model gives no chance) becomes -9999.0, as OpenAI does."""
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0


class CompletionLogprobs:
    """The ``logprobs`` object of a completion choice, built up over the tokens shown (prompt tokens first with
    ``echo``)."""

    def __init__(self, token_text) -> None:
        self.token_text = token_text
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, items: list[TokenLogprob], offset: int) -> int:
        """Append tokens whose text starts at ``offset``; returns the offset after them."""
        for lp in items:
            text = self.token_text(lp.token)
            self.tokens.append(text)
            self.token_logprobs.append(finite(lp.logprob))
            self.top_logprobs.append(None if lp.logprob is None else
                                     {self.token_text(t): finite(v) for t, v in lp.top})
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def chat_logprobs(items: list[TokenLogprob], token_text, token_bytes) -> list[dict[str, Any]]:
    """The ``logprobs.content`` entries of a chat choice."""
    return [{"token": token_text(lp.token), "logprob": finite(lp.logprob), "bytes": token_bytes(lp.token),
             "top_logprobs": [{"token": token_text(t), "logprob": finite(v), "bytes": token_bytes(t)}
                              for t, v in lp.top]} for lp in items]


def completion_chunk(cid: str, created: int, model: str, index: int, text: str, logprobs: dict | None,
                     finish_reason: str | None) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(cid: str, created: int, model: str, index: int, delta: dict[str, Any], logprobs: dict | None,
               finish_reason: str | None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


FinishReason = Literal["stop", "length", "timeout", "abort"]


def merge(choice: ChoiceOutput, update: ChoiceOutput) -> None:
    choice.token_ids += update.token_ids
    choice.text += update.text
    if update.logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + update.logprobs
    choice.finish_reason = update.finish_reason or choice.finish_reason
