"""Load test of ``griffin serve`` on loopback (Section 5): continuous batching against HF transformers' ``generate``
one request at a time and against griffin's own static batching, on the same weights; and a multi-turn chat with and
without the prefix-state cache.

1. **Model.** A Griffin in RecurrentGemma's conventions (embeddings × √D, logits soft-capped, one gate block per head,
   no Conv1D document reset, D_RNN = D) over bytes, randomly initialised (seeded): saved as a griffin checkpoint for
   the server and exported to HF format (``griffin.interop.export_hf``), which transformers loads as
   ``RecurrentGemmaForCausalLM``. Their greedy tokens are compared first.
2. **Workload.** A pool of requests (seeded): a prompt of 16-512 bytes (log-uniform length) cut from the Python
   standard library's source, and 16-128 output tokens (uniform), greedy, no stop: every request produces exactly its
   number of tokens. Concurrency level c runs the pool's first ``max(16, 2c)`` requests (at most ``--requests``) with
   c clients, each sending its next request when the last one ends (closed loop).
3. **griffin serve** (``griffin serve CKPT --max-batch-size 64``, a subprocess): each request streamed through a small
   asyncio HTTP client (server-sent events), timed when it is sent, at its first text and at its end.
4. **HF, one request at a time**: each request of a subset through HF's own ``generate`` with a streamer that stamps
   every token. A server that runs one request at a time serves the c clients first come, first served: their latency
   is computed from these measured service times (a queue simulation), its throughput is the measured tokens/s.
5. **griffin static batching**: the same requests in groups of c through ``griffin.generate_stream`` (left-padded
   prompts, run until the group's longest output), in this process (no HTTP): a request's tokens are stamped as the
   group produces them, the next group starts when the previous one ends.
6. **Multi-turn chat**: one conversation (a long system prompt, then user turns with the replies kept in the
   history) against the server with its prefix cache and with ``--prefix-cache-mb 0``: time to first token against
   the prompt's length.
7. **Few-shot** (``--workloads fewshot`` runs it alone): a shared preamble of ``--fewshot-preamble`` tokens (bytes of
   the corpus) followed by each of ``--fewshot-questions`` distinct questions, greedy completions sent by
   ``--fewshot-concurrency`` closed-loop clients, against a server with block prefix states (``--prefix-block``, the
   server's default unless given) and one with ``--prefix-block 0`` (states only at prompt ends, which no other
   question extends): time to first token, prompt tokens computed (the server's
   ``griffin_prompt_tokens_computed_total``), and whether the two give the same outputs.

8. **Prefill bound**: prompt tokens/s of one 256-token forward pass, griffin's prefill and HF's; prefill is compute
   bound, so no batching makes it cheaper, and HF's measured time over the time griffin's prefill alone needs for the
   same prompts bounds serve/HF (a workload whose prompts outweigh its replies cannot batch its way past it).

Numbers: requests/s, output tokens/s, time to first token (TTFT), time per output token after the first (TPOT, per
request: (end - first token) / (tokens - 1)), request latency; medians over requests. Everything runs on this
machine: the server's threads, the client and the in-process peers share the CPU (the peers run while no server
does).

    python benchmarks/serve_load.py                     # about 10 minutes on 2 cores
    python benchmarks/serve_load.py --quick             # a smoke run (tests)
    python benchmarks/serve_load.py --workloads fewshot # the few-shot workload alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from griffin.config import ModelConfig
from griffin.data import default_corpus_files
from griffin.inference import Decoder, generate, generate_stream
from griffin.inference.cpu.upcast import prefill_model
from griffin.interop import export_hf, save_pretrained
from griffin.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, median_time, sync, table, write_json  # noqa: E402


# Model and workload -------------------------------------------------------------------------------------------------
def bench_config(args: argparse.Namespace) -> ModelConfig:
    """A byte-level Griffin that HF RecurrentGemma can express."""
    return ModelConfig(family="griffin", vocab_size=256, width=args.width, depth=args.depth, rnn_width=args.width,
                       num_heads=args.heads, head_dim=args.width // args.heads, num_kv_heads=1,
                       attention_window=args.window, gate_blocks=args.heads, embed_scale=True, logits_soft_cap=30.0,
                       conv1d_document_reset=False, name="griffin-serve-bench")


@dataclass
class Req:
    prompt: str
    max_tokens: int


def corpus_text(limit: int = 2_000_000) -> str:
    """Text of the standard library's source (the embedded corpus), ASCII only, in a fixed order."""
    out, size = [], 0
    for path in sorted(default_corpus_files())[:400]:
        text = Path(path).read_text(encoding="utf-8", errors="ignore").encode("ascii", "ignore").decode()
        out.append(text)
        size += len(text)
        if size > limit:
            break
    return "".join(out)


def make_pool(args: argparse.Namespace, text: str) -> list[Req]:
    rng = random.Random(args.seed)
    pool = []
    for _ in range(args.requests):
        n = int(math.exp(rng.uniform(math.log(args.prompt_min), math.log(args.prompt_max))))
        start = rng.randrange(0, len(text) - n)
        pool.append(Req(text[start : start + n], rng.randint(args.out_min, args.out_max)))
    return pool


# Timing records -----------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """One request: seconds from the level's start to when it was sent, its first token, its end; tokens out."""

    sent: float
    first: float
    end: float
    tokens: int
    cached: int = 0
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def latency(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / max(self.tokens - 1, 1)


def summarize(timings: list[Timing], wall: float) -> dict[str, float]:
    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    tokens = sum(t.tokens for t in timings)
    return dict(requests=len(timings), wall_s=wall, req_per_s=len(timings) / wall, tok_per_s=tokens / wall,
                ttft_med_s=statistics.median(t.ttft for t in timings), ttft_p90_s=q([t.ttft for t in timings], 0.9),
                tpot_med_ms=1e3 * statistics.median(t.tpot for t in timings),
                tpot_p90_ms=1e3 * q([t.tpot for t in timings], 0.9),
                latency_med_s=statistics.median(t.latency for t in timings),
                latency_p90_s=q([t.latency for t in timings], 0.9))


# A small asyncio HTTP client (streamed responses, server-sent events) ---------------------------------------------
async def post_events(port: int, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` and yield (time, event) for every server-sent event of the response (chunked encoding)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    status = (await reader.readline()).decode()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if " 200 " not in status:
        raise RuntimeError(f"{status.strip()}: {(await reader.read()).decode()[:500]}")
    buffer = b""
    try:
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buffer += await reader.readexactly(size)
            await reader.readline()
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.decode().removeprefix("data: ")
                if payload == "[DONE]":
                    return
                yield time.perf_counter(), json.loads(payload)
    finally:
        writer.close()


async def stream_request(port: int, path: str, body: dict[str, Any], t0: float) -> Timing:
    sent = time.perf_counter() - t0
    first, tokens, cached, text = None, 0, 0, ""
    async for when, event in post_events(port, path, {**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}):
        if "error" in event:
            raise RuntimeError(event["error"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
            cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        elif event["choices"] and (piece := event["choices"][0].get("text")
                                   or (event["choices"][0].get("delta") or {}).get("content")):
            first = when - t0 if first is None else first
            text += piece
    end = time.perf_counter() - t0
    return Timing(sent, end if first is None else first, end, tokens, cached, text)


async def closed_loop(port: int, requests: list[Req], concurrency: int) -> tuple[list[Timing], float]:
    """``concurrency`` clients, each sending the next request when its last one ends."""
    todo = list(enumerate(requests))
    out: list[Timing | None] = [None] * len(requests)
    t0 = time.perf_counter()

    async def client() -> None:
        while todo:
            i, req = todo.pop(0)
            body = {"model": "bench", "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0}
            out[i] = await stream_request(port, "/v1/completions", body, t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, time.perf_counter() - t0


# The server ---------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``griffin serve`` in a subprocess, ready when ``/v1/models`` answers."""

    def __init__(self, checkpoint: Path, *flags: str, threads: int) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "griffin.cli", "serve", str(checkpoint), "--port", str(self.port),
               "--served-model-name", "bench", "--threads", str(threads), "--log-level", "warning", *flags]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError(f"griffin serve did not start:\n{self.log.read()[-3000:]}") from None
                time.sleep(0.2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# Peers --------------------------------------------------------------------------------------------------------------
class Stamps:
    """A transformers streamer that stamps every ``put`` (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(hf: Any, requests: list[Req]) -> list[dict[str, float]]:
    """Each request alone through HF's ``generate``: service time, time to first token, tokens."""
    out = []
    for req in requests:
        ids = torch.tensor([list(req.prompt.encode())], device=hf.device)
        stamps = Stamps()
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=req.max_tokens,
                        min_new_tokens=req.max_tokens, streamer=stamps)
        end = time.perf_counter()
        out.append(dict(service=end - start, ttft=stamps.times[1] - start, tokens=req.max_tokens,
                        decode=(end - stamps.times[1]) / max(req.max_tokens - 1, 1)))
    return out


def simulate_one_at_a_time(services: list[dict[str, float]], n: int, concurrency: int) -> tuple[list[Timing], float]:
    """A server that runs one request at a time, first come first served, with ``concurrency`` closed-loop clients,
    on measured service times (request i takes the measured time of request i mod len(services))."""
    free_at = 0.0
    ready = [0.0] * concurrency  # when each client sends its next request
    out = []
    for i in range(n):
        s = services[i % len(services)]
        c = min(range(concurrency), key=lambda k: ready[k])
        sent = ready[c]
        start = max(sent, free_at)
        end = start + s["service"]
        out.append(Timing(sent, start + s["ttft"], end, int(s["tokens"])))
        free_at = ready[c] = end
    return out, free_at


def run_static(model: CausalLM, requests: list[Req], concurrency: int) -> tuple[list[Timing], float]:
    """Groups of ``concurrency`` requests, each group decoded until its longest output is done."""
    out: list[Timing] = []
    t0 = time.perf_counter()
    for g in range(0, len(requests), concurrency):
        group = requests[g : g + concurrency]
        # client j sent this request when its previous one (row j of the last group) ended
        sents = [0.0] * len(group) if g == 0 else [t.end for t in out[g - concurrency : g]]
        prompts = [list(r.prompt.encode()) for r in group]
        firsts: list[float | None] = [None] * len(group)
        ends: list[float | None] = [None] * len(group)
        steps = max(r.max_tokens for r in group)
        for step, _ in enumerate(generate_stream(model, prompts, steps, temperature=0)):
            now = time.perf_counter() - t0
            for j, r in enumerate(group):
                if step == 0:
                    firsts[j] = now
                if step == r.max_tokens - 1:
                    ends[j] = now
        out += [Timing(sent, f, e, r.max_tokens) for sent, f, e, r in zip(sents, firsts, ends, group, strict=True)]
    return out, time.perf_counter() - t0


def decode_step_ms(model: CausalLM, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median milliseconds of one decode step (what the server's running batch runs) of B rows, after 8 tokens."""
    out = {}
    for b in sizes:
        cache = model.init_cache(b)
        with torch.no_grad():
            model(torch.randint(0, 256, (b, 8), device=model.device), cache=cache)
        decoder, tokens = Decoder(model, cache), torch.zeros(b, dtype=torch.long, device=model.device)
        out[b] = 1e3 * median_time(lambda d=decoder, t=tokens: (d(t), sync(t.device)), repeats)
    return out


def prefill_tok_s(model: CausalLM, hf: Any, tokens: int, repeats: int) -> dict[str, float]:
    """Prompt tokens per second of one forward pass over ``tokens`` tokens: griffin's prefill (the model the server's
    prefill runs, :func:`griffin.inference.cpu.upcast.prefill_model`) and HF's forward pass, same weights."""
    ids = torch.randint(0, 256, (1, tokens), device=model.device)
    fast = prefill_model(model)
    with torch.no_grad():
        ours = median_time(lambda: (fast(ids, cache=model.init_cache(1), logits_to_keep=1), sync(ids.device)), repeats)
        theirs = median_time(lambda: (hf(ids), sync(ids.device)), repeats)
    return dict(tokens=tokens, griffin=tokens / ours, hf=tokens / theirs)


def prefill_bound(hf_services: list[dict[str, float]], requests: list[Req], tok_s: float) -> float:
    """The most serve/HF throughput could be on these requests if decoding cost nothing: HF's measured time over the
    time griffin's prefill alone needs for their prompts (prefill is compute bound, so batching does not shrink it)."""
    prompt_tokens = sum(len(r.prompt.encode()) for r in requests[: len(hf_services)])
    return sum(s["service"] for s in hf_services) / (prompt_tokens / tok_s)


# Multi-turn chat ----------------------------------------------------------------------------------------------------
async def chat_session(port: int, system: str, turns: list[str], max_tokens: int) -> list[dict[str, float]]:
    messages = [{"role": "system", "content": system}]
    out = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        reply, t0, first, usage = "", time.perf_counter(), None, {}
        async for when, event in post_events(port, "/v1/chat/completions",
                                             {**body, "stream": True, "stream_options": {"include_usage": True}}):
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"]:
                delta = event["choices"][0]["delta"].get("content") or ""
                if delta and first is None:
                    first = when
                reply += delta
        end = time.perf_counter()
        out.append(dict(prompt_tokens=usage["prompt_tokens"],
                        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        ttft_s=(first or end) - t0, latency_s=end - t0))
        messages.append({"role": "assistant", "content": reply})
    return out


# Few-shot: a shared preamble, distinct questions ------------------------------------------------------------------
def fewshot_requests(args: argparse.Namespace, text: str) -> list[Req]:
    """The preamble (the corpus' first bytes), then a distinct question (a snippet of 48-96 bytes from further on)
    per request."""
    preamble, rng = text[: args.fewshot_preamble], random.Random(args.seed + 1)
    out = []
    for i in range(args.fewshot_questions):
        n = rng.randint(48, 96)
        start = rng.randrange(args.fewshot_preamble, len(text) - n)
        question = f"\n# Question {i + 1}: {text[start : start + n]}\n# Answer:"
        out.append(Req(preamble + question, args.fewshot_max_tokens))
    return out


def server_metric(port: int, name: str) -> float:
    """One value of the server's ``/metrics``."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} is not in /metrics")


def run_fewshot(checkpoint: Path, text: str, args: argparse.Namespace) -> dict[str, Any]:
    """The few-shot requests against a server with block prefix states and one without (``--prefix-block 0``)."""
    requests = fewshot_requests(args, text)
    placement = ["--device", getattr(args, "device", "cpu"), "--dtype", getattr(args, "dtype", "float32")]
    out: dict[str, Any] = {}
    texts = {}
    for key, block in (("blocks", args.prefix_block), ("no_blocks", 0)):
        flags = ["--max-batch-size", str(args.max_batch), *placement]
        flags += [] if block is None else ["--prefix-block", str(block)]
        server = ServerProcess(checkpoint, *flags, threads=args.threads)
        try:
            asyncio.run(closed_loop(server.port, [Req(text[-300:], 2)], 1))  # warm-up: shares nothing
            before = server_metric(server.port, "griffin_prompt_tokens_computed_total")
            timings, wall = asyncio.run(closed_loop(server.port, requests, args.fewshot_concurrency))
            computed = server_metric(server.port, "griffin_prompt_tokens_computed_total") - before
        finally:
            server.close()
        texts[key] = [t.text for t in timings]
        out[key] = dict(prefix_block=block, prompt_tokens=sum(len(r.prompt.encode()) for r in requests),
                        prompt_tokens_computed=computed, cached_tokens=sum(t.cached for t in timings),
                        ttft_med_s=statistics.median(t.ttft for t in timings),
                        ttft_first_s=timings[0].ttft, ttft_after_first_med_s=statistics.median(
                            t.ttft for t in timings[1:]) if len(timings) > 1 else timings[0].ttft,
                        latency_med_s=statistics.median(t.latency for t in timings), wall_s=wall)
        print(f"few-shot, --prefix-block {'default' if block is None else block}: {computed:.0f} prompt tokens "
              f"computed, median TTFT {1e3 * out[key]['ttft_med_s']:.0f} ms")
    out.update(requests=len(requests), preamble_tokens=args.fewshot_preamble, concurrency=args.fewshot_concurrency,
               equal_outputs=texts["blocks"] == texts["no_blocks"],
               computed_ratio=out["no_blocks"]["prompt_tokens_computed"] / max(out["blocks"]["prompt_tokens_computed"],
                                                                                1),
               ttft_med_ratio=out["no_blocks"]["ttft_med_s"] / out["blocks"]["ttft_med_s"])
    return out


def fewshot_table(fewshot: dict[str, Any]) -> str:
    rows = [dict(what=what, a=a, b=b, ratio=b / max(a, 1e-12)) for what, a, b in (
        ("prompt tokens computed", fewshot["blocks"]["prompt_tokens_computed"],
         fewshot["no_blocks"]["prompt_tokens_computed"]),
        ("median TTFT (ms)", 1e3 * fewshot["blocks"]["ttft_med_s"], 1e3 * fewshot["no_blocks"]["ttft_med_s"]),
        ("first request's TTFT (ms)", 1e3 * fewshot["blocks"]["ttft_first_s"],
         1e3 * fewshot["no_blocks"]["ttft_first_s"]),
        ("median latency (ms)", 1e3 * fewshot["blocks"]["latency_med_s"], 1e3 * fewshot["no_blocks"]["latency_med_s"]),
        ("wall (s)", fewshot["blocks"]["wall_s"], fewshot["no_blocks"]["wall_s"]))]
    block = fewshot["blocks"]["prefix_block"]
    return (f"few-shot: {fewshot['requests']} questions after a {fewshot['preamble_tokens']}-token preamble, "
            f"{fewshot['concurrency']} clients; equal outputs: {fewshot['equal_outputs']}\n"
            + table(rows, [("", "what", "s"), (f"block states ({'default' if block is None else block})", "a", ".1f"),
                           ("--prefix-block 0", "b", ".1f"), ("ratio", "ratio", ".1f")]))


# Main ---------------------------------------------------------------------------------------------------------------
@dataclass
class Results:
    machine: dict[str, Any]
    args: dict[str, Any]
    model: dict[str, Any]
    levels: list[dict[str, Any]] = field(default_factory=list)
    hf_alone: dict[str, float] = field(default_factory=dict)
    decode_step_ms: dict[int, float] = field(default_factory=dict)
    prefill_tok_s: dict[str, float] = field(default_factory=dict)
    prefill_bound_vs_hf: float = math.nan
    chat: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    fewshot: dict[str, Any] = field(default_factory=dict)


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    levels = results.levels
    cs = [r["concurrency"] for r in levels]
    for key, name, style in (("serve", "griffin serve (continuous)", "o-"), ("static", "griffin static batching",
                                                                              "s--"),
                             ("hf", "HF generate, one at a time", "^:")):
        if any(r[key] is None for r in levels):  # --no-static
            continue
        axes[0].plot(cs, [r[key]["tok_per_s"] for r in levels], style, label=name)
        axes[1].plot(cs, [r[key]["latency_med_s"] for r in levels], style, label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="output tokens/s",
                title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="median request latency (s)",
                title="latency (queueing included)")
    for ax in axes[:2]:
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend(fontsize=8)
    for key, name, style in (("cache", "prefix cache on", "o-"), ("no_cache", "prefix cache off", "s--")):
        turns = results.chat.get(key, [])
        axes[2].plot([t["prompt_tokens"] for t in turns], [1e3 * t["ttft_s"] for t in turns], style, label=name)
    axes[2].set(xlabel="prompt tokens (conversation so far)", ylabel="time to first token (ms)",
                title="multi-turn chat")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests", type=int, default=128, help="size of the request pool (the most a level runs)")
    p.add_argument("--hf-requests", type=int, default=24, help="requests timed through HF (one at a time)")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--out-min", type=int, default=16)
    p.add_argument("--out-max", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=64, help="griffin serve --max-batch-size")
    p.add_argument("--chat-system", type=int, default=1500, help="bytes of the chat's system prompt")
    p.add_argument("--chat-turns", type=int, default=10)
    p.add_argument("--chat-turn-bytes", type=int, default=300)
    p.add_argument("--chat-max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of the peers")
    p.add_argument("--device", default="cpu", help="torch device of the server and of the peers")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights' dtype for the server and the peers")
    p.add_argument("--quantize", choices=("int8",), default=None,
                   help="griffin serve --quantize: the server's weights in int8 (the peers keep --dtype)")
    p.add_argument("--compile", action="store_true",
                   help="griffin serve --compile: the decode step compiled per batch bucket (CUDA graphs on a GPU)")
    p.add_argument("--no-chat", action="store_true", help="leave out the multi-turn chat of the load workload")
    p.add_argument("--no-static", action="store_true", help="leave out griffin's static batching (in-process)")
    p.add_argument("--workloads", nargs="+", choices=("load", "fewshot"), default=["load", "fewshot"],
                   help="load: the concurrency levels against HF and static batching, and the chat; fewshot: a "
                        "shared preamble with distinct questions, with and without block prefix states")
    p.add_argument("--fewshot-preamble", type=int, default=2000, help="tokens (bytes) of the shared preamble")
    p.add_argument("--fewshot-questions", type=int, default=64)
    p.add_argument("--fewshot-max-tokens", type=int, default=16)
    p.add_argument("--fewshot-concurrency", type=int, default=1, help="closed-loop clients of the few-shot workload")
    p.add_argument("--prefix-block", type=int, default=None,
                   help="griffin serve --prefix-block of the few-shot run with block states (default: the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny model and workload (a smoke test)")
    p.add_argument("--out", default="benchmarks/results/serve_load.json")
    p.add_argument("--figure", default="docs/figures/serve_load.png", help="'' for none")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.heads, args.window = 32, 3, 2, 8
        args.concurrency, args.requests, args.hf_requests = [1, 4], 8, 3
        args.prompt_max, args.out_min, args.out_max, args.max_batch = 40, 4, 12, 4
        args.chat_system, args.chat_turns, args.chat_turn_bytes, args.chat_max_tokens = 100, 3, 40, 4
        args.fewshot_preamble, args.fewshot_questions, args.fewshot_max_tokens = 300, 6, 4
    torch.set_num_threads(args.threads)
    import transformers

    config = bench_config(args)
    torch.manual_seed(args.seed)
    model = CausalLM(config).eval()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = Results(machine_info(device), vars(args),
                      dict(config=config.to_dict(), parameters=model.num_parameters()))
    text = corpus_text()
    pool = make_pool(args, text)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, hf_dir = Path(tmp) / "griffin", Path(tmp) / "hf"
        save_pretrained(model, ckpt)
        if "fewshot" in args.workloads:
            results.fewshot = run_fewshot(ckpt, text, args)
        if "load" not in args.workloads:
            print(fewshot_table(results.fewshot))
            write_json(args.out, asdict(results))
            return 0
        export_hf(model, hf_dir)
        hf = transformers.RecurrentGemmaForCausalLM.from_pretrained(hf_dir).eval().to(device, dtype)
        model.to(device, dtype)
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        probe = list(pool[0].prompt.encode())
        ours = generate(model, [probe], 24, temperature=0)[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([probe], device=device), do_sample=False, max_new_tokens=24,
                                 min_new_tokens=24)
        agreement = sum(a == b for a, b in zip(ours, theirs[0, len(probe):].tolist(), strict=True)) / 24
        results.model["hf_greedy_agreement"] = agreement
        print(f"model: {model.num_parameters():,} parameters; HF greedy tokens agree with griffin's: "
              f"{agreement:.0%}")

        # griffin serve: every concurrency level, then the chat with the prefix cache
        placement = ("--device", args.device, "--dtype", args.dtype,
                     *(("--quantize", args.quantize) if args.quantize else ()),
                     *(("--compile",) if args.compile else ()))
        server = ServerProcess(ckpt, "--max-batch-size", str(args.max_batch), *placement, threads=args.threads)
        serve_runs = {}
        try:
            asyncio.run(closed_loop(server.port, pool[:4], 4))  # warm-up
            for c in args.concurrency:
                n = min(len(pool), max(16, 2 * c)) if not args.quick else len(pool)
                timings, wall = asyncio.run(closed_loop(server.port, pool[:n], c))
                serve_runs[c] = summarize(timings, wall)
                print(f"serve c={c}: {serve_runs[c]['tok_per_s']:.0f} tok/s, median latency "
                      f"{serve_runs[c]['latency_med_s']:.2f} s, TTFT {serve_runs[c]['ttft_med_s'] * 1e3:.0f} ms, "
                      f"TPOT {serve_runs[c]['tpot_med_ms']:.1f} ms")
            system = text[:args.chat_system]
            turns = [text[10_000 + i * args.chat_turn_bytes : 10_000 + (i + 1) * args.chat_turn_bytes]
                     for i in range(args.chat_turns)]
            if not args.no_chat:
                results.chat["cache"] = asyncio.run(chat_session(server.port, system, turns, args.chat_max_tokens))
        finally:
            server.close()
        if not args.no_chat:
            server = ServerProcess(ckpt, "--max-batch-size", str(args.max_batch), "--prefix-cache-mb", "0",
                                   *placement, threads=args.threads)
            try:
                asyncio.run(chat_session(server.port, text[:64], turns[:1], 2))  # warm-up
                results.chat["no_cache"] = asyncio.run(chat_session(server.port, system, turns,
                                                                    args.chat_max_tokens))
            finally:
                server.close()

        # the peers, in this process, while no server runs
        hf_services = run_hf(hf, pool[: args.hf_requests])
        hf_tokens = sum(s["tokens"] for s in hf_services)
        hf_time = sum(s["service"] for s in hf_services)
        results.hf_alone = dict(requests=len(hf_services), tok_per_s=hf_tokens / hf_time,
                                ttft_med_s=statistics.median(s["ttft"] for s in hf_services),
                                tpot_med_ms=1e3 * statistics.median(s["decode"] for s in hf_services),
                                latency_med_s=statistics.median(s["service"] for s in hf_services))
        print(f"HF alone: {results.hf_alone['tok_per_s']:.0f} tok/s, median service "
              f"{results.hf_alone['latency_med_s']:.2f} s")
        generate(model, [probe], 4, temperature=0)  # warm-up
        results.decode_step_ms = decode_step_ms(model, sorted({1, *args.concurrency}), 5 if args.quick else 30)
        print("decode step ms by batch: " + ", ".join(f"B={b}: {t:.2f}" for b, t in results.decode_step_ms.items()))
        results.prefill_tok_s = rates = prefill_tok_s(model, hf, 64 if args.quick else 256, 1)
        results.prefill_bound_vs_hf = prefill_bound(hf_services, pool, rates["griffin"])
        print(f"prefill tokens/s: griffin {rates['griffin']:.0f}, HF {rates['hf']:.0f}; serve/HF can be at most "
              f"{results.prefill_bound_vs_hf:.1f}x on these requests (prefill alone)")
        for c in args.concurrency:
            n = min(len(pool), max(16, 2 * c)) if not args.quick else len(pool)
            static = None if args.no_static else summarize(*run_static(model, pool[:n], c))
            hf_timings, hf_wall = simulate_one_at_a_time(hf_services, n, c)
            hf_row = summarize(hf_timings, hf_wall)
            hf_row["tok_per_s"] = results.hf_alone["tok_per_s"]  # measured, not simulated
            hf_row["req_per_s"] = len(hf_services) / hf_time
            row = dict(concurrency=c, serve=serve_runs[c], static=static, hf=hf_row)
            row["throughput_vs_hf"] = row["serve"]["tok_per_s"] / hf_row["tok_per_s"]
            row["throughput_vs_static"] = row["serve"]["tok_per_s"] / static["tok_per_s"] if static else math.nan
            results.levels.append(row)

    results.machine["load_average_end"] = os.getloadavg()
    cols = [("c", "concurrency", "d"), ("serve tok/s", "serve_tok", ".0f"), ("static tok/s", "static_tok", ".0f"),
            ("HF tok/s", "hf_tok", ".0f"), ("serve/HF", "throughput_vs_hf", ".1f"),
            ("serve/static", "throughput_vs_static", ".2f"), ("serve lat s", "serve_lat", ".2f"),
            ("static lat s", "static_lat", ".2f"), ("HF lat s", "hf_lat", ".2f"),
            ("serve TTFT ms", "serve_ttft", ".0f"), ("serve TPOT ms", "serve_tpot", ".1f"),
            ("HF TPOT ms", "hf_tpot", ".1f")]
    none = dict(tok_per_s=math.nan, latency_med_s=math.nan)
    flat = [dict(concurrency=r["concurrency"], serve_tok=r["serve"]["tok_per_s"],
                 static_tok=(r["static"] or none)["tok_per_s"],
                 hf_tok=r["hf"]["tok_per_s"], throughput_vs_hf=r["throughput_vs_hf"],
                 throughput_vs_static=r["throughput_vs_static"], serve_lat=r["serve"]["latency_med_s"],
                 static_lat=(r["static"] or none)["latency_med_s"], hf_lat=r["hf"]["latency_med_s"],
                 serve_ttft=1e3 * r["serve"]["ttft_med_s"], serve_tpot=r["serve"]["tpot_med_ms"],
                 hf_tpot=r["hf"]["tpot_med_ms"]) for r in results.levels]
    print(table(flat, cols))
    if results.chat:
        chat_rows = [dict(turn=i + 1, tokens=a["prompt_tokens"], cached=a["cached_tokens"], on=1e3 * a["ttft_s"],
                          off=1e3 * b["ttft_s"])
                     for i, (a, b) in enumerate(zip(results.chat["cache"], results.chat["no_cache"], strict=True))]
        print(table(chat_rows, [("turn", "turn", "d"), ("prompt tokens", "tokens", "d"), ("cached", "cached", "d"),
                                ("TTFT cache on ms", "on", ".0f"), ("TTFT cache off ms", "off", ".0f")]))
    if results.fewshot:
        print(fewshot_table(results.fewshot))
    write_json(args.out, asdict(results))
    if args.figure:
        plot(results, Path(args.figure))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops its server (finally blocks)
    sys.exit(main())
