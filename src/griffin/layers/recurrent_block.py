"""The recurrent block (Section 2.3, Figure 2c), and the fixed-size state it owns for inference (Section 5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from griffin.config import ModelConfig
from griffin.layers.context import Context
from griffin.layers.conv1d import CausalConv1D, next_conv_state
from griffin.layers.linear_group import LinearGroup
from griffin.layers.rg_lru import CGLRU, RGLRU
from griffin.ops.gelu import gelu


@dataclass
class RecurrentState:
    """What a recurrent block carries from one token to the next, whatever the sequence length; updated in place."""

    conv: Tensor  # (B, K-1, D_RNN) the Conv1D's last inputs, zeroed before a document start
    h: Tensor  # (B, D_RNN) RG-LRU state in float32 or wider (complex and D_RNN/2 wide for the CG-LRU)


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
        self.in_proj = LinearGroup(self, ("linear_y", "linear_x"))  # one input: fused for decoding
        self.conv_1d = CausalConv1D(R, config.conv1d_width)
        lru = CGLRU if config.complex_lru else RGLRU
        self.rg_lru = lru(R, config.gate_blocks, config.rg_lru_c, config.a_init_range, config.a_init_rule)
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

    def init_cache(self, batch_size: int, max_length: int | None, dtype: torch.dtype,
                   device: torch.device | str) -> RecurrentState:
        """An empty state (``max_length`` is irrelevant: the state has a fixed size)."""
        c = self.config
        state_dtype = torch.promote_types(dtype, torch.float32)  # the recurrence's accumulation dtype
        state_dtype = state_dtype.to_complex() if c.complex_lru else state_dtype
        return RecurrentState(torch.zeros(batch_size, c.conv1d_width - 1, c.rnn_width, dtype=dtype, device=device),
                              torch.zeros(batch_size, c.lru_width, dtype=state_dtype, device=device))

    def forward(self, x: Tensor, ctx: Context, cache: RecurrentState | None = None) -> Tensor:
        """x: (B, T, D). Document starts (``ctx.reset``) reset the RG-LRU and, if configured, the Conv1D; padding's
        Conv1D inputs are zeroed. With ``cache`` (the state before x), the state after x is written back to it."""
        y, u = self.in_proj(x)
        y = gelu(y, self.config.gelu_approximation)
        if ctx.pad is not None:
            u = u.masked_fill(ctx.pad[..., None], 0.0)
        conv_reset = ctx.reset if self.config.conv1d_document_reset else None
        conv = self.conv_1d(u, conv_reset, None if cache is None else cache.conv)
        h, h_last = self.rg_lru(conv, ctx.reset, None if cache is None else cache.h)
        if cache is not None and torch.is_grad_enabled():  # training from a cached state (griffin synth
            # --prefix-stream): the backward reads the state before, so the state after replaces it, not overwrites it
            cache.conv, cache.h = next_conv_state(cache.conv, u, conv_reset), h_last
        elif cache is not None:
            cache.conv.copy_(next_conv_state(cache.conv, u, conv_reset))
            cache.h.copy_(h_last)
        return self.linear_out(h * y)
