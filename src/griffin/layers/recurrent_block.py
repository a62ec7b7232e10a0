"""The recurrent block (Section 2.3, Figure 2c)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import ModelConfig
from griffin.inference.cache import RecurrentCache
from griffin.inference.prepack import LinearFn
from griffin.layers.conv1d import CausalConv1D
from griffin.layers.rg_lru import CGLRU, RGLRU


class RecurrentBlock(nn.Module):
    """Two D -> D_RNN branches: GeLU on one; Conv1D then RG-LRU on the other; product; D_RNN -> D."""

    def __init__(self, config: ModelConfig, final_init_scale: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.final_init_scale = final_init_scale
        D, R = config.width, config.rnn_width
        self.linear_y = nn.Linear(D, R)
        self.linear_x = nn.Linear(D, R)
        self.linear_out = nn.Linear(R, D)
        self.conv_1d = CausalConv1D(R, config.conv1d_width)
        lru = CGLRU if config.complex_lru else RGLRU
        self.rg_lru = lru(R, config.gate_blocks, config.rg_lru_c, config.a_init_range)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        D, R = self.config.width, self.config.rnn_width
        for lin in (self.linear_y, self.linear_x):
            nn.init.normal_(lin.weight, std=math.sqrt(1.0 / D))
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.linear_out.weight, std=math.sqrt(self.final_init_scale / R))
        nn.init.zeros_(self.linear_out.bias)
        self.conv_1d.reset_parameters()
        self.rg_lru.reset_parameters()

    def forward(self, x: Tensor, reset: Tensor | None = None, pad: Tensor | None = None,
                cache: RecurrentCache | None = None) -> Tensor:
        """x: (B, T, D); reset: (B, T) bool, True where a document starts; pad: (B, T) bool, True at padding
        tokens, whose Conv1D inputs are zeroed; cache: the state before x, updated in place."""
        y = F.gelu(self.linear_y(x), approximate=self.config.gelu_approximation)
        u = self.linear_x(x)
        if pad is not None:
            u = u.masked_fill(pad[..., None], 0.0)
        conv_reset = reset if self.config.conv1d_document_reset else None
        conv = self.conv_1d(u, conv_reset, None if cache is None else cache.conv)
        h, h_last = self.rg_lru(conv, reset, None if cache is None else cache.h)
        if cache is not None:
            cache.conv.copy_(next_conv_state(cache.conv, u, conv_reset))
            cache.h.copy_(h_last)
        return self.linear_out(h * y)

    def decode_step(self, x: Tensor, cache: RecurrentCache, linear: LinearFn = F.linear) -> Tensor:
        """One token per row (Section 5): x (B, D) continues the documents in ``cache``, updated in place. The
        arithmetic of :meth:`forward` at T = 1, without masks, resets or a reassigned state; ``linear`` does the
        matmuls (:class:`griffin.inference.prepack.PrepackedLinear` on CPU)."""
        y = F.gelu(linear(x, self.linear_y.weight, self.linear_y.bias), approximate=self.config.gelu_approximation)
        u = linear(x, self.linear_x.weight, self.linear_x.bias)
        h = self.rg_lru.decode_step(self.conv_1d.decode_step(u, cache.conv), cache.h)
        return linear(h * y, self.linear_out.weight, self.linear_out.bias)


def next_conv_state(state: Tensor, u: Tensor, reset: Tensor | None) -> Tensor:
    """The last K-1 Conv1D inputs after ``u``; inputs before a later document start are zeroed, so the next
    chunk's convolution sees nothing of the previous document."""
    seq = torch.cat([state, u.to(state.dtype)], dim=1)
    if reset is not None:
        r = torch.cat([reset.new_zeros(reset.shape[0], state.shape[1]), reset], dim=1).int()
        later = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1]) - r  # starts strictly after each step
        seq = seq * (later == 0)[..., None].to(seq.dtype)
    return seq[:, -state.shape[1] :].contiguous() if state.shape[1] else seq[:, :0]
