"""Prefill and decode with bounded caches, and sampling (Section 5).

A batch of prompts is left-padded (padding tokens carry position -1 and are seen by nothing), processed in
parallel in chunks so that a long prompt runs in bounded memory, then tokens are sampled one step at a time by a
:class:`Decoder`: each step is the model's own forward pass on one token per row, with the cache updated in place;
the decoder checks the cache once, swaps in fast matmuls and fused blocks on CPU and can ``torch.compile`` the step
(CUDA graphs on GPU). The one host sync per step is the caller's: the sampled tokens are handed over as Python ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from griffin.cache import Cache
from griffin.inference.cpu.fused import FusedResidualBlock, fused_step_swapped
from griffin.inference.cpu.linear import Int8PackLinear, MatvecLinear, int8pack_for, matvec_swapped
from griffin.inference.cpu.prepack import PackedLinear, can_prepack, prepacked
from griffin.inference.cpu.upcast import prefill_model
from griffin.model import CausalLM
from griffin.quantize import quantization_of

Prompts = Tensor | Sequence[Sequence[int]] | Sequence[int]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                   seed: int | None = None) -> None:
    """Raise a ValueError naming the first sampling argument that is out of range."""
    if not _is_token(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0 is greedy)")
    if not _is_token(top_k) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 disables it)")
    if not isinstance(top_p, (int, float)) or math.isnan(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1]")
    if seed is not None and not _is_token(seed):
        raise ValueError(f"seed={seed!r} must be an integer or None")


def sample(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> Tensor:
    """Next tokens (B,) from logits (B, V): greedy at temperature 0, else softmax(logits / T) restricted to the
    top_k most likely tokens and to the smallest set whose probability reaches top_p."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is complete
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _is_token(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_rows(prompts: Prompts) -> list[list[int]]:
    """Prompts as lists of Python ints: an integer tensor (B, T) or (T,), a list of token lists, or one token list."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts must be token ids, got text {prompts[:40]!r}: encode it with a tokenizer first "
                        "(griffin.data.tokenizer.load_tokenizer(...).encode)")
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be a (batch, time) tensor, got shape {tuple(prompts.shape)}")
        if prompts.dtype.is_floating_point or prompts.dtype.is_complex or prompts.dtype == torch.bool:
            raise TypeError(f"prompt token ids must be integers, got {prompts.dtype}")
        return [list(map(int, row)) for row in prompts.tolist()]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token lists or an integer tensor, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(_is_token(t) for t in prompts):
        prompts = [prompts]
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, Tensor):
            row = row.tolist() if not (row.dtype.is_floating_point or row.dtype == torch.bool) else [row]
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"prompt {i} is not a list of token ids: {row!r}")
        bad = [t for t in row if not _is_token(t)]
        if bad:
            raise TypeError(f"prompt {i} has {bad[0]!r}, which is not a token id (an int)")
        rows.append([int(t) for t in row])
    return rows


def check_stops(stop_tokens: Sequence[int], vocab_size: int) -> set[int]:
    """The stop tokens as a set, or a ValueError naming the first one that is not a token id of the vocabulary."""
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (Sequence, set, frozenset)):
        raise ValueError(f"stop_tokens={stop_tokens!r} must be a list of token ids")
    for t in stop_tokens:
        if not _is_token(t) or not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t!r} is not a token id in [0, {vocab_size})")
    return {int(t) for t in stop_tokens}


def _check_prompts(model: CausalLM, rows: list[list[int]], cache: Cache | None) -> None:
    if not rows:
        raise ValueError("no prompts given (an empty prompt list)")
    vocab = model.config.vocab_size
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. a BOS token)")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
    if cache is not None:
        model.check_cache(cache, len(rows))
        if len({len(r) for r in rows}) > 1:
            raise ValueError("continuing from a cache needs prompts of equal length, got lengths "
                             f"{sorted({len(r) for r in rows})}")


def _check_sizes(chunk_size: int, max_length: int | None) -> None:
    if not _is_token(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
    if max_length is not None and (not _is_token(max_length) or max_length < 1):
        raise ValueError(f"max_length={max_length!r} must be a positive integer or None")


@torch.no_grad()
def prefill(model: CausalLM, prompts: Prompts, cache: Cache | None = None, max_length: int | None = None,
            chunk_size: int = 1024) -> tuple[Tensor, Cache]:
    """Process prompts in chunks of ``chunk_size`` tokens. Returns the logits of each prompt's last token (B, V)
    and the cache after the prompts (a new one sized for ``max_length`` tokens unless ``cache`` is given)."""
    rows = _as_rows(prompts)
    _check_prompts(model, rows, cache)
    _check_sizes(chunk_size, max_length)
    device = model.device
    length = max(len(r) for r in rows)
    if cache is None:
        needed = max_length if max_length is not None else length
        if "attention" in model.config.block_types and needed < length:
            raise ValueError(f"a prompt of {length} tokens is longer than max_length={max_length}, the size of "
                             f"the global-attention KV cache")
        cache = model.init_cache(len(rows), needed)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        positions = torch.full((len(rows), length), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, length - len(row) :] = torch.tensor(row)
            positions[i, length - len(row) :] = torch.arange(len(row))
    else:
        if cache.max_length is not None and cache.length + length > cache.max_length:
            raise ValueError(f"the prompt ({length} tokens) does not fit the global-attention KV cache: "
                             f"{cache.length} of {cache.max_length} tokens used")
        ids = torch.tensor(rows, dtype=torch.long)
        positions = cache.position.cpu()[:, None] + torch.arange(length)
    ids, positions = ids.to(device), positions.to(device)
    logits, forward = None, prefill_model(model)  # bfloat16 on a CPU without its matmul: float32 matmuls
    for start in range(0, length, chunk_size):
        sl = slice(start, start + chunk_size)
        logits = forward(ids[:, sl], positions[:, sl], cache=cache, logits_to_keep=1)[:, -1]
    cache.started = True  # every prompt has a token, and padding comes first
    return logits, cache


_COMPILED: dict[str | None, Callable] = {}


def compiled_forward(device: torch.device) -> Callable:
    """``torch.compile`` of the forward pass, for decode steps: static shapes, whole graph, CUDA graphs
    ("reduce-overhead") on GPU. One function for every model (Dynamo compiles again for a new structure or batch)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(_decode_forward, mode=mode, fullgraph=True, dynamic=False)
    return _COMPILED[mode]


def _decode_forward(model: nn.Module, tokens: Tensor, cache: Cache) -> Tensor:
    return model(tokens[:, None], cache=cache)[:, -1]


def is_swapped(model: nn.Module) -> bool:
    """Whether ``model`` is already a decode copy (:func:`decode_model`): its matmuls swapped for the CPU kernels."""
    return any(isinstance(m, (Int8PackLinear, MatvecLinear, PackedLinear, FusedResidualBlock)) for m in model.modules())


def decode_model(model: CausalLM, batch_size: int, prepack: bool | None = None,
                 matvec: bool | None = None, fuse: bool = True) -> nn.Module:
    """The model a decode step of ``batch_size`` rows runs (see :class:`Decoder`): a copy sharing its tensors whose
    matmuls run through the matvec kernel (``matvec``; default on CPU: int8 models, and any model at one row, where
    its one-row path beats oneDNN's matmul; docs/performance.md "CPU decode at 1-3B"; and float models whose weights
    oneDNN cannot hold on this CPU) or oneDNN's prepacked weights (``prepack``; default: float CPU models at several
    rows), and (``fuse``) whose residual blocks run the element-wise
    work of a step through fused kernels (:mod:`griffin.inference.cpu.fused`); or ``model`` itself. A model already
    swapped is returned as it is, so that a caller that decodes many times (``griffin serve``) makes the copy once."""
    if any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules()):
        raise ValueError("the model holds LoRA adapters: merge them into its weights first (griffin.finetune."
                         "merge_lora, or load the checkpoint with adapter=), which decodes at a plain model's speed")
    if is_swapped(model):
        return model
    quantized = quantization_of(model) is not None
    if matvec is None:  # (and where oneDNN cannot hold the weights on this CPU: bfloat16 without AVX-512)
        matvec = model.device.type == "cpu" and (quantized or (batch_size == 1 and not prepack)
                                                 or (not prepack and not can_prepack(model.output_weight)))
    if prepack is None:
        prepack = not matvec and not quantized and can_prepack(model.output_weight)
    if matvec:
        swapped = matvec_swapped(model, int8pack=int8pack_for(batch_size))
    elif prepack:
        swapped = prepacked(model, batch_size)
    else:
        return model
    return fused_step_swapped(swapped) if fuse else swapped


class Decoder:
    """One-token decode steps on ``cache`` (Section 5): ``decoder(tokens)`` with tokens (B,) returns the logits
    (B, vocab) of the next ones and advances the cache in place. A step is the model's forward pass on one token per
    row (``model(tokens[:, None], cache=cache)``), so it computes exactly what that call does.

    Everything that needs the host is done once, here: the cache must belong to the model, and every row must
    continue a document (a prompt was prefilled). A step then checks the tokens' shape and the global-attention KV
    cache's room; token ids are not checked (they are sampled from the model's own logits).

    The weight matmuls, on CPU, run on a copy of the model that shares its tensors, made here (later changes of the
    weights are not seen): ``matvec`` (default: int8 models, and any model at one row; see :func:`decode_model`)
    reads each weight once, the layers that share an input fused into one call
    (:func:`griffin.inference.cpu.linear.matvec_swapped`); otherwise ``prepack`` (default: on CPU) holds the weights
    laid out for oneDNN (:func:`griffin.inference.cpu.prepack.prepacked`), as large as the weights while the decoder
    lives (pass ``prepack=False`` where memory is tight). In that copy the residual blocks run the rest of a step
    through fused kernels (:mod:`griffin.inference.cpu.fused`). Both equal the plain path up to float32 rounding (and
    bfloat16's, rounded where the model rounds). An int8 model (:func:`griffin.quantize.quantize_int8`) decodes on
    CPU only. ``compile=True`` runs the step through ``torch.compile`` (CUDA graphs on GPU) with static shapes:
    attention then reads every preallocated slot, masked.
    """

    def __init__(self, model: CausalLM, cache: Cache, compile: bool = False, prepack: bool | None = None,
                 matvec: bool | None = None) -> None:
        model.check_cache(cache, cache.batch_size)
        quantized = quantization_of(model)
        if quantized is not None and (model.device.type != "cpu" or (matvec is False and not is_swapped(model))):
            where = f"the model is on {model.device}" if model.device.type != "cpu" else "matvec=False"
            raise ValueError(f"{quantized['method']} weights decode with the CPU kernel only, and {where}: decode "
                             "the float model on this device, or the quantised one on the CPU")
        if not cache.started:
            if bool((cache.position < 1).any()):  # one host sync per prompt
                raise ValueError("decoding continues the documents in the cache: prefill at least one token per row "
                                 "(e.g. a BOS token) first")
            cache.started = True
        self.model = decode_model(model, cache.batch_size, prepack, matvec)
        self.cache, self.compile = cache, compile
        if compile:
            self.step = compiled_forward(model.device)
            if model.device.type == "cuda":  # CUDA graphs read and write these in place
                for t in cache.tensors().values():
                    torch._dynamo.mark_static_address(t)
        else:
            self.step = _decode_forward

    @torch.no_grad()
    def __call__(self, tokens: Tensor) -> Tensor:
        cache = self.cache
        if tokens.shape != (cache.batch_size,) or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a ({cache.batch_size},) int64 tensor, got {tuple(tokens.shape)} "
                             f"{tokens.dtype}")
        if cache.max_length is not None and cache.length >= cache.max_length:
            raise ValueError(f"the global-attention KV cache holds {cache.max_length} tokens, all used: size it with a "
                             f"larger max_length")
        if not self.compile:
            return self.step(self.model, tokens, cache)
        if tokens.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits may be overwritten
        logits = self.step(self.model, tokens, cache)
        cache.length += 1  # the compiled forward leaves the host-side bound to its caller
        return logits


@torch.no_grad()
def generate_stream(
    model: CausalLM,
    prompts: Prompts,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    cache: Cache | None = None,
    max_length: int | None = None,
    chunk_size: int = 1024,
    compile: bool = False,
) -> Iterator[list[int | None]]:
    """Yield, at each step, the token sampled for every row (None for rows that have stopped).

    A row stops after producing one of ``stop_tokens`` (which is yielded). ``cache`` continues from a saved
    state (see :class:`griffin.inference.cache.Cache`); it is updated in place. ``max_length`` sizes the KV cache of
    global attention (default: the longest prompt plus ``max_new_tokens``). ``compile``: decode with a
    ``torch.compile``d step (see :class:`Decoder`).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    check_stops(stop_tokens, model.config.vocab_size)
    rows = _as_rows(prompts)
    _check_prompts(model, rows, cache)
    _check_sizes(chunk_size, max_length)
    if cache is None and max_length is None:
        max_length = max(len(r) for r in rows) + max_new_tokens
    if cache is not None and cache.max_length is not None and \
            cache.length + len(rows[0]) + max_new_tokens > cache.max_length:
        raise ValueError(f"the global-attention KV cache holds {cache.max_length} tokens: {cache.length} used, "
                         f"{len(rows[0])} in the prompt and {max_new_tokens} to generate do not fit")
    if max_new_tokens == 0:
        return
    logits, cache = prefill(model, rows, cache, max_length, chunk_size)
    yield from decode_stream(model, logits, cache, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
                             compile=compile)


@torch.no_grad()
def decode_stream(
    model: CausalLM,
    logits: Tensor,
    cache: Cache,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    *,
    compile: bool = False,
) -> Iterator[list[int | None]]:
    """Sample from ``logits`` (B, V), the output of :func:`prefill`, then continue one token at a time with a
    :class:`Decoder` on ``cache``."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    stops = check_stops(stop_tokens, model.config.vocab_size)
    if max_new_tokens == 0:
        return
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    decoder = None  # made at the first decode step (a single new token needs none)
    done = [False] * logits.shape[0]
    for step in range(max_new_tokens):
        tokens = sample(logits, temperature, top_k, top_p, generator)
        ids = tokens.tolist()  # the step's one host sync: the caller gets Python ints
        yield [None if d else t for d, t in zip(done, ids, strict=True)]
        done = [d or t in stops for d, t in zip(done, ids, strict=True)]
        if all(done) or step == max_new_tokens - 1:
            return
        decoder = decoder or Decoder(model, cache, compile=compile)
        logits = decoder(tokens)


def generate(model: CausalLM, prompts: Prompts, max_new_tokens: int = 64, **kwargs) -> list[list[int]]:
    """The tokens generated for each prompt (see :func:`generate_stream` for the arguments)."""
    rows = _as_rows(prompts)
    out: list[list[int]] = [[] for _ in rows]
    for step in generate_stream(model, rows, max_new_tokens, **kwargs):
        for i, token in enumerate(step):
            if token is not None:
                out[i].append(token)
    return out
