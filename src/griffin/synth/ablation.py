"""Where an answer is lost beyond the training length: RG-LRU writes silenced before the trigger (Section 6.2).

An RG-LRU channel whose decay a_t stays near 1 keeps the answer of an induction-heads sequence for long, but it keeps
whatever else was written into it as well: the tokens before the trigger, a prefix longer than any training sequence
when a model trained at T = 256 is evaluated at 16K. :func:`silenced_prefix` tests that cause directly. Inside it,
every RG-LRU of the model computes its gates (r_t, i_t, so a_t) from its input as usual but writes nothing
(x_t = 0 in h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)) at the positions before each row's first trigger: the
state reaches the trigger empty, and what is lost after it is lost to the decay and the writes that follow.

:func:`answer_shares` measures the same without intervening: the RG-LRU is linear in its writes, so its state at the
final trigger is exactly the sum of what the writes before the first trigger, the writes while the trigger is in the
Conv1D's view (the answer's), and the writes after them left of themselves there. :func:`answer_channels` names, per
recurrent block, the channel where the answer's share stands out most against the other two, and how far it does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from griffin.layers.rg_lru import RGLRU
from griffin.model import CausalLM
from griffin.ops.rg_lru import rg_lru
from griffin.ops.rg_lru.reference import rg_lru_gates
from griffin.synth.evaluate import forward_with_hooks

#: The three sources of an RG-LRU's state at the final trigger, in the order :func:`answer_shares` stacks them.
SHARES = ("prefix", "answer", "after")


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
        raise ValueError(f"the {model.config.family} model has no RG-LRU (no recurrent block, or the complex "
                         "CG-LRU): no write to silence or split")
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


def answer_shares(model: CausalLM, input_ids: Tensor, trigger: int) -> list[tuple[Tensor, Tensor]]:
    """Each RG-LRU's state at the last position of ``input_ids`` (B, T) (induction-heads sequences, the final trigger
    last), split by where its writes came from, one ``(shares, log_a)`` per RG-LRU in depth order: ``shares``
    (3, B, width) in float64 in the order of :data:`SHARES`, summing to the state: what the writes b_t at t < p (p
    each row's first trigger), at p <= t < p + conv1d_width (the positions whose input window holds the trigger:
    the answer's) and at later t keep of themselves at T - 1, the weight of b_t being a_{t+1} ... a_{T-1} (0 across a
    document start, which resets the state); ``log_a`` (width,) the mean log a_t over the rows and positions (-1 / the
    channel's memory horizon, :func:`griffin.synth.evaluate.memory_horizons`). One forward of the whole sequences (no
    cache). Refused for a model without an RG-LRU."""
    parents = _rg_lrus(model)
    first = (input_ids[:, :-1] == trigger).int().argmax(1)
    missing = (input_ids[torch.arange(len(input_ids)), first] != trigger).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"answer_shares: rows {missing} have no trigger (token {trigger}) before their last position")
    T = input_ids.shape[1]
    t = torch.arange(T, device=input_ids.device)[None, :]
    width = model.config.conv1d_width
    masks = torch.stack([t < first[:, None], (t >= first[:, None]) & (t < first[:, None] + width),
                         t >= first[:, None] + width])  # (3, B, T)
    out: list[tuple[Tensor, Tensor]] = []

    def share(module: RGLRU, args: tuple, result: Any) -> None:
        x, reset = args[0], args[1] if len(args) > 1 else None
        a, b = rg_lru_gates(x, module.input_gate(x), module.a_gate(x), module.a_param, module.c, reset)
        log_a = a.double().log()
        carried = log_a if reset is None else log_a.masked_fill(reset[..., None], -math.inf)  # a reset keeps nothing
        # log(a_{t+1} ... a_{T-1}): the suffix sums from t + 1 on (no subtraction, so a reset's -inf stays one)
        suffix = carried.flip(1).cumsum(1).flip(1)
        kept = torch.exp(torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], 1))
        contrib = kept * b.double()  # (B, T, width): what b_t keeps of itself at T - 1
        out.append((torch.einsum("kbt,btd->kbd", masks.double(), contrib), log_a.mean(dim=(0, 1))))

    forward_with_hooks(model, input_ids, [lru for _, _, lru in parents], share)
    return out


def answer_channels(shares: list[tuple[Tensor, Tensor]]) -> list[dict[str, float]]:
    """Per RG-LRU, from :func:`answer_shares`: the channel whose answer share stands out most against the rest of
    its state (the median over rows of |answer| / |prefix + after|: the answer-to-interference ratio), that ratio,
    the medians of |prefix|, |answer| and |after| in it, its memory horizon, and how many channels have a ratio of at
    least 1; and the RMS over the channels of the whole state (the median over rows): what a length changes in the
    rest of the block's state."""
    rows = []
    for parts, log_a in shares:
        prefix, answer, after = parts.abs()
        ratio = (answer / (parts[0] + parts[2]).abs()).median(0).values  # (width,)
        ratio = torch.nan_to_num(ratio, nan=0.0)
        j = int(ratio.argmax())
        rows.append({"channel": j, "ratio": float(ratio[j]), "prefix": float(prefix[:, j].median()),
                     "answer": float(answer[:, j].median()), "after": float(after[:, j].median()),
                     "horizon": float(-1.0 / log_a[j]), "channels_over_1": int((ratio >= 1).sum()),
                     "state_rms": float(parts.sum(0).pow(2).mean(-1).sqrt().median())})
    return rows
