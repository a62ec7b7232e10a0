"""The gated MLP block (Section 2.2): two D -> M*D branches, GeLU on one, product, M*D -> D."""

from __future__ import annotations

import math

from torch import Tensor, nn

from griffin.layers.linear_group import LinearGroup
from griffin.ops.gelu import gelu


class GatedMLP(nn.Module):
    def __init__(self, width: int, mlp_width: int, gelu_approximation: str = "tanh",
                 final_init_scale: float = 1.0) -> None:
        super().__init__()
        self.gelu_approximation = gelu_approximation
        self.final_init_scale = final_init_scale
        self.gate_proj = nn.Linear(width, mlp_width)
        self.up_proj = nn.Linear(width, mlp_width)
        self.down_proj = nn.Linear(mlp_width, width)
        self.gate_up = LinearGroup(self, ("gate_proj", "up_proj"))  # one input: fused for decoding
        self.reset_parameters()

    def reset_parameters(self) -> None:
        width, mlp_width = self.gate_proj.in_features, self.gate_proj.out_features
        for lin in (self.gate_proj, self.up_proj):
            nn.init.normal_(lin.weight, std=math.sqrt(1.0 / width))
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.down_proj.weight, std=math.sqrt(self.final_init_scale / mlp_width))
        nn.init.zeros_(self.down_proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(gelu(gate, self.gelu_approximation) * up)
