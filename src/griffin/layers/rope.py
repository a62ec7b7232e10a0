"""Rotary position embeddings (Su et al., 2021) on the first ``rope_dim`` dims of each head (Section 2.3)."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(positions: Tensor, rope_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (B, T, rope_dim // 2) for integer positions (B, T)."""
    freq = torch.arange(rope_dim // 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / base ** (2.0 * freq / rope_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, heads, head_dim): pairs (i, i + rope_dim/2) of the first rope_dim dims turn by angle i."""
    half = cos.shape[-1]
    if half == 0:
        return x
    cos = cos[:, :, None, :].to(x.dtype)
    sin = sin[:, :, None, :].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
