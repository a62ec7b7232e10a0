"""The causal depthwise Conv1D of the recurrent block in plain PyTorch (Section 2.3, temporal width 4): the
reference of the fused kernels in :mod:`griffin.ops.conv1d.cpu`.

    y_t = b + sum_{s=0}^{K-1} w[K-1-s] * x_{t-s}      separately for each channel

With ``reset`` (B, T), a term x_{t-s} is dropped when a document starts in (t-s, t], so no document sees the one
before it. ``state`` (B, K-1, width): the inputs that precede x (a cache).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_conv1d_inputs(x: Tensor, w: Tensor, b: Tensor, reset: Tensor | None, state: Tensor | None) -> None:
    """Shapes and dtypes, checked before any kernel runs (the message names the offending value)."""
    if x.ndim != 3:
        raise ValueError(f"conv1d: x must be (batch, time, width), got shape {tuple(x.shape)}")
    width = x.shape[2]
    if w.ndim != 2 or w.shape[1] != width or w.shape[0] < 1:
        raise ValueError(f"conv1d: w must be (temporal width, {width}), got shape {tuple(w.shape)}")
    if b.shape != (width,):
        raise ValueError(f"conv1d: b must be ({width},), got shape {tuple(b.shape)}")
    if reset is not None and (reset.dtype != torch.bool or reset.shape != x.shape[:2]):
        raise ValueError(f"conv1d: reset must be a bool tensor of shape {tuple(x.shape[:2])}, got "
                         f"{reset.dtype} {tuple(reset.shape)}")
    if state is not None and (state.ndim != 3 or state.shape[0] != x.shape[0] or state.shape[2] != width):
        raise ValueError(f"conv1d: state must be ({x.shape[0]}, K - 1, {width}), got shape {tuple(state.shape)}")


def conv1d_keep_mask(reset: Tensor, shift: int, start: int) -> Tensor:
    """For outputs t >= start: True where no document starts in (t - shift, t] (inside this chunk)."""
    batch, T = reset.shape
    keep = torch.ones(batch, T - start, dtype=torch.bool, device=reset.device)
    for j in range(shift):  # a document starting at t - j hides x_{t-shift}
        first = max(start, j)
        keep[:, first - start :] &= ~reset[:, first - j : T - j]
    return keep


def conv1d_ref(x: Tensor, w: Tensor, b: Tensor, reset: Tensor | None = None, state: Tensor | None = None) -> Tensor:
    """The convolution as a sum of shifted slices of x (no padded copy of the sequence); autograd differentiates
    it. The output has the promoted dtype of x, w and b."""
    K, T = w.shape[0], x.shape[1]
    if state is not None:
        x = torch.cat([state.to(x.dtype), x], dim=1)
    offset = x.shape[1] - T
    out = x[:, offset:] * w[K - 1] + b
    for s in range(1, K):
        start = max(0, s - offset)  # first output with an input s steps back
        if start >= T:
            break
        term = x[:, offset + start - s : offset + T - s] * w[K - 1 - s]
        if reset is not None:
            term = term * conv1d_keep_mask(reset, s, start)[..., None].to(term.dtype)
        out[:, start:] += term
    return out
