"""Rotary position embeddings (Su et al., 2021) on the first ``rope_dim`` dims of each head (Section 2.3)."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(rope_dim: int, base: float, device: torch.device | str | None = None) -> Tensor:
    """The rotation speed of each of the rope_dim // 2 pairs: base^(-2i / rope_dim), float32."""
    freq = torch.arange(rope_dim // 2, device=device, dtype=torch.float32)
    return 1.0 / base ** (2.0 * freq / rope_dim)


def rope_angles(positions: Tensor, rope_dim: int, base: float, inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, rope_dim // 2) for integer positions, e.g. (B, T)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rope_dim, base, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return torch.cos(angles), torch.sin(angles)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn pairs (i, i + half) of x's last dim by the angles of cos/sin (..., half), already broadcastable to
    x[..., :half] and in x's dtype; the dims after the first 2 * half are left as they are."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, heads, head_dim): pairs (i, i + rope_dim/2) of the first rope_dim dims turn by angle i."""
    return rotate(x, cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype))
