"""Prompts read into a state that is saved to a file, or continued from one (Section 5: the state after a prompt is
a fixed-size snapshot for Hawk and Griffin): what ``griffin generate --save-state / --load-state`` does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from griffin.cache import Cache
from griffin.inference.generate import prefill
from griffin.model import CausalLM


def prefill_with_state(model: CausalLM, rows: Sequence[Sequence[int]], max_new_tokens: int = 0, *,
                       load_state: str | Path | None = None, save_state: str | Path | None = None,
                       chunk_size: int = 1024) -> tuple[Tensor, Cache]:
    """Prefill the prompts ``rows`` (token ids) and return the logits of their last tokens and the cache, as
    :func:`griffin.inference.prefill` does, ready for ``max_new_tokens`` more tokens per row.

    ``load_state``: a snapshot file (:meth:`griffin.cache.Cache.save`) of this model's state after earlier text, which
    every row continues (its first row, copied to each; the prompts then carry no BOS token). ``save_state``: write
    the state after the prompt to this file (atomically), for one prompt only. Without ``load_state`` the cache is
    sized for the longest prompt plus ``max_new_tokens``."""
    if save_state is not None and len(rows) > 1:
        raise ValueError(f"save_state needs a single prompt, not {len(rows)}: one state is saved per file")
    cache = None
    if load_state is not None:
        cache = Cache.load(load_state, model.config, model.device)
        if len(rows) > 1:
            cache = cache.fork(len(rows))
    max_length = None if cache is not None or not rows else max(map(len, rows)) + max_new_tokens
    logits, cache = prefill(model, rows, cache, max_length, chunk_size)
    if save_state is not None:
        cache.save(save_state)
    return logits, cache


__all__ = ["prefill_with_state"]
