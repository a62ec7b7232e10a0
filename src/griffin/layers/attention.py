"""Global and local (sliding-window) multi-query attention with RoPE (Section 2.3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.cache import AttentionCache
from griffin.config import ModelConfig
from griffin.layers.rope import apply_rope, rope_angles

# Local attention processes queries in chunks of at least this many tokens; a chunk of C queries attends
# to C + window - 1 keys, so memory is O(T * (C + window)) instead of O(T^2).
MIN_LOCAL_CHUNK = 128


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None,
                   q_seg: Tensor | None, k_seg: Tensor | None) -> Tensor:
    """Boolean mask (..., Tq, Tk): causal, within ``window`` keys (query included), same document.

    q_pos/k_pos are absolute indices in the packed sequence (not document positions).
    """
    delta = q_pos[..., :, None] - k_pos[..., None, :]
    mask = delta >= 0
    if window is not None:
        mask &= delta < window
    if q_seg is not None and k_seg is not None:
        mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])
    return mask


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

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, T, H, d) and keys/values (B, T, H_kv, d), RoPE applied at the document positions."""
        B, T, _ = x.shape
        q = self.proj_q(x).view(B, T, self.num_heads, self.head_dim)
        k = self.proj_k(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.proj_v(x).view(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = rope_angles(positions, self.config.rope_dim, self.config.rope_base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, positions: Tensor, segments: Tensor | None = None,
                cache: AttentionCache | None = None, step: int = 0) -> Tensor:
        """x: (B, T, D); positions: (B, T) position in document; segments: (B, T) ids of the documents a query
        may see (EMPTY at padding), or None if every row is one document. With ``cache`` (the keys and values of
        the ``step`` tokens before x), x is attended together with the cache, which is then updated in place."""
        B, T, _ = x.shape
        if cache is not None:
            return self._forward_cached(x, positions, segments, cache, step)
        q, k, v = self.project(x, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
        window = self.window
        if window is not None and window >= T:
            window = None
        if window is None:
            out = self._attend_full(q, k, v, segments)
        else:
            out = self._attend_local(q, k, v, segments, window)
        return self.proj_final(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _forward_cached(self, x: Tensor, positions: Tensor, segments: Tensor | None, cache: AttentionCache,
                        step: int) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, positions)
        slots = cache.k.shape[1]
        q_index = torch.arange(step, step + T, device=x.device)
        if segments is None:
            segments = torch.zeros(B, T, dtype=torch.long, device=x.device)
        if not cache.local:
            if step + T > slots:
                raise ValueError(f"the global-attention KV cache holds {slots} tokens; "
                                 f"cannot process tokens {step}..{step + T - 1}: size it with a larger max_length")
            self._write(cache, q_index, k, v, segments)  # then attend over the whole (static-size) buffer
            keys, values, k_index, k_seg = cache.k, cache.v, cache.index, cache.segment
        elif T == 1:
            self._write(cache, q_index % slots, k, v, segments, index=q_index)
            keys, values, k_index, k_seg = cache.k, cache.v, cache.index, cache.segment
        else:
            keys, values = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
            k_index, k_seg = torch.cat([cache.index, q_index]), torch.cat([cache.segment, segments], 1)
        mask = attention_mask(q_index, k_index, self.window, segments, k_seg) & (k_index >= 0)
        if T == 1:
            out = self._attend_one(q, keys, values, mask)
        else:
            out = self._sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None])
        if cache.local and T > 1:
            last = q_index[-slots:]
            self._write(cache, last % slots, k[:, -slots:], v[:, -slots:], segments[:, -slots:], index=last)
        return self.proj_final(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _attend_one(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Decode-step attention of one query per row, (B, 1, H, d) -> (B, H, 1, d): two small matmuls, which
        on CPU are far cheaper than a fused kernel's setup for a single query."""
        B, _, H, d = q.shape
        G = H // self.num_kv_heads
        qg = q.view(B, self.num_kv_heads, G, d)  # heads sharing a key/value head side by side
        scores = torch.einsum("bkgd,bskd->bkgs", qg, keys) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))  # mask (B, 1, S)
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.einsum("bkgs,bskd->bkgd", probs, values)
        return out.reshape(B, H, 1, d)

    @staticmethod
    def _write(cache: AttentionCache, slots: Tensor, k: Tensor, v: Tensor, segments: Tensor,
               index: Tensor | None = None) -> None:
        cache.k[:, slots] = k.to(cache.k.dtype)
        cache.v[:, slots] = v.to(cache.v.dtype)
        cache.index[slots] = slots if index is None else index
        cache.segment[:, slots] = segments

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.head_dim**-0.5,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )

    def _attend_full(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None) -> Tensor:
        if segments is None:
            return self._sdpa(q, k, v, None, causal=True)
        idx = torch.arange(q.shape[2], device=q.device)
        mask = attention_mask(idx, idx, None, segments, segments)  # (B, T, T)
        return self._sdpa(q, k, v, mask[:, None])

    def _attend_local(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None, window: int) -> Tensor:
        """Sliding-window attention in query chunks: never a T x T mask or score matrix."""
        B, H, T, d = q.shape
        C = max(window, MIN_LOCAL_CHUNK)
        if T <= C:
            idx = torch.arange(T, device=q.device)
            mask = attention_mask(idx, idx, window, segments, segments)
            return self._sdpa(q, k, v, mask if segments is None else mask[:, None])
        n = -(-T // C)
        span = C + window - 1  # keys seen by one chunk of queries
        pad_front, pad_back = window - 1, n * C - T
        q_c = F.pad(q, (0, 0, 0, pad_back)).unflatten(2, (n, C)).transpose(1, 2)  # (B, n, H, C, d)

        def key_blocks(t: Tensor) -> Tensor:  # (B, Hk, T, d) -> (B, n, Hk, span, d)
            t = F.pad(t, (0, 0, pad_front, pad_back))
            return t.unfold(2, span, C).permute(0, 2, 1, 4, 3)

        k_c, v_c = key_blocks(k), key_blocks(v)
        q_pos = torch.arange(n * C, device=q.device).view(n, C)
        k_pos = (torch.arange(n * C + window - 1, device=q.device) - pad_front).unfold(0, span, C)  # (n, span)
        mask = attention_mask(q_pos, k_pos, window, None, None) & (k_pos >= 0)[:, None, :]  # (n, C, span)
        if segments is not None:
            seg = F.pad(segments, (0, pad_back), value=-1)  # padded queries form their own document
            q_seg = seg.view(B, n, C)
            k_seg = F.pad(seg, (pad_front, 0), value=-2).unfold(1, span, C)
            mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])  # (B, n, C, span)
        mask = mask.unsqueeze(-3)  # broadcast over heads
        out = self._sdpa(q_c, k_c, v_c, mask)  # (B, n, H, C, d)
        return out.transpose(1, 2).flatten(2, 3)[:, :, :T]
