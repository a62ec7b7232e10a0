"""Soak test of ``griffin serve`` with faults (issue 37): a server on loopback under a seeded mix of good and bad
traffic at a bounded request rate for ``--minutes``, watching its memory, latency, prefix cache and errors.

1. **Model.** A small byte-level Griffin, randomly initialised (seeded; ``serve_load.bench_config``: width 128,
   depth 6, local-attention window 64, shorter than the prompts), saved as a griffin checkpoint, and two LoRA adapters
   for it in PEFT's format with random nonzero A and B (``a``: rank 8 on every projection, ``b``: rank 4 on the
   attention and MLP ones), written by ``griffin.interop.adapters.save_adapter`` with the base's fingerprint, all in a
   temporary directory.
2. **Server.** ``griffin serve CKPT --adapter a=DIR --adapter b=DIR`` (a subprocess on 127.0.0.1: the base is served
   as ``bench``) with a small prefix cache (``--prefix-cache-mb``, so that it is full after the warm-up and RSS should
   then stay flat), ``--max-tokens-limit 1024``.
3. **Traffic.** Poisson arrivals at ``--rate`` requests/s, at most ``--max-in-flight`` at once (an arrival waits for
   a slot), each drawn from a seeded mix (``--mix``): plain completions (greedy or seeded sampling, some with ``n``
   2 or a stop string); few-shot completions (one of 3 shared preambles of 450-620 tokens, then a question); chats
   (one of 4 personas: a system prompt and 1-2 few-shot turns, 650-1,030 bytes, then a new question); streams the
   client cuts after a few chunks (closing the connection) and non-streamed requests it abandons after a moment;
   ``json_object`` and ``json_schema`` requests (4 bounded schemas; every reply that finishes is parsed and validated
   with ``jsonschema``); and bad requests (unknown model or adapter, schemas llguidance cannot compile, negative or
   too large ``max_tokens``, malformed or non-object JSON bodies, prompt tokens outside the vocabulary, NaN or
   mistyped fields, unsupported parameters, an unknown path...), each of which must get a 4xx. Good requests are
   picked for the base, ``a`` or ``b`` at random and half of them are streamed (time to first token is measured on
   those). Good requests go through the ``openai`` package (``AsyncOpenAI``, no retries); bad ones through raw
   ``httpx``.
4. **Records.** The server's RSS (``/proc/PID/status`` VmRSS), threads and open files every ``--sample-s`` seconds,
   with the prefix cache's bytes from ``/metrics``; per request its kind, model, status, latency, TTFT, finish reason
   and token counts. A request is **lost** when it was sent and neither answered nor cut by the client: a timeout
   (``--request-timeout``), a connection error, or still pending ``--drain-s`` seconds after the run.
5. **End.** The server must drain (``/health``: nothing running or queued), answer ``/health`` and a normal request,
   and exit cleanly on SIGINT: by itself, with nothing in its log, status 130 (griffin's for an interrupted command;
   uvicorn finishes its graceful shutdown, then raises the SIGINT it caught again). The tokens it generated for the
   cut requests (all it generated but the answered requests' tokens) show whether they were cancelled (each would
   otherwise run to its ``max_tokens``). The verdict line sums it up; the exit status is 0 when every check passes.

**RSS flat.** A linear fit of RSS over the second half of the run (the first half is warm-up: the prefix cache and
allocator pools filling); flat when the growth the fit predicts over that half, ``|slope| * T/2``, is at most
``--flat-fraction`` (1%) of the half's mean RSS: for a 20-minute run and a ~640 MiB server, ``|slope| <= 0.64
MiB/min``. Judged on runs of at least ``--judge-rss-minutes`` (10); shorter ones report it.

    python benchmarks/serve_soak.py                        # 20 minutes (the docs' figures)
    python benchmarks/serve_soak.py --minutes 1            # a short run (tests/benchmarks/test_serve_soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import torch

try:
    import httpx
except ModuleNotFoundError:  # openai's newer releases depend on httpx's successor, under its own name
    import httpx2 as httpx

from griffin.interop import save_pretrained
from griffin.interop.adapters import LoraSettings, base_fingerprint, resolve_targets, save_adapter
from griffin.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_json  # noqa: E402
from serve_load import ServerProcess, bench_config, corpus_text  # noqa: E402

BASE = "bench"  # the base model's served name (ServerProcess's --served-model-name)
ADAPTERS = {"a": (8, "all"), "b": (4, "attention,mlp")}  # name -> (rank, targets)
MODELS = (BASE, *ADAPTERS)
KINDS = ("completion", "fewshot", "chat", "cut_stream", "abandon", "json_object", "json_schema", "bad")
DEFAULT_MIX = "completion=18,fewshot=14,chat=18,cut_stream=8,abandon=4,json_object=8,json_schema=14,bad=16"

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}},
    {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["id", "kind"],
     "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
                    "kind": {"anyOf": [{"const": "line"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}},
    {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                         "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "y": {"type": "integer", "minimum": -99, "maximum": 99}}}},
     "type": "object", "additionalProperties": False, "required": ["points"],
     "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2}}},
]


# The model and its adapters -----------------------------------------------------------------------------------------
def make_checkpoints(args: argparse.Namespace, root: Path) -> tuple[Path, dict[str, Path], dict[str, Any]]:
    """The base checkpoint and the adapters' directories, written under ``root``."""
    torch.manual_seed(args.seed)
    model = CausalLM(bench_config(args)).eval()
    ckpt = root / "base"
    save_pretrained(model, ckpt)
    dirs = {}
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        gen = torch.Generator().manual_seed(args.seed + 1 + i)
        pairs = {}
        for module in resolve_targets(model.config, targets):
            layer = model.get_submodule(module)
            pairs[module] = (torch.randn(r, layer.in_features, generator=gen) * 0.1,
                             torch.randn(layer.out_features, r, generator=gen) * 0.1)
        fingerprint = base_fingerprint({m: model.get_submodule(m).weight for m in pairs})
        dirs[name] = root / f"adapter-{name}"
        save_adapter(dirs[name], model.config, LoraSettings(r, 2.0 * r), pairs, fingerprint, BASE)
    info = dict(config=model.config.to_dict(), parameters=model.num_parameters(),
                adapters={n: dict(r=r, targets=t) for n, (r, t) in ADAPTERS.items()})
    return ckpt, dirs, info


# The workload -------------------------------------------------------------------------------------------------------
class Texts:
    """Seeded pieces of the standard library's source: snippets, few-shot preambles, chat personas."""

    def __init__(self, rng: random.Random) -> None:
        self.text = corpus_text(1_000_000)
        self.rng = rng
        self.preambles = ["".join(f"Q: {self.snippet(40, 120)}\nA: {self.snippet(40, 120)}\n\n"
                                  for _ in range(rng.randint(3, 5))) for _ in range(3)]
        self.personas = []
        for _ in range(4):
            messages = [{"role": "system", "content": self.snippet(300, 700)}]
            for _ in range(rng.randint(1, 2)):
                messages += [{"role": "user", "content": self.snippet(40, 120)},
                             {"role": "assistant", "content": self.snippet(40, 120)}]
            self.personas.append(messages)

    def snippet(self, lo: int, hi: int) -> str:
        n = self.rng.randint(lo, hi)
        start = self.rng.randrange(0, len(self.text) - n)
        return self.text[start : start + n]


def bad_requests() -> list[tuple[str, str, bytes | dict[str, Any], int]]:
    """(name, path, body, the status expected) of each kind of bad request."""
    msg = [{"role": "user", "content": "hello"}]

    def fmt(schema: Any) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}

    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        ("unknown_model", c, {"model": "nope", "prompt": "hi", "max_tokens": 4}, 404),
        ("unknown_adapter_chat", ch, {"model": "c", "messages": msg, "max_tokens": 4}, 404),
        ("schema_bad_type", ch, {"model": BASE, "messages": msg, "response_format": fmt({"type": "nonsense"})}, 400),
        ("schema_dangling_ref", ch, {"model": "a", "messages": msg,
                                     "response_format": fmt({"$ref": "#/$defs/missing"})}, 400),
        ("schema_bad_pattern", c, {"model": "b", "prompt": "x", "response_format": fmt(
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "[unclosed"}}, "required": ["s"]})},
         400),
        ("schema_not_object", ch, {"model": BASE, "messages": msg,
                                   "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "schema": 3}}}, 400),
        ("format_unknown_type", ch, {"model": BASE, "messages": msg, "response_format": {"type": "xml"}}, 400),
        ("negative_max_tokens", c, {"model": BASE, "prompt": "x", "max_tokens": -5}, 400),
        ("negative_max_tokens_chat", ch, {"model": "a", "messages": msg, "max_tokens": -1}, 400),
        ("too_long_max_tokens", c, {"model": BASE, "prompt": "x", "max_tokens": 1_000_000}, 400),
        ("malformed_json", c, b'{"model": "bench", "prompt": "x", ', 400),
        ("invalid_utf8", c, b"\xff\xfe\xfd", 400),
        ("body_not_object", ch, b"[1, 2, 3]", 400),
        ("token_out_of_range", c, {"model": BASE, "prompt": [1, 2, 256], "max_tokens": 4}, 400),
        ("token_negative", c, {"model": "a", "prompt": [-1, 5], "max_tokens": 4}, 400),
        ("empty_prompt", c, {"model": BASE, "prompt": "", "max_tokens": 4}, 400),
        ("mistyped_temperature", c, {"model": BASE, "prompt": "x", "temperature": "hot"}, 400),
        ("nan_temperature", c, b'{"model": "bench", "prompt": "x", "temperature": NaN}', 400),
        ("top_p_zero", ch, {"model": "b", "messages": msg, "top_p": 0}, 400),
        ("n_beyond_batch", c, {"model": BASE, "prompt": "x", "n": 10_000, "max_tokens": 2}, 400),
        ("empty_stop", c, {"model": BASE, "prompt": "x", "stop": [""]}, 400),
        ("logit_bias", c, {"model": BASE, "prompt": "x", "logit_bias": {"5": 1.0}}, 400),
        ("missing_messages", ch, {"model": BASE, "max_tokens": 4}, 400),
        ("unknown_path", "/v1/nothing", {"model": BASE, "prompt": "x"}, 404),
    ]


@dataclass
class Spec:
    """One request to send."""

    kind: str
    model: str = BASE
    stream: bool = False
    endpoint: str = "completions"  # or "chat"
    params: dict[str, Any] = field(default_factory=dict)
    cut_after: int = 0  # cut_stream: chunks read before closing; abandon: seconds before giving up
    abandon_s: float = 0.0
    schema: int | None = None  # json_schema: index into SCHEMAS
    bad: tuple[str, str, bytes | dict[str, Any], int] | None = None


def make_spec(rng: random.Random, texts: Texts, kinds: list[str], weights: list[float]) -> Spec:
    kind = rng.choices(kinds, weights)[0]
    model = rng.choice(MODELS)
    sampled = rng.random() < 0.5
    sampling = {"temperature": 0.8, "seed": rng.randrange(1 << 30)} if sampled else {"temperature": 0}
    stream = rng.random() < 0.5
    question = texts.snippet(20, 120)
    if kind == "bad":
        return Spec(kind, bad=rng.choice(bad_requests()))
    if kind == "completion":
        params = dict(prompt=texts.snippet(16, 300), max_tokens=rng.randint(8, 32), **sampling)
        if not stream and rng.random() < 0.2:
            params["n"] = 2
        if rng.random() < 0.2:
            params["stop"] = ["\n\n"]
        return Spec(kind, model, stream, "completions", params)
    if kind == "fewshot":
        params = dict(prompt=rng.choice(texts.preambles) + f"Q: {question}\nA:", max_tokens=rng.randint(8, 32),
                      **sampling)
        return Spec(kind, model, stream, "completions", params)
    chat = [*rng.choice(texts.personas), {"role": "user", "content": question}]
    if kind == "chat":
        return Spec(kind, model, stream, "chat", dict(messages=chat, max_tokens=rng.randint(16, 48), **sampling))
    if kind == "cut_stream":  # long outputs, cut after a few chunks
        if rng.random() < 0.5:
            return Spec(kind, model, True, "chat", dict(messages=chat, max_tokens=800, **sampling),
                        cut_after=rng.randint(1, 5))
        return Spec(kind, model, True, "completions", dict(prompt=rng.choice(texts.preambles) + question,
                                                           max_tokens=800, **sampling), cut_after=rng.randint(1, 5))
    if kind == "abandon":  # a non-streamed request the client stops waiting for
        wait = rng.uniform(0.2, 1.5)
        if rng.random() < 0.5:
            return Spec(kind, model, False, "chat", dict(messages=chat, max_tokens=800, **sampling), abandon_s=wait)
        return Spec(kind, model, False, "completions", dict(prompt=texts.snippet(16, 300), max_tokens=800,
                                                            **sampling), abandon_s=wait)
    if kind == "json_object":
        fmt = {"type": "json_object"}
        return Spec(kind, model, stream, "chat", dict(messages=chat, max_tokens=128, response_format=fmt, **sampling))
    k = rng.randrange(len(SCHEMAS))
    fmt = {"type": "json_schema", "json_schema": {"name": f"schema{k}", "schema": SCHEMAS[k], "strict": True}}
    if rng.random() < 0.5:
        return Spec(kind, model, stream, "chat", dict(messages=chat, max_tokens=160, response_format=fmt, **sampling),
                    schema=k)
    return Spec(kind, model, stream, "completions", dict(prompt=f"JSON: {question}\n", max_tokens=160,
                                                         response_format=fmt, **sampling), schema=k)


# Sending requests ---------------------------------------------------------------------------------------------------
@dataclass
class Rec:
    """What happened to one request. ``outcome``: ok, cut (the client's intended cut), 4xx, 5xx, stream_error (an
    error event inside a 200 stream), lost."""

    kind: str
    model: str
    stream: bool
    sent: float  # seconds since the run's start
    outcome: str = ""
    status: int | None = None
    latency: float | None = None
    ttft: float | None = None
    finish: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 0
    json_ok: bool | None = None
    name: str = ""  # a bad request's name
    expected: int | None = None
    error: str = ""


def check_json(spec: Spec, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if spec.schema is None:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, SCHEMAS[spec.schema])
    except jsonschema.ValidationError:
        return False
    return True


async def send_good(client: openai.AsyncOpenAI, spec: Spec, rec: Rec, t0: float) -> None:
    create = client.chat.completions.create if spec.endpoint == "chat" else client.completions.create
    params = dict(spec.params)
    extra = {}
    if spec.endpoint == "completions" and "response_format" in params:
        extra["response_format"] = params.pop("response_format")
    start = time.perf_counter()
    text = ""
    if spec.stream:
        stream = await create(model=spec.model, stream=True, stream_options={"include_usage": True},
                              extra_body=extra or None, **params)
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    rec.prompt_tokens = chunk.usage.prompt_tokens
                    rec.completion_tokens = chunk.usage.completion_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    rec.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                piece = choice.delta.content if spec.endpoint == "chat" else choice.text
                if piece:
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - start
                    text += piece
                    rec.chunks += 1
                rec.finish = choice.finish_reason or rec.finish
                if spec.cut_after and rec.chunks >= spec.cut_after:
                    rec.outcome = "cut"
                    break
        finally:
            await stream.close()  # a cut: the connection is closed mid-stream
    else:
        r = await create(model=spec.model, extra_body=extra or None, **params)
        rec.prompt_tokens, rec.completion_tokens = r.usage.prompt_tokens, r.usage.completion_tokens
        details = getattr(r.usage, "prompt_tokens_details", None)
        rec.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
        choice = r.choices[0]
        text = choice.message.content if spec.endpoint == "chat" else choice.text
        rec.finish = choice.finish_reason
    rec.latency = time.perf_counter() - start
    rec.status = 200
    rec.outcome = rec.outcome or "ok"
    if spec.kind in ("json_object", "json_schema") and rec.finish == "stop":
        rec.json_ok = check_json(spec, text or "")
        if not rec.json_ok:
            rec.error = f"invalid JSON: {text[:200]!r}"


async def send_bad(http: httpx.AsyncClient, spec: Spec, rec: Rec) -> None:
    name, path, body, expected = spec.bad
    rec.name, rec.expected = name, expected
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.perf_counter()
    r = await http.post(path, content=data, headers={"Content-Type": "application/json"})
    rec.latency = time.perf_counter() - start
    rec.status = r.status_code
    rec.outcome = "4xx" if 400 <= r.status_code < 500 else "5xx" if r.status_code >= 500 else "ok"
    if not 400 <= r.status_code < 500:
        rec.error = f"{name}: {r.status_code} {r.text[:200]}"


async def run_one(spec: Spec, rec: Rec, client: openai.AsyncOpenAI, http: httpx.AsyncClient, t0: float,
                  timeout: float) -> None:
    try:
        if spec.kind == "bad":
            await asyncio.wait_for(send_bad(http, spec, rec), timeout)
        elif spec.kind == "abandon":
            try:
                await asyncio.wait_for(send_good(client, spec, rec, t0), spec.abandon_s)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11
                rec.outcome, rec.latency = "cut", spec.abandon_s
        else:
            await asyncio.wait_for(send_good(client, spec, rec, t0), timeout)
    except openai.APIStatusError as err:
        rec.status = err.status_code
        rec.outcome = "5xx" if err.status_code >= 500 else "4xx"
        rec.error = f"{err.status_code}: {str(err)[:300]}"
    except (openai.APIConnectionError, asyncio.TimeoutError, httpx.TransportError) as err:
        rec.outcome, rec.error = "lost", f"{type(err).__name__}: {str(err)[:300]}"
    except openai.APIError as err:  # an error event inside a 200 stream
        rec.outcome, rec.error = "stream_error", f"{type(err).__name__}: {str(err)[:300]}"
    except Exception as err:  # noqa: BLE001 (anything else is a request lost, recorded with its error)
        rec.outcome, rec.error = "lost", f"{type(err).__name__}: {str(err)[:300]}"


# Watching the server ------------------------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            out["rss_mib"] = int(value.split()[0]) / 1024
        elif key == "Threads":
            out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    r = await http.get("/metrics")
    out = {}
    for line in r.text.splitlines():
        if line.startswith("griffin_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def quantiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return dict(n=len(xs), p50=float(p50), p90=float(p90), p99=float(p99), max=float(max(xs)))


def rss_fit(samples: list[dict[str, float]], duration: float, fraction: float) -> dict[str, Any]:
    """A linear fit of RSS over the second half of the run: slope (MiB/min), and whether it is flat."""
    half = [s for s in samples if s["t"] >= duration / 2]
    if len(half) < 3:
        return dict(slope_mib_per_min=None, flat=None)
    t = np.array([s["t"] / 60 for s in half])
    y = np.array([s["rss_mib"] for s in half])
    slope, intercept = np.polyfit(t, y, 1)
    # the same without the prefix cache's states (bounded by --prefix-cache-mb, and filling during the warm-up)
    slope_rest = np.polyfit(t, y - np.array([s["prefix_cache_mib"] for s in half]), 1)[0]
    span = t[-1] - t[0]
    mean = float(y.mean())
    growth = abs(slope) * span
    return dict(slope_mib_per_min=float(slope), slope_without_prefix_cache_mib_per_min=float(slope_rest),
                intercept_mib=float(intercept), fit_from_min=float(t[0]),
                fit_to_min=float(t[-1]), mean_mib=mean, growth_over_fit_mib=float(growth),
                threshold_mib=fraction * mean, threshold_mib_per_min=fraction * mean / max(span, 1e-9),
                flat=bool(growth <= fraction * mean), residual_std_mib=float(np.std(y - (slope * t + intercept))))


# The run ------------------------------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace, server: ServerProcess, texts: Texts, rng: random.Random) -> dict[str, Any]:
    from tqdm.auto import tqdm

    base_url = f"http://127.0.0.1:{server.port}"
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=args.request_timeout)
    http = httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout)
    mix = dict(item.split("=") for item in args.mix.split(","))
    kinds, weights = list(mix), [float(w) for w in mix.values()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"--mix: unknown kinds {sorted(unknown)} (kinds: {', '.join(KINDS)})")
    duration = args.minutes * 60
    recs: list[Rec] = []
    samples: list[dict[str, float]] = []
    tasks: set[asyncio.Task] = set()
    slots = asyncio.Semaphore(args.max_in_flight)
    pid = server.proc.pid
    waited_for_slot = 0

    before = await metrics(http)
    t0 = time.perf_counter()
    done = asyncio.Event()

    async def sampler() -> None:
        bar = tqdm(total=round(duration), unit="s", dynamic_ncols=True, desc="soak",
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s [{elapsed}<{remaining}] "
                              "{postfix}")
        last = -math.inf
        try:
            while True:
                now = time.perf_counter() - t0
                if now - last >= args.sample_s:
                    last = now
                    m = await metrics(http)
                    samples.append(dict(t=now, **proc_status(pid), in_flight=len(tasks),
                                        prefix_cache_mib=m.get("griffin_prefix_cache_bytes", 0) / 2**20,
                                        prefix_entries=m.get("griffin_prefix_cache_entries", 0),
                                        running=m.get("griffin_running_batch_size", 0),
                                        queued=m.get("griffin_queue_length", 0)))
                finished = [r for r in recs if r.outcome]
                errors = sum(r.outcome in ("5xx", "lost", "stream_error") for r in finished)
                bar.n = min(round(now), bar.total)
                bar.set_postfix_str(f"done {len(finished)} in-flight {len(tasks)} errors {errors} "
                                    f"RSS {samples[-1]['rss_mib']:.0f} MiB", refresh=False)
                bar.refresh()
                if done.is_set():
                    break
                await asyncio.sleep(1.0)
        finally:
            bar.close()

    sampling = asyncio.create_task(sampler())
    next_at = 0.0
    while True:
        next_at += rng.expovariate(args.rate)
        if next_at >= duration:
            break
        delay = next_at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        spec = make_spec(rng, texts, kinds, weights)
        if slots.locked():
            waited_for_slot += 1
        await slots.acquire()
        rec = Rec(spec.kind, spec.model if spec.kind != "bad" else "", spec.stream, time.perf_counter() - t0)
        recs.append(rec)
        task = asyncio.create_task(run_one(spec, rec, client, http, t0, args.request_timeout))
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
    sent_s = time.perf_counter() - t0
    # the end: wait for what is in flight, then anything still pending is lost
    if tasks:
        await asyncio.wait(set(tasks), timeout=args.drain_s)
    for task in list(tasks):
        task.cancel()
    for rec in recs:
        if not rec.outcome:
            rec.outcome, rec.error = "lost", f"no answer {args.drain_s:.0f} s after the run's end"
    wall = time.perf_counter() - t0
    # the server drains: nothing running, queued or prefilling once the clients are gone
    drained_s = None
    start = time.perf_counter()
    while time.perf_counter() - start < 60:
        m = await metrics(http)
        if not (m.get("griffin_running_batch_size") or m.get("griffin_queue_length")
                or m.get("griffin_prefilling_requests")):
            drained_s = time.perf_counter() - start
            break
        await asyncio.sleep(0.25)
    after = await metrics(http)
    done.set()
    await sampling
    # it still answers /health and a normal request
    health = await http.get("/health")
    final: dict[str, Any] = dict(health_status=health.status_code, health=health.json())
    try:
        r = await client.completions.create(model=BASE, prompt="def main():", max_tokens=8, temperature=0)
        final.update(request_ok=r.usage.completion_tokens == 8, request_text=r.choices[0].text)
    except Exception as err:  # noqa: BLE001 (recorded: the verdict fails)
        final.update(request_ok=False, request_error=f"{type(err).__name__}: {err}")
    await client.close()
    await http.aclose()
    return dict(recs=recs, samples=samples, before=before, after=after, wall_s=wall, sent_s=sent_s,
                drained_s=drained_s, final=final, waited_for_slot=waited_for_slot)


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    recs: list[Rec] = run["recs"]
    duration = args.minutes * 60
    out: dict[str, Any] = dict(requests=len(recs), wall_s=run["wall_s"], sent_s=run["sent_s"],
                               offered_rate=len(recs) / run["sent_s"], arrivals_that_waited_for_a_slot=run[
                                   "waited_for_slot"])
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    out["outcomes"] = outcomes
    statuses = [r.status for r in recs if r.status is not None]
    out["status_classes"] = {"2xx": sum(200 <= s < 300 for s in statuses), "4xx": sum(400 <= s < 500 for s in statuses),
                             "5xx": sum(s >= 500 for s in statuses)}
    good = [r for r in recs if r.kind != "bad"]
    bad = [r for r in recs if r.kind == "bad"]
    out["server_errors"] = sum(r.outcome in ("5xx", "stream_error") for r in recs)
    out["lost"] = sum(r.outcome == "lost" for r in recs)
    out["good_refused_4xx"] = sum(r.outcome == "4xx" for r in good)
    by_name: dict[str, dict[str, Any]] = {}
    for r in bad:
        row = by_name.setdefault(r.name, dict(sent=0, got_4xx=0, statuses={}, expected=r.expected))
        row["sent"] += 1
        row["got_4xx"] += r.status is not None and 400 <= r.status < 500
        row["statuses"][str(r.status)] = row["statuses"].get(str(r.status), 0) + 1
    out["bad_requests"] = dict(sent=len(bad), got_4xx=sum(r["got_4xx"] for r in by_name.values()),
                               expected_status=sum(r.status == r.expected for r in bad), by_name=by_name)
    kinds = {}
    for kind in KINDS:
        rs = [r for r in recs if r.kind == kind]
        if not rs:
            continue
        finished = [r for r in rs if r.outcome == "ok"]
        kinds[kind] = dict(sent=len(rs), ok=len(finished), cut=sum(r.outcome == "cut" for r in rs),
                           latency_s=quantiles([r.latency for r in finished if r.latency is not None]),
                           ttft_s=quantiles([r.ttft for r in finished if r.ttft is not None]),
                           completion_tokens=sum(r.completion_tokens for r in finished),
                           cached_tokens=sum(r.cached_tokens for r in finished),
                           prompt_tokens=sum(r.prompt_tokens for r in finished))
    out["kinds"] = kinds
    ok = [r for r in good if r.outcome == "ok"]
    out["all_good"] = dict(latency_s=quantiles([r.latency for r in ok if r.latency is not None]),
                           ttft_s=quantiles([r.ttft for r in ok if r.ttft is not None]))
    out["models"] = {m: sum(r.model == m for r in good) for m in MODELS}
    jsons = [r for r in good if r.kind in ("json_object", "json_schema") and r.outcome == "ok"]
    checked = [r for r in jsons if r.json_ok is not None]
    out["json"] = dict(answered=len(jsons), finished=len(checked), cut_by_max_tokens=sum(r.finish == "length"
                                                                                          for r in jsons),
                       valid=sum(bool(r.json_ok) for r in checked),
                       validity_rate=(sum(bool(r.json_ok) for r in checked) / len(checked)) if checked else None,
                       schema_finished=sum(r.kind == "json_schema" for r in checked),
                       schema_valid=sum(r.kind == "json_schema" and bool(r.json_ok) for r in checked))
    b, a = run["before"], run["after"]

    def delta(name: str) -> float:
        return a.get(name, 0.0) - b.get(name, 0.0)

    hits, misses = delta("griffin_prefix_cache_hits_total"), delta("griffin_prefix_cache_misses_total")
    received, computed = delta("griffin_prompt_tokens_total"), delta("griffin_prompt_tokens_computed_total")
    out["prefix"] = dict(hits=hits, misses=misses, hit_rate=hits / max(hits + misses, 1),
                         prompt_tokens=received, prompt_tokens_computed=computed,
                         prompt_tokens_from_cache=delta("griffin_prefix_cache_hit_tokens_total"),
                         computed_fraction=computed / max(received, 1),
                         entries_end=a.get("griffin_prefix_cache_entries"),
                         bytes_end_mib=a.get("griffin_prefix_cache_bytes", 0) / 2**20)
    generated = delta("griffin_generation_tokens_total")
    received_tokens = sum(r.completion_tokens for r in recs if r.outcome == "ok")
    cut = [r for r in recs if r.outcome == "cut"]
    out["cancellation"] = dict(server_generated_tokens=generated, tokens_received_by_clients=received_tokens,
                               cut_requests=len(cut),
                               # what the server generated for the cut requests (everything it generated but the
                               # answered requests' tokens), per cut request: a few tokens if it cancelled them
                               generated_per_cut_request=(generated - received_tokens) / max(len(cut), 1),
                               cut_max_tokens=800)
    samples = run["samples"]
    out["rss"] = dict(start_mib=samples[0]["rss_mib"], end_mib=samples[-1]["rss_mib"],
                      max_mib=max(s["rss_mib"] for s in samples), threads_start=samples[0]["threads"],
                      threads_end=samples[-1]["threads"], fds_start=samples[0]["fds"], fds_end=samples[-1]["fds"],
                      fds_max=max(s["fds"] for s in samples), **rss_fit(samples, duration, args.flat_fraction))
    out["drained_s"] = run["drained_s"]
    out["final"] = run["final"]
    out["errors"] = [dict(kind=r.kind, model=r.model, outcome=r.outcome, status=r.status, error=r.error)
                     for r in recs if r.outcome in ("5xx", "lost", "stream_error") or (r.kind != "bad"
                                                                                       and r.outcome == "4xx")
                     or r.json_ok is False][:50]
    # latency over time: windows of 30 s
    windows = []
    width = 30.0
    for k in range(math.ceil(duration / width)):
        rs = [r.latency for r in ok if k * width <= r.sent < (k + 1) * width and r.latency is not None]
        ts = [r.ttft for r in ok if k * width <= r.sent < (k + 1) * width and r.ttft is not None]
        if rs:
            windows.append(dict(t=(k + 0.5) * width, n=len(rs), latency_p50=float(np.percentile(rs, 50)),
                                latency_p99=float(np.percentile(rs, 99)),
                                ttft_p50=float(np.percentile(ts, 50)) if ts else None))
    out["windows"] = windows
    return out


def verdict(s: dict[str, Any], shutdown: dict[str, Any], judge_rss: bool) -> tuple[bool, str]:
    rss = s["rss"]
    if not judge_rss or rss["slope_mib_per_min"] is None:
        rss_check = (True, "RSS not judged (a run shorter than --judge-rss-minutes)")
    else:
        rss_check = (bool(rss["flat"]), f"RSS {'flat' if rss['flat'] else 'NOT flat'} "
                                        f"({rss['slope_mib_per_min']:+.2f} MiB/min)")
    checks = [
        (s["server_errors"] == 0, f"{s['server_errors']} 5xx/stream errors"),
        (s["lost"] == 0, f"{s['lost']} lost"),
        (s["bad_requests"]["got_4xx"] == s["bad_requests"]["sent"],
         f"{s['bad_requests']['got_4xx']}/{s['bad_requests']['sent']} bad requests got a 4xx"),
        (s["good_refused_4xx"] == 0, f"{s['good_refused_4xx']} good requests refused"),
        (s["json"]["valid"] == s["json"]["finished"], f"{s['json']['valid']}/{s['json']['finished']} JSON valid"),
        rss_check,
        (s["drained_s"] is not None, "drained" if s["drained_s"] is not None else "did not drain"),
        (s["final"]["health_status"] == 200 and s["final"]["request_ok"], "answers after"),
        (shutdown["clean"], f"{'clean' if shutdown['clean'] else 'NOT clean'} exit on SIGINT "
                            f"({shutdown['exit_code']})"),
        (shutdown["log_error_lines"] == 0, f"{shutdown['log_error_lines']} error lines in the server log"),
    ]
    ok = all(c for c, _ in checks)
    return ok, ("PASS: " if ok else "FAIL: ") + ", ".join(text for _, text in checks)


def shutdown(server: ServerProcess) -> dict[str, Any]:
    start = time.perf_counter()
    server.proc.send_signal(signal.SIGINT)
    killed = False
    try:
        code = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code, killed = server.proc.wait(), True
    seconds = time.perf_counter() - start
    server.log.seek(0)
    log = server.log.read()
    lines = log.splitlines()
    problems = [line for line in lines if "Traceback" in line or " ERROR " in line or "CRITICAL" in line]
    # clean: it exits by itself, with griffin's status for an interrupted command (uvicorn finishes its graceful
    # shutdown, then raises the SIGINT it caught again: 130 = 128 + SIGINT) or 0
    return dict(exit_code=code, seconds=seconds, killed=killed, clean=not killed and code in (0, 130),
                log_error_lines=len(problems), log_errors=problems[:20], log_tail=lines[-20:])


def plot(summary: dict[str, Any], samples: list[dict[str, float]], recs: list[Rec], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    t = [s["t"] / 60 for s in samples]
    ax1.plot(t, [s["rss_mib"] for s in samples], label="server RSS")
    fit = summary["rss"]
    if fit.get("slope_mib_per_min") is not None:
        xs = np.array([fit["fit_from_min"], fit["fit_to_min"]])
        ax1.plot(xs, fit["slope_mib_per_min"] * xs + fit["intercept_mib"], "k--",
                 label=f"fit over the second half: {fit['slope_mib_per_min']:+.2f} MiB/min")
    ax1.set_ylabel("RSS (MiB)")
    ax1b = ax1.twinx()
    ax1b.plot(t, [s["prefix_cache_mib"] for s in samples], color="tab:orange", alpha=0.7, label="prefix cache")
    ax1b.set_ylabel("prefix cache (MiB)", color="tab:orange")
    handles = ax1.get_legend_handles_labels()
    more = ax1b.get_legend_handles_labels()
    ax1.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right")
    ax1.set_title("griffin serve soak: memory, latency")
    colors = dict(zip(KINDS, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False))
    for kind in KINDS:
        rs = [r for r in recs if r.kind == kind and r.outcome == "ok" and r.latency is not None]
        if rs:
            ax2.scatter([r.sent / 60 for r in rs], [r.latency for r in rs], s=4, alpha=0.5, color=colors[kind],
                        label=kind)
            ts = [r for r in rs if r.ttft is not None]
            if ts:
                ax3.scatter([r.sent / 60 for r in ts], [r.ttft for r in ts], s=4, alpha=0.5, color=colors[kind],
                            label=kind)
    w = summary["windows"]
    ax2.plot([x["t"] / 60 for x in w], [x["latency_p50"] for x in w], "k-", label="p50 (30 s)")
    ax2.plot([x["t"] / 60 for x in w], [x["latency_p99"] for x in w], "k:", label="p99 (30 s)")
    ax2.set_yscale("log")
    ax2.set_ylabel("request latency (s)")
    ax2.legend(fontsize=7, ncol=3, markerscale=3)
    ax3.set_yscale("log")
    ax3.set_ylabel("time to first token (s, streams)")
    ax3.set_xlabel("minutes")
    ax3.legend(fontsize=7, ncol=3, markerscale=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def report(s: dict[str, Any], down: dict[str, Any]) -> str:
    def ms(q: dict[str, float] | None, key: str) -> str:
        return "-" if q is None else f"{1e3 * q[key]:.0f}"

    lines = [f"{s['requests']} requests in {s['wall_s'] / 60:.1f} min ({s['offered_rate']:.2f}/s sent): "
             f"{s['status_classes']}, outcomes {s['outcomes']}",
             "| kind | sent | ok | cut | p50 ms | p90 ms | p99 ms | TTFT p50 ms | TTFT p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, k in s["kinds"].items():
        lat, ttft = k["latency_s"], k["ttft_s"]
        lines.append(f"| {kind} | {k['sent']} | {k['ok']} | {k['cut']} | {ms(lat, 'p50')} | {ms(lat, 'p90')} | "
                     f"{ms(lat, 'p99')} | {ms(ttft, 'p50')} | {ms(ttft, 'p99')} |")
    g = s["all_good"]
    lines.append(f"| all good | | | | {ms(g['latency_s'], 'p50')} | {ms(g['latency_s'], 'p90')} | "
                 f"{ms(g['latency_s'], 'p99')} | {ms(g['ttft_s'], 'p50')} | {ms(g['ttft_s'], 'p99')} |")
    p, j, r, c = s["prefix"], s["json"], s["rss"], s["cancellation"]
    lines += [f"prefix cache: hit rate {p['hit_rate']:.1%} ({p['hits']:.0f}/{p['hits'] + p['misses']:.0f}), prompt "
              f"tokens computed {p['prompt_tokens_computed']:.0f} of {p['prompt_tokens']:.0f} "
              f"({p['computed_fraction']:.1%}), {p['bytes_end_mib']:.1f} MiB held at the end",
              f"JSON: {j['valid']}/{j['finished']} finished replies valid, {j['cut_by_max_tokens']} cut by max_tokens",
              f"bad requests: {s['bad_requests']['got_4xx']}/{s['bad_requests']['sent']} got a 4xx "
              f"({s['bad_requests']['expected_status']} the exact status expected)",
              f"cut requests: {c['cut_requests']}, tokens the server generated per cut request: "
              f"{c['generated_per_cut_request']:.1f} (of max_tokens {c['cut_max_tokens']})",
              f"RSS: {r['start_mib']:.0f} MiB at start, {r['end_mib']:.0f} at end, max {r['max_mib']:.0f}; slope over "
              f"the second half {r['slope_mib_per_min']:+.3f} MiB/min, "
              f"{r['slope_without_prefix_cache_mib_per_min']:+.3f} without the prefix cache's states (flat: growth "
              f"over the fit <= "
              f"{r['threshold_mib']:.1f} MiB, i.e. |slope| <= {r['threshold_mib_per_min']:.2f} MiB/min); threads "
              f"{r['threads_start']}->{r['threads_end']}, open files {r['fds_start']}->{r['fds_end']}"
              if r["slope_mib_per_min"] is not None else "RSS: too few samples",
              ("did not drain" if s["drained_s"] is None else f"drained in {s['drained_s']:.2f} s")
              + f"; /health {s['final']['health_status']}, normal request ok: "
              f"{s['final']['request_ok']}; SIGINT: exit {down['exit_code']} in {down['seconds']:.1f} s, "
              f"{down['log_error_lines']} error lines in the server log"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long requests are sent")
    p.add_argument("--rate", type=float, default=1.0, help="mean requests per second (Poisson arrivals)")
    p.add_argument("--max-in-flight", type=int, default=24, help="requests open at once (an arrival waits for one)")
    p.add_argument("--mix", default=DEFAULT_MIX, help="kind=weight,...: " + ", ".join(KINDS))
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--window", type=int, default=64, help="local-attention window (shorter than the prompts)")
    p.add_argument("--threads", type=int, default=2, help="griffin serve --threads")
    p.add_argument("--max-batch", type=int, default=16, help="griffin serve --max-batch-size")
    p.add_argument("--prefix-cache-mb", type=float, default=32.0, help="griffin serve --prefix-cache-mb")
    p.add_argument("--server-args", default="", help="more griffin serve flags, space-separated")
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds before a request counts as lost")
    p.add_argument("--drain-s", type=float, default=180.0, help="seconds the requests in flight get after the run")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--flat-fraction", type=float, default=0.01,
                   help="RSS is flat when the second half's fitted growth is at most this fraction of its mean")
    p.add_argument("--judge-rss-minutes", type=float, default=10.0,
                   help="runs at least this long must keep RSS flat to pass (shorter ones: reported, not judged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/serve_soak.json")
    p.add_argument("--figure", default="docs/figures/serve_soak.png", help="'' for none")
    args = p.parse_args(argv)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background (``cmd &`` ignores SIGINT, and the server would inherit that): give the server
        # SIGINT as a terminal does, so that its shutdown is the one measured (griffin's exit status 130)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    machine = machine_info(torch.device("cpu"))  # the load average before the run
    rng = random.Random(args.seed)
    texts = Texts(random.Random(args.seed + 1))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, adapters, model_info = make_checkpoints(args, Path(tmp))
        flags = ["--max-batch-size", str(args.max_batch), "--prefix-cache-mb", str(args.prefix_cache_mb),
                 "--max-tokens-limit", "1024", "--request-timeout", str(args.request_timeout), "--shutdown-grace",
                 "10", *(f for name, d in adapters.items() for f in ("--adapter", f"{name}={d}")),
                 *args.server_args.split()]
        server_started = time.perf_counter()
        server = ServerProcess(ckpt, *flags, threads=args.threads)
        startup_s = time.perf_counter() - server_started
        print(f"model: {model_info['parameters']:,} parameters, adapters {', '.join(ADAPTERS)}; server pid "
              f"{server.proc.pid} on port {server.port} (started in {startup_s:.1f} s); {args.minutes:g} min at "
              f"{args.rate:g} requests/s")
        try:
            run = asyncio.run(soak(args, server, texts, rng))
        finally:
            down = shutdown(server)
    summary = summarize(run, args)
    ok, line = verdict(summary, down, args.minutes >= args.judge_rss_minutes)
    print(report(summary, down))
    print(line)
    wall = time.perf_counter() - started
    results = dict(machine=machine, args=vars(args), model=model_info,
                   server=dict(flags=flags, threads=args.threads, startup_s=startup_s), script_wall_s=wall,
                   summary=summary,
                   shutdown=down, verdict=dict(ok=ok, line=line), samples=run["samples"])
    results["machine"]["load_average_end"] = os.getloadavg()
    write_json(args.out, results)
    if args.figure:
        plot(summary, run["samples"], run["recs"], Path(args.figure))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
