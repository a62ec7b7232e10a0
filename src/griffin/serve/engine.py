"""The serving engine (Section 5): one thread owns the model and runs continuous batching over a fixed-size cache.

- **Running batch.** A cache of ``max_batch`` rows; the active rows are kept in rows ``0 .. n-1`` and a decode step
  is one forward pass of all of them (a :class:`griffin.inference.Decoder` on a view of those rows), each row at its
  own position. A finished, cancelled or timed-out row frees its slot at once: the last active row moves into it.
- **Joining.** A new request is prefilled in a cache of its own (one row), in chunks of at most ``prefill_chunk``
  tokens, at most about ``prefill_chunk`` tokens per engine step, interleaved with the decode steps of the running
  rows (a long prompt does not stall them). Then its state is written into a free row (:meth:`Cache.insert`),
  ``n`` times for ``n`` choices, and its first token is sampled from the prefill's last logits.
- **Prefix states.** After the chunk that ends at one of the prompt's anchors (every multiple of ``prefix_block``
  tokens, the end of a chat message, the end of the prompt) the one-row state is kept in the
  :class:`griffin.serve.prefix_cache.PrefixCache`, a radix tree of ``prefix_block``-token blocks; a request starts
  from a copy of the state after its longest cached prefix, looked up when its prefill begins (so requests that
  arrive together find the states the one before them stored). Prompts are always split at their anchors (and every
  ``prefill_chunk`` tokens after one), cached or not, so the same prompt is cut at the same places from any cached
  anchor and a hit computes exactly what a cold request does. A state is stored at every block boundary: the block
  size is the trade-off (``cache.nbytes()`` per state and a forward pass per block against the prefix tokens a
  request may fail to reuse, at most B - 1).
- **LoRA adapters.** With ``adapters``, a request names one (or the base model) and the model run is a copy whose
  adapted layers add each row's low-rank term (:mod:`griffin.serve.adapters`): a prefill sets its one row's adapter,
  a decode step the adapter of every row of the batch, so rows on different adapters share a step. Prefix states are
  kept per adapter (the adapter's name is the prefix cache's namespace).

Requests come in through :meth:`Engine.submit` from any thread and come back as :class:`Update` objects through their
:class:`RequestHandle` (an asyncio queue, or a blocking one).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from griffin.cache import Cache
from griffin.data.tokenizer import Tokenizer
from griffin.inference import Decoder
from griffin.inference.cpu.linear import Int8PackLinear
from griffin.inference.cpu.prepack import PackedLinear
from griffin.inference.cpu.upcast import prefill_model
from griffin.inference.generate import decode_model
from griffin.model import CausalLM
from griffin.serve.adapters import AdapterSet, multi_lora_swapped
from griffin.serve.grammar import GrammarCompiler, RowGrammar
from griffin.serve.metrics import Histogram, Metrics
from griffin.serve.prefix_cache import PrefixCache
from griffin.serve.sampling import SamplingParams, TokenMask, choice_generator, sample_rows, token_logprobs
from griffin.serve.text import Detokenizer, StopMatcher

log = logging.getLogger("griffin.serve")

DEFAULT_PREFIX_BLOCK = 64  # tokens per prefix-cache block (docs/serving.md: the few-shot benchmark)


class EngineError(Exception):
    """A request the engine cannot take now."""


class QueueFull(EngineError):
    """The waiting queue is full: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(EngineError):
    """The engine is shutting down."""


class RequestFailed(EngineError):
    """A request the engine ended with an error (timed out, shut down, internal failure); ``status`` for HTTP."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class TokenLogprob:
    """A token, its log-probability under the model (None for a prompt's first token) and the most likely
    alternatives at its place."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ChoiceOutput:
    """What one choice of a request produced since its last update."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop, length, timeout, abort


@dataclass
class Update:
    """One message from the engine to a request: new output of some choices, the prompt's log-probabilities (once,
    first), or an error; ``done`` on the last."""

    choices: list[ChoiceOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int = 500  # with an error: 503 when the server is busy or closing (retry), 500 for a failure
    done: bool = False


@dataclass
class RequestOutput:
    """A whole request's output: every choice's tokens and text, the prompt's log-probabilities, the prompt tokens
    taken from the prefix cache."""

    choices: list[ChoiceOutput]
    prompt_logprobs: list[TokenLogprob] | None = None
    prefix_hit: int = 0

    def add(self, update: Update) -> None:
        """Merge an update into the output (raises :class:`RequestFailed` on an error update)."""
        if update.error:
            raise RequestFailed(update.error, update.status)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        for c in update.choices:
            out = self.choices[c.index]
            out.token_ids += c.token_ids
            out.text += c.text
            if c.logprobs is not None and out.logprobs is not None:
                out.logprobs += c.logprobs
            out.finish_reason = c.finish_reason or out.finish_reason


class RequestHandle:
    """A submitted request: read its updates (``async for`` or ``for``), ``cancel()`` it (its rows are freed at the
    next engine step)."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams, deadline: float | None,
                 loop: asyncio.AbstractEventLoop | None, adapter: str | None = None, adapter_index: int = -1) -> None:
        self.id = next(self._ids)
        self.prompt, self.params, self.deadline = prompt, params, deadline
        self.adapter, self.adapter_index = adapter, adapter_index  # the LoRA adapter's name and index (None, -1: base)
        self.arrival = time.monotonic()
        self.cancelled = False
        self.prefix_hit = 0  # prompt tokens taken from the prefix cache
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self._loop = loop
        self._aqueue: asyncio.Queue[Update] | None = asyncio.Queue() if loop is not None else None
        self._queue: queue.SimpleQueue[Update] = queue.SimpleQueue()
        self._open_choices = params.n

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, update: Update) -> None:
        """Hand an update to the reader (called by the engine thread)."""
        if self._aqueue is None:
            self._queue.put(update)
            return
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody reads any more
            self.cancelled = True

    async def updates(self) -> AsyncIterator[Update]:
        if self._aqueue is None:
            raise RuntimeError("this handle was submitted without an event loop: iterate it with `for`")
        while True:
            update = await self._aqueue.get()
            yield update
            if update.done:
                return

    def __iter__(self) -> Iterator[Update]:
        while True:
            update = self._queue.get()
            yield update
            if update.done:
                return


@dataclass
class _Job:
    """A request being prefilled in its own one-row cache."""

    handle: RequestHandle
    cache: Cache | None  # None until the job starts
    done: int  # prompt tokens already in the cache
    splits: list[int]  # where chunks end, ascending
    anchors: set[int]  # lengths whose state goes to the prefix cache
    logits: Tensor | None = None  # (1, V) of the last token in the cache
    started: bool = False  # the prefix cache was looked up (when the first chunk is due)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Seq:
    """One choice of a request, decoding in row ``row`` of the running batch."""

    handle: RequestHandle
    index: int
    row: int
    generator: torch.Generator | None
    detokenizer: Detokenizer | None
    stops: StopMatcher
    cached: int  # tokens in the row's cache
    grammar: RowGrammar | None = None  # the response_format's state for this choice (dropped with the row)
    last: int = -1  # the token to feed next
    generated: int = 0
    last_token_at: float = 0.0


def chunk_splits(length: int, start: int, anchors: Sequence[int], chunk: int) -> list[int]:
    """Where the chunks of a prompt of ``length`` tokens end when its first ``start`` are cached: at every anchor
    (boundary) and every ``chunk`` tokens after one, so the same prompt is cut at the same places from any anchor."""
    points = sorted({0, length, *(a for a in anchors if 0 < a < length)})
    out = []
    for a, b in itertools.pairwise(points):
        out += list(range(a + chunk, b, chunk)) + [b]
    return [p for p in out if p > start]


class Engine:
    """Continuous batching over one model (see the module docstring).

    Args:
        model: the model (its device and dtype are used as they are).
        tokenizer: for text (detokenization, stop sequences) and the EOS token; None: tokens only.
        max_batch: rows of the running batch.
        max_queue: requests waiting for a row beyond which :meth:`submit` raises :class:`QueueFull`.
        max_length: tokens a row holds (prompt + output) in a global-attention KV cache; ignored by models without
            global attention, whose state is bounded.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for.
        prefill_chunk: prompt tokens per forward pass and, about, per engine step.
        prefix_cache_bytes: budget of the prefix-state cache (0 disables it).
        prefix_block: tokens per block of the prefix cache: prompts are cut and their states kept at every multiple
            of it, so any shared prefix of at least one block is reused (0: only at message and prompt ends).
        compile: decode with the ``torch.compile``d step, for batch sizes rounded up to powers of two.
        prepack: prepacked CPU matmuls for the decode step (default: where oneDNN can); int8 models decode with the
            matvec kernel (:func:`griffin.inference.generate.decode_model`, made once here).
        request_timeout: seconds a request may take from its arrival (None: no limit).
        adapters: LoRA adapters served unmerged (:func:`griffin.serve.adapters.load_adapters`), chosen per request
            (:meth:`submit`'s ``adapter``); the engine then runs a copy of ``model`` whose adapted layers add each
            row's low-rank term (:func:`griffin.serve.adapters.multi_lora_swapped`), and keys the prefix cache by
            adapter.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None = None, *, max_batch: int = 32,
                 max_queue: int = 256, max_length: int | None = None, max_tokens_limit: int = 4096,
                 prefill_chunk: int = 512, prefix_cache_bytes: int = 256 << 20,
                 prefix_block: int = DEFAULT_PREFIX_BLOCK, compile: bool = False,
                 prepack: bool | None = None, request_timeout: float | None = 600.0,
                 metrics: Metrics | None = None, adapters: AdapterSet | None = None) -> None:
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk),
                            ("max_tokens_limit", max_tokens_limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if isinstance(prefix_block, bool) or not isinstance(prefix_block, int) or prefix_block < 0:
            raise ValueError(f"prefix_block={prefix_block!r} must be an integer >= 0 (tokens per prefix-cache block; "
                             f"0: states only at message and prompt ends)")
        self.adapters = adapters if adapters is not None and len(adapters) else None
        if self.adapters is not None and compile:
            raise ValueError("compile=True with LoRA adapters served unmerged is not supported: serve them without "
                             "--compile, or merge one adapter into the weights")
        self.model = model.eval() if self.adapters is None else multi_lora_swapped(model.eval(), self.adapters)
        self.adapter_rows = getattr(self.model, "adapter_rows", None)
        self.config = model.config
        self.tokenizer = tokenizer
        self.global_attention = "attention" in self.config.block_types
        if self.global_attention:
            if max_length is None or max_length < 2:
                raise ValueError(f"a model with global attention needs max_length >= 2 (the KV cache's tokens per "
                                 f"row), got {max_length!r}")
        self.max_length = max_length if self.global_attention else None
        self.max_batch, self.max_queue, self.max_tokens_limit = max_batch, max_queue, max_tokens_limit
        self.prefill_chunk, self.compile, self.request_timeout = prefill_chunk, compile, request_timeout
        self.eos_id = tokenizer.eos_id if tokenizer is not None else None
        self.device = model.device
        # the decode copy of the model (matvec kernel or prepacked matmuls), made once: every step reuses it
        self.step_model = decode_model(self.model, max_batch, prepack)
        # a step of one row: where the batch runs oneDNN's prepacked matmuls or PyTorch's int8 matmul, the matvec
        # kernel (decode_model's default at one row, several times faster there) in a second copy sharing the
        # weights; else the same model
        batched = any(isinstance(m, (PackedLinear, Int8PackLinear)) for m in self.step_model.modules())
        one_row = batched and prepack is None and not compile
        self.one_row_model = decode_model(self.model, 1) if one_row else self.step_model
        self.prefill_model = prefill_model(self.model)  # bfloat16 on a CPU without its matmul: float32 matmuls
        self.cache = model.init_cache(max_batch, self.max_length)
        self._decoders: dict[int, Decoder] = {}  # by batch size: see _decoder
        self.prefix_block = prefix_block
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block or DEFAULT_PREFIX_BLOCK)
        self.grammars = GrammarCompiler(tokenizer, self.config.vocab_size)  # response_format (llguidance, lazily)
        self.rows: list[_Seq] = []
        self.jobs: list[_Job] = []
        self.waiting: deque[RequestHandle] = deque()
        self.reserved = 0  # rows promised to jobs being prefilled
        self.shared_generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(7)))
        self.cond = threading.Condition()
        self.closing = False
        self.abort = False
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.metrics = metrics or Metrics()
        self._describe_metrics()

    # Public API -------------------------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="griffin-engine", daemon=True)
            self.thread.start()
        return self

    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or a ValueError naming what is wrong with the request."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens={params.max_tokens} is beyond this server's limit of "
                             f"{self.max_tokens_limit}")
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} is more than the running batch's {self.max_batch} rows")
        if self.max_length is not None and len(prompt) + params.max_tokens > self.max_length:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the {self.max_length} tokens of this model's global-attention KV cache "
                             f"(--max-length)")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids has {bad[0]}, outside the vocabulary [0, {vocab})")
        if params.response_format is not None:  # a GrammarError (a ValueError) for a schema that cannot compile
            self.grammars.compile(params.response_format)
        return prompt

    def adapter_index(self, adapter: str | None) -> int:
        """The index of the served LoRA adapter called ``adapter`` (-1 for None: the base model), or a ValueError
        naming it and the adapters served."""
        if adapter is None:
            return -1
        if self.adapters is None or adapter not in self.adapters.names:
            served = ", ".join(self.adapters.names) if self.adapters is not None else "none"
            raise ValueError(f"no LoRA adapter {adapter!r} is served (adapters: {served})")
        return self.adapters.index(adapter)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None, timeout: float | None = None,
               adapter: str | None = None) -> RequestHandle:
        """Queue a request (after :meth:`check`), on the served LoRA adapter called ``adapter`` (None: the base
        model). With ``loop``, read its updates with ``async for`` in that loop, else with ``for``. Raises
        :class:`QueueFull` or :class:`EngineClosed`."""
        prompt = self.check(prompt, params)
        index = self.adapter_index(adapter)
        if timeout is None or (self.request_timeout is not None and timeout > self.request_timeout):
            timeout = self.request_timeout  # a request may ask for less time than the server allows, not more
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = RequestHandle(prompt, params, deadline, loop, adapter, index)
        with self.cond:
            if self.closing:
                raise EngineClosed("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                self.metrics.inc("griffin_requests_rejected_total")
                ahead = len(self.waiting) + len(self.jobs) + len(self.rows)
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)",
                                retry_after=max(1, math.ceil(ahead / self.max_batch)))
            self.waiting.append(handle)
            self.cond.notify()
        self.metrics.inc("griffin_requests_total")
        return handle

    def generate(self, prompt: Sequence[int], params: SamplingParams, adapter: str | None = None) -> RequestOutput:
        """Submit and wait (from a thread other than the engine's): the merged output of every choice."""
        handle = self.submit(prompt, params, adapter=adapter)
        result = RequestOutput([ChoiceOutput(i, [], "", [] if params.logprobs is not None else None)
                                for i in range(params.n)])
        for update in handle:
            result.add(update)
        result.prefix_hit = handle.prefix_hit
        return result

    def stop(self, grace: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to ``grace`` seconds, then end the rest (finish
        reason ``abort``; queued requests get an error) and the engine thread."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        end = time.monotonic() + grace
        while self.busy() and time.monotonic() < end and self.thread is not None and self.thread.is_alive():
            time.sleep(0.02)
        with self.cond:
            self.abort = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def busy(self) -> bool:
        return bool(self.waiting or self.jobs or self.rows)

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.rows)

    def warmup(self) -> None:
        """Run a prefill and a decode step of one and of two rows on scratch caches (the first call of a kernel
        compiles it; one row and several decode through different kernels), and with
        ``compile`` compile the decode step at every batch size it will use; call before :meth:`start`."""
        sizes = {self._bucket(n) for n in range(1, self.max_batch + 1)} if self.compile else {1, min(2, self.max_batch)}
        for size in sorted(sizes):
            scratch = self.model.init_cache(size, self.max_length)
            self._set_adapters([-1] * size)
            with torch.no_grad():
                self.model(torch.zeros(size, 1, dtype=torch.long, device=self.device), cache=scratch)
                Decoder(self.one_row_model if size == 1 else self.step_model, scratch, compile=self.compile,
                        prepack=False, matvec=False)(
                    torch.zeros(size, dtype=torch.long, device=self.device))

    # The engine thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self.cond:
                    while not self.busy() and not self.closing:
                        self.cond.wait(timeout=0.5)
                    if self.abort or (self.closing and not self.busy()):
                        break
                try:
                    self.step()
                except Exception as err:  # a bug, not a bad request (those are refused by check): keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"internal error: {type(err).__name__}: {err}")
            self._fail_all("the server shut down before the request finished", reason="abort", status=503)

    def step(self) -> None:
        """One engine step: drop cancelled and expired requests, admit waiting ones, prefill about
        ``prefill_chunk`` prompt tokens, decode one token for every running row."""
        self._expire()
        self._admit()
        self._prefill()
        self._decode()
        self.steps += 1

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            waiting = list(self.waiting)
            self.waiting.clear()
            for handle in waiting:
                if handle.cancelled:
                    continue
                if handle.deadline is not None and now > handle.deadline:
                    self.metrics.inc("griffin_requests_timed_out_total")
                    handle.push(Update(error="the request timed out waiting for a slot", status=503, done=True))
                    continue
                self.waiting.append(handle)
        for job in list(self.jobs):
            h = job.handle
            if h.cancelled or (h.deadline is not None and now > h.deadline):
                self.jobs.remove(job)
                self.reserved -= self._rows_needed(h)
                if not h.cancelled:
                    self.metrics.inc("griffin_requests_timed_out_total")
                    h.push(Update(error="the request timed out before its prompt was read", status=503, done=True))
        ending = [s for s in self.rows
                  if s.handle.cancelled or (s.handle.deadline is not None and now > s.handle.deadline)]
        if ending:
            updates: dict[RequestHandle, list[ChoiceOutput]] = {}
            for seq in ending:
                reason = "abort" if seq.handle.cancelled else "timeout"
                if reason == "timeout":
                    self.metrics.inc("griffin_requests_timed_out_total")
                updates.setdefault(seq.handle, []).append(self._finish(seq, reason, ""))
            self._free({id(s) for s in ending})
            self._deliver(updates)

    def _rows_needed(self, handle: RequestHandle) -> int:
        return handle.params.n if handle.params.max_tokens > 0 else 0

    def _admit(self) -> None:
        while True:
            with self.cond:
                if not self.waiting:
                    return
                handle = self.waiting[0]
                need = self._rows_needed(handle)
                if len(self.rows) + self.reserved + need > self.max_batch:
                    return
                self.waiting.popleft()
            self.reserved += need
            self.jobs.append(self._new_job(handle))

    def _new_job(self, handle: RequestHandle) -> _Job:
        prompt, params = handle.prompt, handle.params
        anchors = {len(prompt), *params.boundaries}
        if self.prefix_block:
            anchors.update(range(self.prefix_block, len(prompt), self.prefix_block))
        return _Job(handle, None, 0, [], anchors)

    def _start_job(self, job: _Job) -> None:
        """Start a job (when its first chunk is due) from the state after its prompt's longest cached prefix, or
        from an empty cache."""
        handle, prompt = job.handle, job.handle.prompt
        entry = None
        if not handle.params.prompt_logprobs:
            entry = self.prefix_cache.lookup(prompt, namespace=handle.adapter)
        if entry is not None:
            job.cache, job.done, job.logits = entry.cache.copy(), entry.length, entry.logits[None]
            handle.prefix_hit = job.done
            self.metrics.inc("griffin_prefix_cache_hit_tokens_total", job.done)
        else:
            job.cache, job.done, job.logits = self.model.init_cache(1, self.max_length), 0, None
        job.splits = chunk_splits(len(prompt), job.done, sorted(job.anchors), self.prefill_chunk)
        job.started = True

    def _prefill(self) -> None:
        """Prefill chunks of the jobs, oldest first, until about ``prefill_chunk`` tokens are done. The next chunks of
        several jobs run in one forward pass when they are as long (their one-row caches side by side): the weight
        matmuls then see many rows at once, which is what makes prefill fast (Section 5)."""
        budget = self.prefill_chunk
        while self.jobs and budget > 0:
            group = self._prefill_group(budget)
            try:
                if any(job.splits for job in group):
                    budget -= self._prefill_chunks([job for job in group if job.splits])
            except Exception as err:
                log.exception("prefill failed")
                self._drop_jobs(group, f"internal error: {type(err).__name__}: {err}")
                continue
            for job in group:
                if job.splits:
                    continue
                self.jobs.remove(job)
                self.reserved -= self._rows_needed(job.handle)
                try:
                    self._join(job)
                except Exception as err:
                    log.exception("prefill failed")
                    job.handle.push(Update(error=f"internal error: {type(err).__name__}: {err}", done=True))

    def _prefill_group(self, budget: int) -> list[_Job]:
        """The jobs whose next chunks run together: the oldest job's, then those of the next jobs with chunks of the
        same length, up to about ``budget`` tokens. A job not started yet whose prompt begins with a state another
        job is still computing waits for it (it then starts from that state), so that requests arriving together
        share their prefix instead of computing it side by side."""
        group: list[_Job] = []
        length = 0
        for i, job in enumerate(self.jobs):
            if group and (len(group) + 1) * length > budget:
                break
            if not job.started:
                if group and any(self._waits_for(job, other) for other in self.jobs[:i]):
                    continue
                self._start_job(job)
            if not job.splits:  # the whole prompt was cached: nothing to compute
                if not group:
                    return [job]
                continue
            n = job.splits[0] - job.done
            logprobs = job.handle.params.prompt_logprobs
            if not group:
                group, length = [job], n
                if logprobs:
                    break
            elif n == length and not logprobs:
                group.append(job)
        return group

    def _waits_for(self, job: _Job, other: _Job) -> bool:
        """Whether ``job`` (not started) would start from a state that ``other`` (being prefilled) stores but has not
        computed yet: ``other``'s next anchor lies within their shared prefix, in the same adapter's namespace."""
        if not other.started or not other.splits or other.handle.params.prompt_logprobs \
                or other.handle.adapter != job.handle.adapter or job.handle.params.prompt_logprobs:
            return False
        pending = min((a for a in other.anchors if a > other.done), default=0)
        return 0 < pending <= len(job.handle.prompt) and job.handle.prompt[:pending] == other.handle.prompt[:pending]

    def _drop_jobs(self, jobs: list[_Job], message: str) -> None:
        for job in jobs:
            if job in self.jobs:
                self.jobs.remove(job)
                self.reserved -= self._rows_needed(job.handle)
            job.handle.push(Update(error=message, done=True))

    def _prefill_chunks(self, jobs: list[_Job]) -> int:
        """The next chunk of each job (all as long) in one forward pass; returns the tokens computed."""
        if len(jobs) == 1:
            return self._prefill_chunk(jobs[0])
        starts, ends = [job.done for job in jobs], [job.splits.pop(0) for job in jobs]
        ids = torch.tensor([job.handle.prompt[s:e] for job, s, e in zip(jobs, starts, ends, strict=True)],
                           dtype=torch.long, device=self.device)
        positions = torch.stack([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]).to(self.device)
        cache = Cache.cat([job.cache for job in jobs])
        self._set_adapters([job.handle.adapter_index for job in jobs])
        logits = self.prefill_model(ids, positions, cache=cache, logits_to_keep=1)[:, -1]
        cache.started = True
        for i, (job, end) in enumerate(zip(jobs, ends, strict=True)):
            job.cache = cache.select([i])
            self._chunk_done(job, logits[i : i + 1].float(), end)
        return sum(e - s for s, e in zip(starts, ends, strict=True))

    def _prefill_chunk(self, job: _Job) -> int:
        prompt, start, end = job.handle.prompt, job.done, job.splits.pop(0)
        ids = torch.tensor([prompt[start:end]], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        want_all = job.handle.params.prompt_logprobs
        self._set_adapters([job.handle.adapter_index])
        logits = self.prefill_model(ids, positions, cache=job.cache, logits_to_keep=None if want_all else 1)[0]
        job.cache.started = True
        if want_all:
            self._prompt_logprobs(job, logits, start, end)
        self._chunk_done(job, logits[-1:].float(), end)
        return end - start

    def _chunk_done(self, job: _Job, logits: Tensor, end: int) -> None:
        """Book a job's computed chunk (up to ``end``): its last logits, and its state at an anchor to the prefix
        cache."""
        prompt = job.handle.prompt
        self.metrics.inc("griffin_prompt_tokens_computed_total", end - job.done)
        job.logits, job.done = logits, end
        if end in job.anchors and not job.handle.params.prompt_logprobs:
            if not self.prefix_cache.contains(prompt[:end], namespace=job.handle.adapter):
                self.prefix_cache.store(prompt[:end], job.cache, job.logits[0], namespace=job.handle.adapter)

    def _prompt_logprobs(self, job: _Job, logits: Tensor, start: int, end: int) -> None:
        """The log-probability of each prompt token after the previous ones (none for the first)."""
        prompt, top = job.handle.prompt, job.handle.params.logprobs or 0
        if start == 0:
            job.prompt_logprobs.append(TokenLogprob(prompt[0], None, []))
        # row j of `preds` predicts prompt token max(start, 1) + j: the previous chunk's last logits come first
        preds = logits.float() if start == 0 else torch.cat([job.logits, logits.float()])
        targets = prompt[max(start, 1) : end]
        if not targets:
            return
        chosen, alts = token_logprobs(preds[: len(targets)], torch.tensor(targets), top)
        job.prompt_logprobs += [TokenLogprob(t, lp, a) for t, lp, a in zip(targets, chosen, alts, strict=True)]

    def _join(self, job: _Job) -> None:
        """A prefilled request: report its prompt log-probabilities, then put its choices into free rows and sample
        their first tokens."""
        handle, params = job.handle, job.handle.params
        self.metrics.inc("griffin_prompt_tokens_total", len(handle.prompt))
        if params.max_tokens == 0:
            handle.first_token_at = time.monotonic()
            choices = [ChoiceOutput(i, [], "", [] if params.logprobs is not None else None, "length")
                       for i in range(params.n)]
            handle.push(Update(choices, job.prompt_logprobs if params.prompt_logprobs else None, done=True))
            self._request_done(handle)
            return
        n, first = params.n, len(self.rows)
        self.cache.insert(list(range(first, first + n)), job.cache if n == 1 else job.cache.fork(n))
        seqs = []
        for i in range(n):
            detok = Detokenizer(self.tokenizer, handle.prompt) if self.tokenizer is not None else None
            grammar = self.grammars.row(params.response_format) if params.response_format is not None else None
            seq = _Seq(handle, i, first + i, choice_generator(params, i, self.device), detok,
                       StopMatcher(params.stop), cached=len(handle.prompt), grammar=grammar)
            self.rows.append(seq)
            seqs.append(seq)
        logits = job.logits.expand(n, -1)
        tokens = sample_rows(logits, [params] * n, [s.generator for s in seqs], self.shared_generator,
                             self._grammar_mask(seqs, logits.shape[-1]))
        self._deliver(self._emit(seqs, logits, tokens), {handle: job.prompt_logprobs} if params.prompt_logprobs
                      else None)

    def _set_adapters(self, indices: list[int]) -> None:
        """The LoRA adapter of each row of the next forward pass (-1: the base model), when adapters are served."""
        if self.adapter_rows is not None:
            self.adapter_rows.set(indices, self.device)

    def _bucket(self, n: int) -> int:
        """The decode batch for ``n`` active rows: ``n``, or the next power of two (at most max_batch) when
        compiled, so that few shapes are compiled."""
        if not self.compile:
            return n
        return min(self.max_batch, 1 << (n - 1).bit_length())

    def _decoder(self, size: int) -> Decoder:
        """The decode step over the running cache's first ``size`` rows, made once per size and reused: its view of
        the rows follows them in place (rows join and leave by :meth:`Cache.insert`), and making a
        :class:`Decoder` checks the cache and walks the model's modules, which cost as much as a small model's step."""
        decoder = self._decoders.get(size)
        if decoder is None:
            view = self.cache.map(lambda t: t[:size])
            view.started = True
            model = self.one_row_model if size == 1 else self.step_model
            decoder = Decoder(model, view, compile=self.compile, prepack=False, matvec=False)
            self._decoders[size] = decoder
        return decoder

    def _decode(self) -> None:
        n = len(self.rows)
        if n == 0:
            return
        start = time.perf_counter()
        size = self._bucket(n)
        tokens = torch.zeros(size, dtype=torch.long)
        tokens[:n] = torch.tensor([s.last for s in self.rows])
        decoder = self._decoder(size)
        view = decoder.cache
        view.length = max(s.cached for s in self.rows)
        if size > n and self.global_attention:  # padding rows of a compiled step: keep their KV counts in range
            for block in view.blocks:
                if hasattr(block, "count"):
                    block.count[n:].zero_()
        self._set_adapters([s.handle.adapter_index for s in self.rows] + [-1] * (size - n))
        logits = decoder(tokens.to(self.device))[:n]
        for s in self.rows:
            s.cached += 1
        rows = list(self.rows)
        sampled = sample_rows(logits, [s.handle.params for s in rows], [s.generator for s in rows],
                              self.shared_generator, self._grammar_mask(rows, logits.shape[-1]))
        updates = self._emit(rows, logits, sampled)
        self.metrics.observe("griffin_decode_step_seconds", time.perf_counter() - start)
        self.metrics.observe("griffin_decode_batch_size", n)
        self._deliver(updates)

    def _grammar_mask(self, seqs: list[_Seq], vocab: int) -> TokenMask | None:
        """The allowed tokens of the rows with a response_format grammar (None when there are none)."""
        pairs = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        if not pairs:
            return None
        start = time.perf_counter()
        mask = TokenMask([i for i, _ in pairs], self.grammars.mask(pairs, vocab, self.device))
        self.metrics.observe("griffin_grammar_mask_seconds", time.perf_counter() - start)
        return mask

    def _emit(self, seqs: list[_Seq], logits: Tensor, tokens: Tensor) -> dict[RequestHandle, list]:
        """Record each row's new token (text, stop sequences, log-probabilities), free the rows that finished, and
        return each request's outputs."""
        ids = tokens.tolist()
        want = [i for i, s in enumerate(seqs) if s.handle.params.logprobs is not None]
        lps: dict[int, TokenLogprob] = {}
        if want:
            top = max(seqs[i].handle.params.logprobs for i in want)
            chosen, alts = token_logprobs(logits[want], tokens[want], top)
            for j, i in enumerate(want):
                k = seqs[i].handle.params.logprobs
                lps[i] = TokenLogprob(ids[i], chosen[j], alts[j][:k])
        now = time.monotonic()
        updates: dict[RequestHandle, list] = {}
        finished = set()
        for i, (seq, token) in enumerate(zip(seqs, ids, strict=True)):
            out = self._advance(seq, token, lps.get(i), now)
            updates.setdefault(seq.handle, []).append(out)
            if out.finish_reason is not None:
                finished.add(id(seq))
        self.metrics.inc("griffin_generation_tokens_total", len(ids))
        self.metrics.tokens_generated(len(ids))
        if finished:
            self._free(finished)
        return updates

    def _advance(self, seq: _Seq, token: int, lp: TokenLogprob | None, now: float) -> ChoiceOutput:
        handle, params = seq.handle, seq.handle.params
        seq.last, seq.generated = token, seq.generated + 1
        handle.completion_tokens += 1
        if seq.generated == 1:
            if handle.first_token_at is None:
                handle.first_token_at = now
                self.metrics.observe("griffin_time_to_first_token_seconds", now - handle.arrival)
        else:
            self.metrics.observe("griffin_time_per_output_token_seconds", now - seq.last_token_at)
        seq.last_token_at = now
        stop_ids = set(params.stop_token_ids)
        if self.eos_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_id)
        reason = None
        if token in stop_ids:  # the stop token's own text is not shown
            text, reason = self._flush(seq)[0], "stop"
        else:
            delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
            text, hit = seq.stops.add(delta)
            if hit:
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.advance(token):  # the grammar is complete: only EOS next
                rest, _ = self._flush(seq)
                text, reason = text + rest, "stop"
            elif seq.generated >= params.max_tokens:
                rest, reason = self._flush(seq)
                text += rest
        return ChoiceOutput(seq.index, [token], text, None if lp is None else [lp], reason)

    def _flush(self, seq: _Seq) -> tuple[str, str]:
        """The text held back at the end of a choice, and its finish reason (``stop`` if it ends in a stop
        sequence)."""
        rest = seq.detokenizer.flush() if seq.detokenizer is not None else ""
        text, hit = seq.stops.add(rest)
        if hit:
            return text, "stop"
        return text + seq.stops.finish(), "length"

    def _finish(self, seq: _Seq, reason: str, text: str) -> ChoiceOutput:
        return ChoiceOutput(seq.index, [], text, None, reason)

    def _free(self, finished: set[int]) -> None:
        """Remove finished rows; the last active rows move into their slots, so the active rows stay ``0..n-1``."""
        alive = [s for s in self.rows if id(s) not in finished]
        moves = [(s.row, i) for i, s in enumerate(alive) if s.row != i]
        if moves:
            src, dst = zip(*moves, strict=True)
            self.cache.insert(list(dst), self.cache.select(list(src)))
        self.rows = alive
        for i, s in enumerate(self.rows):
            s.row = i

    def _deliver(self, updates: dict[RequestHandle, list],
                 prompt_logprobs: dict[RequestHandle, list[TokenLogprob]] | None = None) -> None:
        for handle, outputs in updates.items():
            choices = list(outputs)
            for c in choices:
                if c.finish_reason is not None:
                    handle._open_choices -= 1
            done = handle._open_choices <= 0
            handle.push(Update(choices, (prompt_logprobs or {}).get(handle), done=done))
            if done:
                self._request_done(handle)

    def _request_done(self, handle: RequestHandle) -> None:
        self.metrics.observe("griffin_request_seconds", time.monotonic() - handle.arrival)
        self.metrics.inc("griffin_requests_finished_total")

    def _fail_all(self, message: str, reason: str = "abort", status: int = 500) -> None:
        """End every request: running rows with ``reason``, prefilling and queued ones with an error."""
        updates: dict[RequestHandle, list] = {}
        for seq in self.rows:
            updates.setdefault(seq.handle, []).append(self._finish(seq, reason, ""))
        self.rows = []
        self._deliver(updates)
        for job in self.jobs:
            job.handle.push(Update(error=message, status=status, done=True))
        self.jobs, self.reserved = [], 0
        with self.cond:
            waiting = list(self.waiting)
            self.waiting.clear()
        for handle in waiting:
            handle.push(Update(error=message, status=status, done=True))

    # Metrics ----------------------------------------------------------------------------------------------------
    def _describe_metrics(self) -> None:
        m = self.metrics
        m.describe("griffin_requests_total", "counter", "Requests accepted into the queue.")
        m.describe("griffin_requests_finished_total", "counter", "Requests that finished.")
        m.describe("griffin_requests_rejected_total", "counter", "Requests refused because the queue was full.")
        m.describe("griffin_requests_timed_out_total", "counter", "Requests ended by their timeout.")
        m.describe("griffin_prompt_tokens_total", "counter", "Prompt tokens of the requests that joined the batch.")
        m.describe("griffin_prompt_tokens_computed_total", "counter",
                   "Prompt tokens run through the model (those not taken from the prefix cache).")
        m.describe("griffin_generation_tokens_total", "counter", "Tokens generated.")
        m.describe("griffin_prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from the prefix cache.")
        m.describe("griffin_time_to_first_token_seconds", "histogram", "From arrival to the first token.")
        m.describe("griffin_time_per_output_token_seconds", "histogram", "Between consecutive tokens of a choice.")
        m.describe("griffin_request_seconds", "histogram", "From arrival to the last token.")
        m.describe("griffin_decode_step_seconds", "histogram", "One decode step of the running batch.")
        m.describe("griffin_grammar_mask_seconds", "histogram",
                   "Computing the response_format token masks of one step (all grammar rows).")
        m.histograms["griffin_decode_batch_size"] = Histogram(tuple(float(1 << i) for i in range(11)))
        m.help["griffin_decode_batch_size"] = ("histogram", "Active rows per decode step.")
        m.gauge("griffin_queue_length", "Requests waiting for a slot.", lambda: len(self.waiting))
        m.gauge("griffin_running_batch_size", "Rows decoding now.", lambda: len(self.rows))
        m.gauge("griffin_prefilling_requests", "Requests whose prompt is being read.", lambda: len(self.jobs))
        m.gauge("griffin_max_batch", "Rows of the running batch.", lambda: self.max_batch)
        m.gauge("griffin_generation_tokens_per_second", "Tokens generated per second over the last 10 s.",
                m.tokens_per_second)
        pc = self.prefix_cache
        m.gauge("griffin_prefix_cache_hits_total", "Requests that started from a cached prefix state.",
                lambda: pc.hits, kind="counter")
        m.gauge("griffin_prefix_cache_misses_total", "Requests that found no cached prefix state.",
                lambda: pc.misses, kind="counter")
        m.gauge("griffin_prefix_cache_entries", "Prefix states held.", lambda: len(pc))
        m.gauge("griffin_prefix_cache_bytes", "Bytes of the prefix states held.", lambda: pc.nbytes)
