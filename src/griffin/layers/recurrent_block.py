"""The recurrent block (Section 2.3, Figure 2c)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import ModelConfig
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

    def forward(self, x: Tensor, reset: Tensor | None = None) -> Tensor:
        """x: (B, T, D); reset: (B, T) bool, True where a document starts."""
        y = F.gelu(self.linear_y(x), approximate=self.config.gelu_approximation)
        u = self.linear_x(x)
        u = self.conv_1d(u, reset if self.config.conv1d_document_reset else None)
        u, _ = self.rg_lru(u, reset)
        return self.linear_out(u * y)
