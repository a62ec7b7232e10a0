"""Per-request sampling settings, and sampling the next token of every row of a running batch (Section 5), each row
with its own temperature, top-k, top-p and random generator.

:func:`sample_rows` is the fast path: greedy rows in one ``argmax``, unseeded rows that share their settings in one
:func:`griffin.inference.sample` call on the engine's generator, seeded rows one at a time on their own generator (so
that a seeded request draws the same tokens whatever batch it shares). :func:`sample_rows_reference` samples every row
alone; both give the same tokens for greedy and seeded rows.

A :class:`TokenMask` (the allowed tokens of the rows under a ``response_format`` grammar) sets the other logits of
those rows to -inf before temperature, top-k and top-p, for greedy and sampled rows alike; rows without a grammar
are untouched. Log-probabilities stay the model's (:func:`token_logprobs` reads the unmasked logits).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from griffin.inference import sample

if TYPE_CHECKING:
    from griffin.serve.grammar import ResponseFormat


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (the OpenAI parameters, plus a few of vLLM's).

    ``logprobs``: None for none, else the number of most likely alternatives to report beside each sampled token
    (0: the sampled token's log-probability only). ``prompt_logprobs``: report the prompt tokens' log-probabilities
    too (``echo`` with ``logprobs``). ``boundaries``: prompt lengths after which the state is worth keeping in the
    prefix cache (ends of chat turns; the end of the prompt is always one). ``response_format``: the output's
    grammar (:class:`griffin.serve.grammar.ResponseFormat`, hashable), None for free text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    boundaries: tuple[int, ...] = field(default=())
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a non-negative integer")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be a positive integer")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r}: every stop sequence must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choice_generator(params: SamplingParams, choice: int,
                     device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator of choice ``choice`` of a request: seeded with ``seed + choice`` (None without a seed)."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed + choice)


@dataclass
class TokenMask:
    """The allowed tokens of some rows of a batch: ``allowed`` (len(rows), V) bool, one row per index in ``rows``."""

    rows: list[int]
    allowed: Tensor


def apply_mask(logits: Tensor, mask: TokenMask | None) -> Tensor:
    """``logits`` with the disallowed tokens of the masked rows at -inf (a new tensor; the input is unchanged)."""
    if mask is None or not mask.rows:
        return logits
    out = logits.clone()
    rows = torch.tensor(mask.rows, device=logits.device)
    out[rows] = out[rows].masked_fill(~mask.allowed.to(logits.device), -math.inf)
    return out


def sample_rows_reference(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                          shared: torch.Generator | None = None, mask: TokenMask | None = None) -> Tensor:
    """Next tokens (B,) of logits (B, V), each row sampled alone with its own settings (its generator, else
    ``shared``), after ``mask``."""
    logits = apply_mask(logits, mask)
    out = [sample(logits[i : i + 1], p.temperature, p.top_k, p.top_p, g if g is not None else shared)
           for i, (p, g) in enumerate(zip(params, generators, strict=True))]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def sample_rows(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                shared: torch.Generator | None = None, mask: TokenMask | None = None) -> Tensor:
    """:func:`sample_rows_reference` with rows grouped: greedy rows in one ``argmax``, unseeded rows of equal
    settings in one draw from ``shared``, seeded rows alone on their generators."""
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows of logits but {len(params)} settings and {len(generators)} generators")
    logits = apply_mask(logits, mask)
    tokens = torch.empty(B, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].float().argmax(-1).cpu()
    groups: dict[tuple[float, int, float], list[int]] = defaultdict(list)
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        if g is not None:
            tokens[i] = sample(logits[i : i + 1], p.temperature, p.top_k, p.top_p, g)[0]
        else:
            groups[(p.temperature, p.top_k, p.top_p)].append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        tokens[rows] = sample(logits[rows], temperature, top_k, top_p, shared).cpu()
    return tokens


def token_logprobs(logits: Tensor, tokens: Tensor, top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of ``tokens`` (B,) under logits (B, V) (the model's distribution, before temperature and
    truncation), and the ``top`` most likely tokens of each row with theirs."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, tokens.to(logp.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = logp.topk(min(top, logp.shape[-1]), -1)
    return chosen, [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
