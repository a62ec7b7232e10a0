"""Global and local (sliding-window) multi-query attention with RoPE (Section 2.3), and the key/value cache each
attention block owns for inference (Section 5, Appendix G.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from numba.extending import register_jitable
from torch import Tensor, nn

from griffin.config import ModelConfig
from griffin.layers.context import EMPTY, Context
from griffin.layers.linear_group import LinearGroup
from griffin.layers.rope import apply_rope
from griffin.ops.attention import causal_attention, local_by_causal_chunks, masked_attention, sliding_window_attention


@register_jitable
def cache_slot(step, slots, local):
    """The slot that holds a row's step ``step`` (an int or an integer tensor) in a key/value cache of ``slots`` slots:
    step mod slots in a local block's ring, step itself in a global cache. The one place this is computed, for the
    model's attention and for the CPU decode engine's kernels alike (numba compiles it into them)."""
    return step % slots if local else step


@dataclass
class KVCache:
    """The keys and values an attention block has seen, one row per sequence; updated in place by the block.

    A local block keeps a ring buffer of ``attention_window`` slots (the token of row step t sits in slot t mod window),
    so its size is bounded by the window; a global block keeps ``max_length`` slots (step t in slot t), preallocated so
    that a decode step has static shapes. Rows advance independently: each has its own count of tokens written.
    """

    k: Tensor  # (B, S, H_kv, head_dim)
    v: Tensor  # (B, S, H_kv, head_dim)
    segment: Tensor  # (B, S) document id of each slot's token; EMPTY if never written, or padding
    count: Tensor  # (B,) tokens written so far in each row (padding included)

    def write(self, slots: Tensor, k: Tensor, v: Tensor, segments: Tensor) -> None:
        """Store k, v (B, n, H_kv, d) and their document ids (B, n) at the given slots (B, n) of each row."""
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        self.k[rows, slots] = k.to(self.k.dtype)
        self.v[rows, slots] = v.to(self.v.dtype)
        self.segment[rows, slots] = segments


class MultiQueryAttention(nn.Module):
    """MQA (one key/value head by default) with RoPE; ``local=True`` restricts each query to the
    ``config.attention_window`` most recent keys, itself included."""

    def __init__(self, config: ModelConfig, local: bool, final_init_scale: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.local = local
        self.final_init_scale = final_init_scale
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        D = config.width
        self.proj_q = nn.Linear(D, self.num_heads * self.head_dim, bias=False)
        self.proj_k = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.proj_v = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.proj_final = nn.Linear(self.num_heads * self.head_dim, D, bias=True)
        self.qkv = LinearGroup(self, ("proj_q", "proj_k", "proj_v"))  # one input: fused for decoding
        self.reset_parameters()

    @property
    def window(self) -> int | None:
        return self.config.attention_window if self.local else None

    def reset_parameters(self) -> None:
        D = self.config.width
        for lin in (self.proj_q, self.proj_k, self.proj_v):
            nn.init.normal_(lin.weight, std=math.sqrt(1.0 / D))
        nn.init.normal_(self.proj_final.weight, std=math.sqrt(self.final_init_scale / (self.num_heads * self.head_dim)))
        nn.init.zeros_(self.proj_final.bias)

    def init_cache(self, batch_size: int, max_length: int | None, dtype: torch.dtype,
                   device: torch.device | str) -> KVCache:
        """An empty cache: the window's slots for local attention, ``max_length`` slots for global attention."""
        if self.local:
            slots = self.config.attention_window
        elif max_length is None or max_length < 1:
            raise ValueError(f"a model with global attention needs max_length >= 1 to size its KV cache, "
                             f"got {max_length}")
        else:
            slots = max_length
        shape = (batch_size, slots, self.num_kv_heads, self.head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       torch.full((batch_size, slots), EMPTY, dtype=torch.long, device=device),
                       torch.zeros(batch_size, dtype=torch.long, device=device))

    def forward(self, x: Tensor, ctx: Context, cache: KVCache | None = None) -> Tensor:
        """x: (B, T, D). Queries, keys and values rotated by RoPE at the tokens' document positions; each query attends
        to the keys of its own document up to itself (within the window if local). With ``cache``, the tokens
        continue the cached sequences and are written to the cache."""
        B, T, _ = x.shape
        # Heads: as many as the projections give (all of them, or this device's share under tensor parallelism).
        q, k, v = (t.view(B, T, t.shape[-1] // self.head_dim, self.head_dim) for t in self.qkv(x))
        if ctx.rope is not None:
            q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
        if cache is None:
            out = self.attend(q, k, v, ctx.segments)
        elif self.local:
            out = self.attend_ring(q, k, v, ctx.segments, cache)
        else:
            out = self.attend_cached(q, k, v, ctx.segments, cache, ctx.cache_len)
        return self.proj_final(out.flatten(2))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None) -> Tensor:
        """Causal attention within the sequence (training, or a prompt without a cache)."""
        T = q.shape[1]
        scale = self.head_dim**-0.5
        window = self.window if self.window is not None and self.window < T else None  # None: global
        if window is not None and not local_by_causal_chunks(q):
            return sliding_window_attention(q, k, v, window, scale, segments, segments)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return causal_attention(q, k, v, scale, segments, segments, window=window).transpose(1, 2)

    def attend_ring(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor, cache: KVCache) -> Tensor:
        """Local attention over the ring buffer, then the new tokens replace the oldest. One token per row: the ring
        holds exactly its window once the token is written, in any order. A longer chunk: the ring in time order,
        then the chunk, through the sliding-window kernel."""
        B, T = q.shape[:2]
        S = cache.k.shape[1]
        steps = cache.count[:, None] + torch.arange(T, device=q.device)  # each row's step of each new token
        if T == 1:
            cache.write(cache_slot(steps, S, True), k, v, segments)
            visible = cache.segment[:, None, :] == segments[:, :, None]  # (B, 1, S)
            out = masked_attention(q, cache.k, cache.v, visible, self.head_dim**-0.5)
        else:
            order = cache_slot(cache.count[:, None] + torch.arange(S, device=q.device), S, True)  # oldest slot first
            rows = torch.arange(B, device=q.device)[:, None]
            keys, values = torch.cat([cache.k[rows, order], k], 1), torch.cat([cache.v[rows, order], v], 1)
            k_seg = torch.cat([cache.segment[rows, order], segments], 1)
            out = sliding_window_attention(q, keys, values, S, self.head_dim**-0.5, segments, k_seg)
            last = slice(max(0, T - S), T)  # the chunk's newest tokens replace the oldest
            cache.write(cache_slot(steps[:, last], S, True), k[:, last], v[:, last], segments[:, last])
        cache.count.add_(T)
        return out

    def attend_cached(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor, cache: KVCache,
                      cache_len: int | None) -> Tensor:
        """Global attention: the new tokens are written at their steps' slots, then each query attends to the slots
        of its document up to its own step (only the first ``cache_len`` slots, which hold every token, if given)."""
        T = q.shape[1]
        steps = cache.count[:, None] + torch.arange(T, device=q.device)  # (B, T)
        cache.write(cache_slot(steps, cache.k.shape[1], False), k, v, segments)
        cache.count.add_(T)
        n = cache.k.shape[1] if cache_len is None else min(cache_len, cache.k.shape[1])
        slot = torch.arange(n, device=q.device)
        visible = (slot <= steps[:, :, None]) & (cache.segment[:, None, :n] == segments[:, :, None])  # (B, T, n)
        return masked_attention(q, cache.k[:, :n], cache.v[:, :n], visible, self.head_dim**-0.5)
