"""Where an answer is lost beyond the training length: RG-LRU writes silenced before the trigger (Section 6.2).

An RG-LRU channel whose decay a_t stays near 1 keeps the answer of an induction-heads sequence for long, but it keeps
whatever else was written into it as well: the tokens before the trigger, a prefix longer than any training sequence
when a model trained at T = 256 is evaluated at 16K. :func:`silenced_prefix` tests that cause directly. Inside it,
every RG-LRU of the model computes its gates (r_t, i_t, so a_t) from its input as usual but writes nothing
(x_t = 0 in h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)) at the positions before each row's first trigger: the
state reaches the trigger empty, and what is lost after it is lost to the decay and the writes that follow.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from griffin.layers.rg_lru import RGLRU
from griffin.model import CausalLM
from griffin.ops.rg_lru import rg_lru


class _PrefixMask:
    """The (B, T) write mask of the tokens a model is given, across the chunks of one cached forward: 0 before a row's
    first ``trigger``, 1 from it on."""

    def __init__(self, trigger: int) -> None:
        self.trigger = trigger
        self.mask: Tensor | None = None
        self._seen: Tensor | None = None  # (B,) the row's trigger came in an earlier chunk
        self._cache: object | None = None

    def update(self, input_ids: Tensor, cache: object | None) -> None:
        if cache is None or cache is not self._cache or self._seen is None:  # a new sequence, not its next chunk
            self._seen = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self._cache = cache
        seen = (input_ids == self.trigger).cumsum(1).gt(0) | self._seen[:, None]
        self.mask, self._seen = seen, seen[:, -1]


class _SilencedWrites(nn.Module):
    """An RG-LRU whose write is multiplied by ``prefix.mask``; its gates see the unmasked input."""

    def __init__(self, lru: RGLRU, prefix: _PrefixMask) -> None:
        super().__init__()
        self.lru, self.prefix = lru, prefix

    def forward(self, x: Tensor, reset: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        lru, mask = self.lru, self.prefix.mask
        if mask is None or mask.shape != x.shape[:2]:
            raise RuntimeError(f"silenced_prefix: no write mask for an input of shape {tuple(x.shape)}: call the "
                               "model with token ids inside the context")
        write = x * mask[..., None].to(x.dtype)
        return rg_lru(write, lru.input_gate(x), lru.a_gate(x), lru.a_param, lru.c, h0, reset)


def _rg_lrus(model: CausalLM) -> list[tuple[nn.Module, str, RGLRU]]:
    parents = [(module, name, child) for module in model.modules() for name, child in module.named_children()
               if isinstance(child, RGLRU)]
    if not parents:
        raise ValueError(f"silenced_prefix: the {model.config.family} model has no RG-LRU (no recurrent block, or the "
                         "complex CG-LRU), so there is no write to silence")
    return parents


def check_silenceable(model: CausalLM) -> None:
    """Raise a ValueError unless :func:`silenced_prefix` can run on ``model`` (it has an RG-LRU)."""
    _rg_lrus(model)


@contextmanager
def silenced_prefix(model: CausalLM, trigger: int) -> Iterator[CausalLM]:
    """Inside: ``model``'s RG-LRUs write nothing before each row's first ``trigger`` token (module docstring); the
    model is restored on exit. Refused for a model without an RG-LRU (MQA, or the complex CG-LRU)."""
    parents = _rg_lrus(model)
    prefix = _PrefixMask(trigger)

    def see(module: nn.Module, args: tuple, kwargs: dict) -> None:  # CausalLM.forward(input_ids, positions, cache)
        prefix.update(args[0] if args else kwargs["input_ids"], kwargs.get("cache", args[2] if len(args) > 2 else None))

    hook = model.register_forward_pre_hook(see, with_kwargs=True)
    for parent, name, lru in parents:
        setattr(parent, name, _SilencedWrites(lru, prefix))
    try:
        yield model
    finally:
        hook.remove()
        for parent, name, lru in parents:
            setattr(parent, name, lru)
