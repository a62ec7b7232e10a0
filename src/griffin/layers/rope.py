"""Rotary position embeddings (Su et al., 2021) on the first ``rope_dim`` dims of each head (Section 2.3).

In a compiled CPU step the angles' cos and sin are computed by an opaque operator (:func:`rope_angles_cpu`), once per
step: left to Inductor, they were fused into the rotation of every query and key, forward and backward, and recomputed
there (a power, a cos and a sin for every element of q and k rather than once per position). Same numbers either
way."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(rope_dim: int, base: float, device: torch.device | str | None = None) -> Tensor:
    """The rotation speed of each of the rope_dim // 2 pairs: base^(-2i / rope_dim), float32."""
    freq = torch.arange(rope_dim // 2, device=device, dtype=torch.float32)
    return 1.0 / base ** (2.0 * freq / rope_dim)


def rope_angles_ref(positions: Tensor, rope_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, rope_dim // 2) for integer positions, e.g. (B, T); float32."""
    angles = positions.to(torch.float32)[..., None] * rope_inv_freq(rope_dim, base, positions.device)
    return torch.cos(angles), torch.sin(angles)


@torch.library.custom_op("griffin::rope_angles_cpu", mutates_args=(), device_types="cpu")
def rope_angles_cpu(positions: Tensor, rope_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """:func:`rope_angles_ref` as one operator the compiler does not look into (see the module docstring)."""
    return rope_angles_ref(positions, rope_dim, base)


@rope_angles_cpu.register_fake
def _(positions, rope_dim, base):
    shape = (*positions.shape, rope_dim // 2)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def rope_angles(positions: Tensor, rope_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, rope_dim // 2) for integer positions, e.g. (B, T); float32. Through
    :func:`rope_angles_cpu` where a CPU step is being compiled, else :func:`rope_angles_ref`."""
    if torch.compiler.is_compiling() and positions.device.type == "cpu":
        return rope_angles_cpu(positions, rope_dim, base)
    return rope_angles_ref(positions, rope_dim, base)


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
