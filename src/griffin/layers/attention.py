"""Global and local (sliding-window) multi-query attention with RoPE (Section 2.3)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import ModelConfig
from griffin.inference.cache import AttentionCache, DecodeState
from griffin.inference.prepack import LinearFn
from griffin.layers.rope import apply_rope, rope_angles, rotate
from griffin.ops.local_attention import fused_sdpa, sliding_window_attention


class DecodeInputs(NamedTuple):
    """What every attention block of one decode step shares, computed once per step by the model."""

    cos: Tensor  # (B, 1, rope_dim // 2) RoPE angles of the new tokens' positions, in the model's dtype
    sin: Tensor
    local_slot: Tensor  # (1,) long: the ring-buffer slot this step writes (step mod window)
    global_slot: Tensor  # (1,) long: the global-attention slot this step writes (step)
    kv_len: int | None  # attend to the first kv_len slots only (those in use; eager), None: every slot (static)


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
        window = self.window
        if window is not None and window < T:
            out = sliding_window_attention(q, k, v, window, self.head_dim**-0.5, segments, segments)
        else:
            out = self._attend_full(*(t.transpose(1, 2) for t in (q, k, v)), segments).transpose(1, 2)
        return self.proj_final(out.reshape(B, T, self.num_heads * self.head_dim))

    def _forward_cached(self, x: Tensor, positions: Tensor, segments: Tensor | None, cache: AttentionCache,
                        step: int) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, positions)
        slots = cache.k.shape[1]
        q_index = torch.arange(step, step + T, device=x.device)
        if segments is None:
            segments = torch.zeros(B, T, dtype=torch.long, device=x.device)
        if cache.local and T > 1:  # a chunk: the ring buffer's tokens (oldest first), then the chunk's own
            held = min(step, slots)
            order = (torch.arange(held, device=x.device) + step) % held if step > slots else slice(None, held)
            keys, values = torch.cat([cache.k[:, order], k], 1), torch.cat([cache.v[:, order], v], 1)
            k_seg = torch.cat([cache.segment[:, order], segments], 1)
            out = sliding_window_attention(q, keys, values, self.window, self.head_dim**-0.5, segments, k_seg)
            last = q_index[-slots:]  # then the chunk's newest keys replace the oldest
            self._write(cache, last % slots, k[:, -slots:], v[:, -slots:], segments[:, -slots:], index=last)
            return self.proj_final(out.reshape(B, T, self.num_heads * self.head_dim))
        if cache.local:
            self._write(cache, q_index % slots, k, v, segments, index=q_index)
        else:
            if step + T > slots:
                raise ValueError(f"the global-attention KV cache holds {slots} tokens; "
                                 f"cannot process tokens {step}..{step + T - 1}: size it with a larger max_length")
            self._write(cache, q_index, k, v, segments)
        used = min(step + T, slots)  # slots [0, used) hold tokens once x is written (slot = step mod slots)
        keys, values = cache.k[:, :used], cache.v[:, :used]
        mask = attention_mask(q_index, cache.index[:used], self.window, segments, cache.segment[:, :used])
        mask &= cache.index[:used] >= 0
        if T == 1:
            bias = torch.zeros(B, used, dtype=q.dtype, device=x.device).masked_fill_(~mask[:, 0], -math.inf)
            return self.proj_final(self._attend_one(q[:, 0], keys, values, bias))[:, None]
        out = self._sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None])
        return self.proj_final(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def decode_step(self, x: Tensor, cache: AttentionCache, state: DecodeState, inputs: DecodeInputs,
                    linear: LinearFn = F.linear) -> Tensor:
        """One token per row (Section 5): x (B, D) at the positions of ``inputs``' RoPE angles. Writes the key and
        value at this step's slot (in place), then attends over the slots in use with ``state``'s mask; the
        arithmetic of :meth:`forward` at T = 1, with ``linear`` for the projections."""
        B = x.shape[0]
        q = linear(x, self.proj_q.weight, self.proj_q.bias).view(B, self.num_heads, self.head_dim)
        k = linear(x, self.proj_k.weight, self.proj_k.bias).view(B, self.num_kv_heads, self.head_dim)
        v = linear(x, self.proj_v.weight, self.proj_v.bias).view(B, 1, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, inputs.cos, inputs.sin), rotate(k, inputs.cos, inputs.sin)
        slot = inputs.local_slot if cache.local else inputs.global_slot
        cache.k.index_copy_(1, slot, k[:, None].to(cache.k.dtype))
        cache.v.index_copy_(1, slot, v.to(cache.v.dtype))
        cache.index.index_copy_(0, slot, state.step)
        cache.segment.index_copy_(1, slot, state.segment[:, None])
        bias = state.local_bias if cache.local else state.global_bias
        n = cache.k.shape[1] if inputs.kv_len is None else min(inputs.kv_len, cache.k.shape[1])
        out = self._attend_one(q, cache.k[:, :n], cache.v[:, :n], bias[:, :n])
        return linear(out, self.proj_final.weight, self.proj_final.bias)

    def _attend_one(self, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """One query per row: q (B, H, d) over keys and values (B, S, H_kv, d) with an additive mask ``bias``
        (B, S) (0 or -inf) -> (B, H * d). Two batched matmuls, the scale and the mask fused into the first: on
        CPU far cheaper than a fused kernel's setup for a single query."""
        B, H, d = q.shape
        S, Hk = keys.shape[1], self.num_kv_heads
        qg = q.reshape(B * Hk, H // Hk, d)  # the heads sharing a key/value head side by side
        kt = keys.permute(0, 2, 3, 1).reshape(B * Hk, d, S)
        vs = values.transpose(1, 2).reshape(B * Hk, S, d)
        bias = bias[:, None, None, :].expand(B, Hk, 1, S).reshape(B * Hk, 1, S).to(q.dtype)
        scores = torch.baddbmm(bias, qg, kt, alpha=self.head_dim**-0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.bmm(probs, vs).view(B, H * d)

    @staticmethod
    def _write(cache: AttentionCache, slots: Tensor, k: Tensor, v: Tensor, segments: Tensor,
               index: Tensor | None = None) -> None:
        cache.k[:, slots] = k.to(cache.k.dtype)
        cache.v[:, slots] = v.to(cache.v.dtype)
        cache.index[slots] = slots if index is None else index
        cache.segment[:, slots] = segments

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        return fused_sdpa(q, k, v, mask, self.head_dim**-0.5, causal)

    def _attend_full(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None) -> Tensor:
        if segments is None:
            return self._sdpa(q, k, v, None, causal=True)
        idx = torch.arange(q.shape[2], device=q.device)
        mask = attention_mask(idx, idx, None, segments, segments)  # (B, T, T)
        return self._sdpa(q, k, v, mask[:, None])
