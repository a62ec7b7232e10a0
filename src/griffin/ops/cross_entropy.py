"""Cross-entropy of the soft-capped logits, a chunk of rows at a time (the training loss, Section 3).

The output layer maps each of the B·T final hidden states to ``vocab`` logits, soft-capped as in RecurrentGemma
(z = c · tanh(x W^T / c), c = 30). Materialised whole, they take B·T·vocab floats, and again as much for their
gradient: 16.7 GB in float32 for 8 × 2048 tokens over RecurrentGemma's 256K vocabulary. :func:`chunked_cross_entropy`
computes the same loss ``chunk`` rows at a time, keeping only a float32 log-sum-exp per row, and recomputes each
chunk's logits in the backward pass: memory O(chunk · vocab), at the price of one more output-layer matmul.
:func:`cross_entropy_ref` is the plain version it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # a target that does not count (as in F.cross_entropy)


def cross_entropy_ref(h: Tensor, weight: Tensor, targets: Tensor, cap: float | None = None) -> Tensor:
    """Sum over the targets != IGNORE_INDEX of -log softmax(z)[target], z = cap·tanh(h W^T / cap) (no cap if None
    or 0), in float32 or wider. h (..., D), weight (vocab, D), targets (...)."""
    logits = F.linear(h, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _capped_logits(h: Tensor, weight: Tensor, cap: float, acc: torch.dtype) -> Tensor:
    """The soft-capped logits of one chunk in ``acc``, computed in place (one (chunk, vocab) buffer)."""
    z = F.linear(h, weight).to(acc)
    return z.div_(cap).tanh_().mul_(cap) if cap else z


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, cap: float, chunk: int,
                dtype: torch.dtype) -> Tensor:
        h_c, w_c = h.to(dtype), weight.to(dtype)  # the matmul's dtype (autocast's, under autocast)
        acc = torch.promote_types(dtype, torch.float32)  # the rest: float32 or wider
        lse = torch.empty(h.shape[0], device=h.device, dtype=acc)
        total = torch.zeros((), device=h.device, dtype=acc)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                z = _capped_logits(h_c[s : s + chunk], w_c, cap, acc)
                lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
                tgt = targets[s : s + chunk]
                z_t = z.gather(1, tgt.clamp(min=0)[:, None])[:, 0]
                total += ((lse[s : s + chunk] - z_t) * (tgt != IGNORE_INDEX)).sum()
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.cap, ctx.chunk, ctx.dtype = cap, chunk, dtype
        return total

    @staticmethod
    def backward(ctx, dloss: Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        cap, chunk, dtype = ctx.cap, ctx.chunk, ctx.dtype
        h_c, w_c = h.to(dtype), weight.to(dtype)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if ctx.needs_input_grad[1] else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                hs, tgt = h_c[s : s + chunk], targets[s : s + chunk]
                # dL/dx = (softmax(z) - onehot(target)) * (1 - tanh^2(x / cap)) per counted row, in place: two
                # (chunk, vocab) buffers
                x = F.linear(hs, w_c).to(acc)
                t = x.div_(cap).tanh_() if cap else None
                z = t * cap if cap else x
                g = z.sub_(lse[s : s + chunk, None]).exp_()  # softmax(z), in z's buffer
                g.scatter_add_(1, tgt.clamp(min=0)[:, None], g.new_full((len(tgt), 1), -1.0))
                g.mul_(((tgt != IGNORE_INDEX) * dloss)[:, None])
                if t is not None:
                    g.mul_(t.square_().neg_().add_(1.0))
                g = g.to(dtype)
                if dh is not None:
                    dh[s : s + chunk] = (g @ w_c).to(h.dtype)
                if dw is not None:
                    dw += (g.t() @ hs).to(acc)
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, cap: float | None = None,
                          chunk: int = 4096) -> Tensor:
    """:func:`cross_entropy_ref`, computed ``chunk`` rows of h at a time (forward and backward), never holding more
    than (chunk, vocab) logits. Under autocast the matmuls run in autocast's dtype, the rest in float32 (or wider).

    h (..., D), weight (vocab, D), targets (...) with ids in [0, vocab) or IGNORE_INDEX (checked where that costs no
    device synchronisation: CPU tensors outside compilation).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive int (rows of logits at a time)")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(h.shape[:-1])} (h without its last axis), got "
                         f"{tuple(targets.shape)}")
    vocab = weight.shape[0]
    if not torch.compiler.is_compiling() and targets.device.type == "cpu":
        bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab)
        if bool(bad.any()):  # gather would fail deep inside
            raise ValueError(f"target id {int(targets[bad][0])} is outside the vocabulary [0, {vocab}) and is not "
                             f"IGNORE_INDEX={IGNORE_INDEX}")
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.promote_types(
        h.dtype, weight.dtype)
    return _ChunkedCrossEntropy.apply(h.flatten(0, -2), weight, targets.flatten(), float(cap or 0.0), chunk,
                                      dtype)
