"""Generation that stops at stop strings (lm-evaluation-harness' ``generate_until``; phonebook lookup, Section 6.2):
prompts of any lengths prefilled together (left-padded), then decoded one token per step until every row has
produced one of its stop strings (or the EOS token, or ``max_new_tokens``); each answer is cut before its first
stop string."""

from __future__ import annotations

from collections.abc import Sequence

from griffin.data.tokenizer import Tokenizer
from griffin.inference import decode_stream, prefill
from griffin.model import CausalLM

PENDING = "".join(map(chr, range(0xDC80, 0xDD00)))  # surrogate escapes of bytes >= 0x80


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """``text`` up to (without) the earliest occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        if stop:
            at = text.find(stop)
            if at >= 0:
                cut = min(cut, at)
    return text[:cut]


def generate_until(model: CausalLM, prompts: Sequence[Sequence[int]], tokenizer: Tokenizer, until: Sequence[str],
                   max_new_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                   chunk_size: int = 1024) -> list[str]:
    """The text generated after each prompt (token ids), cut before the first of ``until`` (greedy at temperature
    0). A row stops once its text holds a stop string or it emits the tokenizer's EOS token; the batch stops when
    every row has, or after ``max_new_tokens`` tokens."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
    if isinstance(until, str):
        until = [until]
    rows = [list(p) for p in prompts]
    if max_new_tokens == 0 or not rows:
        return ["" for _ in rows]
    longest = max(len(r) for r in rows)
    logits, cache = prefill(model, rows, max_length=longest + max_new_tokens, chunk_size=chunk_size)
    eos = tokenizer.eos_id
    out: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    steps = decode_stream(model, logits, cache, max_new_tokens, temperature, seed=seed,
                          stop_tokens=() if eos is None else (eos,))
    for step in steps:
        for i, token in enumerate(step):
            if token is None or done[i]:
                continue
            if token == eos:
                done[i] = True
                continue
            out[i].append(token)
            text = tokenizer.decode(out[i]).rstrip(PENDING)  # a trailing undecodable byte may start a character
            if until and cut_at_stops(text, until) != text:
                done[i] = True
        if all(done):
            break
    return [cut_at_stops(tokenizer.decode(ids), until) for ids in out]
