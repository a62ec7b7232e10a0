"""The training loss with the output layer split by vocabulary rows over the tp devices (Section 4.1).

Each device holds V/tp rows of the (tied) output matrix and computes only those logits, a chunk of rows of h at a
time: the log-sum-exp over the whole vocabulary needs an all-reduce of each row's maximum and of its sum of
exponentials, the target's logit an all-reduce of the one device that holds it. The backward pass recomputes each
chunk's logits (as :func:`griffin.ops.cross_entropy.chunked_cross_entropy` does), so no device ever holds more than
(chunk, V/tp) logits. The gradient of h is a partial sum over the devices' vocabulary rows, summed by the caller's
:func:`sum_grad` (or reduce-scattered by :func:`gather_sequence` under sequence parallelism).

:func:`vocab_parallel_cross_entropy` equals ``cross_entropy_ref`` on the whole matrix (tested).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from griffin.ops.cross_entropy import IGNORE_INDEX


def sum_grad(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Megatron's f: ``x`` unchanged in the forward pass; in the backward pass its gradient summed over ``mesh``
    (each device's gradient is its own share of the total)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def gather_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """Sequence parallelism: this device's slice of ``x`` along ``dim`` -> the whole ``x`` (all-gather); in the
    backward pass the gradients are summed over the devices and each keeps its slice (reduce-scatter)."""
    full = DTensor.from_local(x, mesh, [Shard(dim)], run_check=False).redistribute(placements=[Replicate()])
    return full.to_local(grad_placements=[Partial()])


def _capped(z: Tensor, cap: float) -> Tensor:
    return z.div_(cap).tanh_().mul_(cap) if cap else z


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, cap: float, chunk: int,
                dtype: torch.dtype, group: dist.ProcessGroup, start: int) -> Tensor:
        h_c, w_c = h.to(dtype), weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        rows, local_vocab = h.shape[0], weight.shape[0]
        lse = torch.empty(rows, device=h.device, dtype=acc)
        total = torch.zeros((), device=h.device, dtype=acc)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, rows, chunk):
                z = _capped(torch.nn.functional.linear(h_c[s : s + chunk], w_c).to(acc), cap)
                top = z.amax(dim=-1)
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                sums = torch.exp(z - top[:, None]).sum(-1)
                tgt = targets[s : s + chunk] - start
                mine = (tgt >= 0) & (tgt < local_vocab)
                z_t = z.gather(1, tgt.clamp(0, local_vocab - 1)[:, None])[:, 0] * mine
                both = torch.stack([sums, z_t])
                dist.all_reduce(both, group=group)
                lse[s : s + chunk] = top + torch.log(both[0])
                total += ((lse[s : s + chunk] - both[1]) * (targets[s : s + chunk] != IGNORE_INDEX)).sum()
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.cap, ctx.chunk, ctx.dtype, ctx.start = cap, chunk, dtype, start
        return total

    @staticmethod
    def backward(ctx, dloss: Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        cap, chunk, dtype, start = ctx.cap, ctx.chunk, ctx.dtype, ctx.start
        h_c, w_c = h.to(dtype), weight.to(dtype)
        acc, local_vocab = lse.dtype, weight.shape[0]
        dh = torch.empty_like(h)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                hs, tgt = h_c[s : s + chunk], targets[s : s + chunk]
                x = torch.nn.functional.linear(hs, w_c).to(acc)
                t = x.div_(cap).tanh_() if cap else None
                z = t * cap if cap else x
                g = z.sub_(lse[s : s + chunk, None]).exp_()  # softmax over the whole vocabulary, this device's columns
                local = tgt - start
                mine = (local >= 0) & (local < local_vocab)
                g.scatter_add_(1, local.clamp(0, local_vocab - 1)[:, None], -mine[:, None].to(acc))
                g.mul_(((tgt != IGNORE_INDEX) * dloss)[:, None])
                if t is not None:
                    g.mul_(t.square_().neg_().add_(1.0))
                g = g.to(dtype)
                dh[s : s + chunk] = (g @ w_c).to(h.dtype)
                dw += (g.t() @ hs).to(acc)
        return dh, dw.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, mesh: DeviceMesh,
                                 cap: float | None = None, chunk: int = 0) -> Tensor:
    """The summed cross-entropy of the soft-capped logits h W^T over ``targets``, with W (vocab, D) split by rows
    over the 1-D ``mesh``: ``weight`` is this device's (vocab / tp, D) block, rows ``rank · vocab/tp`` onward; h
    (..., D) and targets (...) are the same on every device. ``chunk`` rows of h at a time (0: all at once). The
    result is the same on every device; h's gradient is this device's share (sum it with :func:`sum_grad`)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk={chunk!r} must be a non-negative int (rows of logits at a time; 0: all)")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(h.shape[:-1])} (h without its last axis), got "
                         f"{tuple(targets.shape)}")
    tp, rank = mesh.size(), mesh.get_local_rank()
    vocab = weight.shape[0] * tp
    bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab)
    if bool(bad.any()):
        raise ValueError(f"target id {int(targets[bad][0])} is outside the vocabulary [0, {vocab}) and is not "
                         f"IGNORE_INDEX={IGNORE_INDEX}")
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.promote_types(
        h.dtype, weight.dtype)
    rows = h.flatten(0, -2)
    return _VocabParallelCrossEntropy.apply(rows, weight, targets.flatten(), float(cap or 0.0),
                                            chunk or max(rows.shape[0], 1), dtype, mesh.get_group(),
                                            rank * weight.shape[0])


class VocabParallelLoss(nn.Module):
    """Drop-in for :class:`griffin.model.LanguageModelLoss` on a tensor-parallel model: h is whole (or, with
    sequence parallelism, this device's slice of the sequence, gathered here), the weight a vocabulary-split
    DTensor."""

    def __init__(self, logits_soft_cap: float | None, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cap = logits_soft_cap
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel

    def forward(self, h: Tensor, weight: Tensor, targets: Tensor, chunk: int = 0) -> Tensor:
        h = gather_sequence(h, self.mesh) if self.sequence_parallel else sum_grad(h, self.mesh)
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return vocab_parallel_cross_entropy(h, local, targets, self.mesh, self.cap, chunk)


__all__ = ["VocabParallelLoss", "gather_sequence", "sum_grad", "vocab_parallel_cross_entropy"]
