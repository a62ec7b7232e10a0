"""Context parallelism (``cp``): each sequence split into ``cp`` contiguous shards, one per rank of the cp group, for
sequences longer than one device holds (Sections 2.3, 2.4 and 4; the JAX package shards its scan the same way).

Applied from outside the model, by a class swap of the temporal modules (parameters and their names unchanged, so
checkpoints are those of one process) and a wrapper of the model's :meth:`~griffin.model.CausalLM.context`:

- RG-LRU (Section 2.4): each rank runs its shard's scan from a zero state (the fused kernels, unchanged) and keeps
  its last state h_r and the product of its decays A_r (0 if a document starts in the shard: a reset stops the
  carry, as in one process). One all-gather of (h_r, A_r) over the cp group (2·B·D_RNN values per rank), then each
  rank folds the carries of the ranks before it, h_in = A_{r-1}(…(A_1 h_0 + h_1)…) + h_{r-1}: the exclusive scan is
  sequential over the gathered carries, O(cp) element-wise work per rank and one collective (log-depth or ring, as
  the backend implements all-gather), instead of cp - 1 dependent point-to-point steps. Each rank then corrects its
  states, h_t += (a_1 ⋯ a_t) h_in, zero from the shard's first document start on. The backward pass is the mirror
  image: the all-gather's backward sums every rank's gradient of the gathered carries (an all-reduce) and each rank
  keeps its own, which flows into its scan through the kernels' own backward.
- Conv1D (Section 2.3): the last (K - 1) inputs before the shard, gathered as a halo (from several shards back when a
  shard is shorter than K - 1), zeroed before any later document start, exactly as a cache carries them.
- Local attention: the previous (window - 1) keys and values, from as many shards back as the window reaches.
  Global attention (the MQA baseline): an all-gather of every shard's keys and values (each rank keeps those up to
  its own shard), O(T) memory per rank for its keys; ring attention would keep O(T / cp).
- The Context: positions are each token's global position in its document (``positions=None`` becomes the shard's
  offset + t), and document ids are made global by the count of document starts in the shards before.

Every exchange is the one differentiable all-gather of :class:`_Gather` (backward: an all-reduce), which gloo and
NCCL both run: the halo and key/value tails reach every rank, cp times what a point-to-point exchange would send
(small for the Conv1D and local attention, whose tails do not grow with the sequence).

The loss of each rank is over its own tokens; the caller sums losses and gradients over cp (like data parallelism).
The reference of every path is one process running the whole sequence (tests/parallel/test_context_parallel.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from griffin.config import ModelConfig
from griffin.layers.attention import MultiQueryAttention
from griffin.layers.context import EMPTY, Context
from griffin.layers.conv1d import CausalConv1D, next_conv_state
from griffin.layers.recurrent_block import RecurrentBlock
from griffin.layers.rg_lru import RGLRU
from griffin.model import CausalLM
from griffin.ops.attention import masked_attention, sliding_window_attention
from griffin.ops.rg_lru import rg_lru
from griffin.ops.scan import accumulation_dtype


def check_context_parallel(config: ModelConfig, cp: int, seq_len: int | None = None) -> None:
    """Raise a ValueError naming the values when ``cp`` ranks cannot split ``config``'s model or ``seq_len``."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive integer")
    if cp == 1:
        return
    problems = []
    if seq_len is not None and seq_len % cp:
        problems.append(f"seq_len={seq_len} is not a multiple of cp={cp}")
    if config.complex_lru and "recurrent" in config.block_types:
        problems.append("complex_lru=True (the CG-LRU's complex carry is not implemented)")
    if not config.attention_document_mask and any(kind != "recurrent" for kind in config.block_types):
        problems.append("attention_document_mask=False (the shards' attention is masked by global document ids)")
    if problems:
        raise ValueError(f"context parallelism over cp={cp} ranks cannot split: " + "; ".join(problems))


# Collectives ---------------------------------------------------------------------------------------------------
class _Gather(torch.autograd.Function):
    """All-gather along a new leading dim; backward: every rank's gradient summed (all-reduce), own slice kept."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(cp, *x.shape): every rank's ``x`` in rank order, differentiable (see :class:`_Gather`)."""
    return _Gather.apply(x, group)


def gather_plain(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(cp, *x.shape) for tensors without gradients (document starts and ids)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def before(gathered: Tensor, rank: int, n: int) -> Tensor:
    """The last ``n`` tokens before shard ``rank`` from each shard's gathered tail (cp, B, L, ...), as (B, m, ...) with
    m = min(n, rank · L); the tails are whole shards whenever more than one is needed, so the tokens are contiguous."""
    prev = gathered[:rank].transpose(0, 1)  # (B, rank, L, ...)
    prev = prev.reshape(prev.shape[0], -1, *prev.shape[3:])
    return prev[:, max(0, prev.shape[1] - n) :]


# The RG-LRU's carry --------------------------------------------------------------------------------------------
def shard_decay(gate_a: Tensor, a_param: Tensor, c: float, reset: Tensor | None) -> Tensor:
    """(B, T, D) a_1 ⋯ a_t, the weight of the state entering the shard in h_t (accumulation dtype); 0 from the shard's
    first document start on (Section 2.4: a_t = a^(c r_t), in log space). The plain-PyTorch reference of
    :class:`_DecayCorrection` and :class:`_ShardDecay`."""
    acc = accumulation_dtype(gate_a.dtype)
    log_a = -c * torch.sigmoid(gate_a.to(acc)) * torch.nn.functional.softplus(a_param.to(acc))
    decay = torch.exp(torch.cumsum(log_a, dim=1))
    if reset is not None:
        decay = decay * (torch.cumsum(reset.int(), dim=1) == 0)[..., None].to(acc)
    return decay


def _log_a_backward(d_log_a: Tensor, gate_a: Tensor, a_param: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """Gradients of gate_a and a_param from that of log a_t = -c · sigmoid(gate_a) · softplus(a_param)."""
    acc = d_log_a.dtype
    sig = torch.sigmoid(gate_a.to(acc))
    d_gate = d_log_a * (-c * torch.nn.functional.softplus(a_param.to(acc))) * sig * (1 - sig)
    d_param = (d_log_a * sig).sum((0, 1)) * (-c) * torch.sigmoid(a_param.to(acc))
    return d_gate.to(gate_a.dtype), d_param.to(a_param.dtype)


class _ShardDecay(torch.autograd.Function):
    """(B, D) the shard's whole decay product A = a_1 ⋯ a_T (0 if a document starts in it); keeps only gate_a (which
    the RG-LRU keeps anyway) and recomputes the rest in the backward pass."""

    @staticmethod
    def forward(ctx, gate_a: Tensor, a_param: Tensor, c: float, reset: Tensor | None) -> Tensor:
        ctx.c = c
        ctx.save_for_backward(gate_a, a_param, reset)
        return shard_decay(gate_a, a_param, c, reset)[:, -1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate_a, a_param, reset = ctx.saved_tensors
        last = shard_decay(gate_a, a_param, ctx.c, reset)[:, -1]
        d_log_a = (grad * last)[:, None].expand(gate_a.shape)  # d A / d log a_s = A for every s
        return (*_log_a_backward(d_log_a, gate_a, a_param, ctx.c), None, None)


class _DecayCorrection(torch.autograd.Function):
    """The correction of a shard scanned from zero by the state ``h_in`` entering it: y_t + (a_1 ⋯ a_t) h_in and
    h_T + (a_1 ⋯ a_T) h_in. Equal to :func:`shard_decay`'s expression in autograd, but it keeps only gate_a
    and h_in: the (B, T, D) decay products are recomputed in the backward pass, not kept."""

    @staticmethod
    def forward(ctx, y: Tensor, h_local: Tensor, gate_a: Tensor, a_param: Tensor, h_in: Tensor, c: float,
                reset: Tensor | None) -> tuple[Tensor, Tensor]:
        ctx.c = c
        ctx.save_for_backward(gate_a, a_param, h_in, reset)
        decay = shard_decay(gate_a, a_param, c, reset)
        out = (y.to(decay.dtype) + decay * h_in[:, None]).to(y.dtype)
        return out, h_local + decay[:, -1] * h_in

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_last: Tensor | None):
        gate_a, a_param, h_in, reset = ctx.saved_tensors
        decay = shard_decay(gate_a, a_param, ctx.c, reset)
        g = torch.zeros_like(decay) if d_out is None else d_out.to(decay.dtype)
        if d_last is not None:
            g = g.clone()
            g[:, -1] += d_last
        d_h_in = (g * decay).sum(1)
        d_cum = g * h_in[:, None] * decay  # through decay_t = mask_t · exp(sum_{s <= t} log a_s)
        d_log_a = torch.flip(torch.cumsum(torch.flip(d_cum, [1]), 1), [1])
        d_gate, d_param = _log_a_backward(d_log_a, gate_a, a_param, ctx.c)
        return d_out, d_last, d_gate, d_param, d_h_in, None, None


def combine_carries(h: Tensor, decay: Tensor, rank: int) -> Tensor:
    """The state entering shard ``rank``: the exclusive scan of the shards' carries (h_j, A_j), gathered as (cp, B, D)
    each, from a zero state. Rank 0 gets zeros still tied to the gathered tensors (its backward all-reduce must run)."""
    state = h[0] * 0
    for j in range(rank):
        state = decay[j] * state + h[j]
    return state


class ContextParallelRGLRU(RGLRU):
    """The RG-LRU over a shard of the sequence: the local scan from zero, the carries of the shards before, the
    correction (module docstring)."""

    cp_group: dist.ProcessGroup

    def forward(self, x: Tensor, reset: Tensor | None = None, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if h0 is not None:
            raise ValueError("context parallelism is for training: the RG-LRU takes no initial state under cp")
        gate_x, gate_a = self.input_gate(x), self.a_gate(x)
        y, h_local = rg_lru(x, gate_x, gate_a, self.a_param, self.c, None, reset)
        decay = _ShardDecay.apply(gate_a, self.a_param, self.c, reset)
        carries = gather(torch.stack([h_local, decay]), self.cp_group)  # (cp, 2, B, D)
        h_in = combine_carries(carries[:, 0], carries[:, 1], dist.get_rank(self.cp_group))
        return _DecayCorrection.apply(y, h_local, gate_a, self.a_param, h_in, self.c, reset)


# The Conv1D halo -----------------------------------------------------------------------------------------------
class ContextParallelConv1D(CausalConv1D):
    """The causal Conv1D over a shard: the (K - 1) inputs before it come from the shards before (a halo)."""

    cp_group: dist.ProcessGroup

    def forward(self, x: Tensor, reset: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        if state is not None:
            raise ValueError("context parallelism is for training: the Conv1D takes no cached state under cp")
        n = self.temporal_width - 1
        if n == 0:
            return super().forward(x, reset)
        rank, L = dist.get_rank(self.cp_group), min(n, x.shape[1])
        prev = before(gather(x[:, x.shape[1] - L :], self.cp_group), rank, n)
        prev_reset = None
        if reset is not None:
            prev_reset = before(gather_plain(reset[:, reset.shape[1] - L :], self.cp_group), rank, n)
        # the halo as a cache holds it: zeros before the sequence, inputs before a later document start zeroed
        halo = next_conv_state(x.new_zeros(x.shape[0], n, x.shape[2]), prev, prev_reset)
        # the shard's own convolution, plus the halo's terms in its first outputs (no (T, D) copy of x with the halo
        # prepended for autograd to keep): output t < K - 1 adds halo[n - s + t] · w[K - 1 - s] for s > t, unless a
        # document starts in [0, t]
        out = super().forward(x, reset)
        m = min(n, x.shape[1])
        extra = torch.stack([sum(halo[:, n - s + t] * self.w[n - s] for s in range(t + 1, n + 1))
                             for t in range(m)], 1)  # (B, m, D)
        if reset is not None:
            extra = extra * (torch.cumsum(reset[:, :m].int(), 1) == 0)[..., None].to(extra.dtype)
        return out + torch.nn.functional.pad(extra, (0, 0, 0, x.shape[1] - m))


# Attention -----------------------------------------------------------------------------------------------------
class ContextParallelAttention(MultiQueryAttention):
    """Attention over a shard: local attention with the (window - 1) keys and values before it, global attention
    with every earlier shard's (an all-gather). Under cp the Context always has document ids (global ones)."""

    cp_group: dist.ProcessGroup

    def attend(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None) -> Tensor:
        if segments is None:
            raise ValueError("context-parallel attention needs the document ids of apply_context_parallel's Context")
        rank, T = dist.get_rank(self.cp_group), q.shape[1]
        scale = self.head_dim**-0.5
        if self.local:
            n = self.window - 1
            L = min(n, T)
            kv = gather(torch.stack([k[:, T - L :], v[:, T - L :]], 1), self.cp_group)  # (cp, B, 2, L, H_kv, d)
            prev = before(kv.transpose(2, 3), rank, n)  # (B, m, 2, H_kv, d)
            prev_seg = before(gather_plain(segments[:, T - L :], self.cp_group), rank, n)
            keys, values = torch.cat([prev[:, :, 0], k], 1), torch.cat([prev[:, :, 1], v], 1)
            return sliding_window_attention(q, keys, values, self.window, scale, segments,
                                            torch.cat([prev_seg, segments], 1))
        kv = gather(torch.stack([k, v], 2), self.cp_group)  # (cp, B, T, 2, H_kv, d)
        kv = before(kv, rank + 1, (rank + 1) * T)  # the shards up to this one
        k_seg = before(gather_plain(segments, self.cp_group), rank + 1, (rank + 1) * T)
        q_idx = rank * T + torch.arange(T, device=q.device)
        k_idx = torch.arange(kv.shape[1], device=q.device)
        mask = (k_idx[None, None, :] <= q_idx[None, :, None]) & (k_seg[:, None, :] == segments[:, :, None])
        return masked_attention(q, kv[:, :, 0], kv[:, :, 1], mask, scale)


# Applying it ---------------------------------------------------------------------------------------------------
def shard_sequence(t: Tensor, rank: int, cp: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s contiguous shard of ``t`` along ``dim`` (a ValueError if cp does not divide its length)."""
    if t.shape[dim] % cp:
        raise ValueError(f"context parallelism splits the sequence of length {t.shape[dim]} over cp={cp} ranks: it "
                         "must be a multiple of cp")
    return t.chunk(cp, dim=dim)[rank]


def apply_context_parallel(model: CausalLM, group: dist.ProcessGroup) -> CausalLM:
    """Lay ``model`` over the cp ranks of ``group`` in place: every forward then takes this rank's contiguous shard
    of each sequence (positions, if given, are the shard's positions in the whole sequence's documents). Training
    only: no inference cache."""
    cp = dist.get_world_size(group)
    check_context_parallel(model.config, cp)
    if cp == 1:
        return model
    for block in model.blocks:
        temporal = block.temporal_block
        if isinstance(temporal, RecurrentBlock):
            swaps = ((temporal.conv_1d, ContextParallelConv1D), (temporal.rg_lru, ContextParallelRGLRU))
        else:
            swaps = ((temporal, ContextParallelAttention),)
        for module, cls in swaps:
            if type(module) not in cls.__mro__:
                raise ValueError(f"context parallelism cannot split a {type(module).__name__}")
            module.__class__ = cls
            module.cp_group = group
    base = model.context
    attention = any(kind != "recurrent" for kind in model.config.block_types)

    def context(input_ids: Tensor, positions: Tensor | None, cache) -> Context:
        if cache is not None:
            raise ValueError("context parallelism is for training: it takes no inference cache")
        rank = dist.get_rank(group)
        B, T = input_ids.shape
        if positions is None:  # one document per row: the shard continues the ones before
            positions = (rank * T + torch.arange(T, device=input_ids.device)).expand(B, T)
        ctx = base(input_ids, positions, None)
        if attention and model.config.attention_document_mask and ctx.segments is not None:
            starts = gather_plain(ctx.reset.sum(1), group)  # (cp, B) document starts per shard
            offset = starts[:rank].sum(0)
            segments = torch.where(ctx.segments == EMPTY, ctx.segments, ctx.segments + offset[:, None])
            ctx = dataclasses.replace(ctx, segments=segments)
        return ctx

    model.context = context
    return model


__all__ = ["ContextParallelAttention", "ContextParallelConv1D", "ContextParallelRGLRU", "apply_context_parallel",
           "check_context_parallel", "combine_carries", "gather", "shard_decay", "shard_sequence"]
