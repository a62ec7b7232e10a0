"""The causal depthwise Conv1D of the recurrent block (Section 2.3, temporal width 4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from griffin.ops.conv1d import causal_conv1d


class CausalConv1D(nn.Module):
    """y_t = b + sum_{s=0}^{K-1} w[K-1-s] * x_{t-s}, separately for each channel.

    ``w`` has shape (K, width); ``w[K-1]`` multiplies the current input. With ``reset`` (B, T), a term
    x_{t-s} is dropped when a document starts in (t-s, t], so no document sees the one before it.
    The operator is :func:`griffin.ops.conv1d.causal_conv1d` (fused CPU kernels; the reference
    :func:`griffin.ops.conv1d.conv1d_ref`).
    """

    def __init__(self, width: int, temporal_width: int = 4) -> None:
        super().__init__()
        self.temporal_width = temporal_width
        self.w = nn.Parameter(torch.empty(temporal_width, width))
        self.b = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self, w_init_variance_scale: float = 0.01) -> None:
        nn.init.normal_(self.w, std=math.sqrt(w_init_variance_scale / self.temporal_width))
        nn.init.zeros_(self.b)

    def forward(self, x: Tensor, reset: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        """x: (B, T, width). ``state``: optional (B, K-1, width) inputs that precede x (a cache)."""
        return causal_conv1d(x, self.w, self.b, reset, state)


def next_conv_state(state: Tensor, x: Tensor, reset: Tensor | None) -> Tensor:
    """The last K-1 Conv1D inputs after ``x`` (B, T, width) follows ``state`` (B, K-1, width); inputs before a later
    document start are zeroed, so that the next chunk's convolution sees nothing of the previous document."""
    seq = torch.cat([state, x.to(state.dtype)], dim=1)
    if reset is not None:
        r = torch.cat([reset.new_zeros(reset.shape[0], state.shape[1]), reset], dim=1).int()
        later = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1]) - r  # starts strictly after each step
        seq = seq * (later == 0)[..., None].to(seq.dtype)
    return seq[:, -state.shape[1] :] if state.shape[1] else seq[:, :0]
