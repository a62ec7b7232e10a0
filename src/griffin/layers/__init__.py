"""The building blocks of Section 2, one module per concern."""

from griffin.layers.attention import MultiQueryAttention
from griffin.layers.conv1d import CausalConv1D
from griffin.layers.mlp import GatedMLP
from griffin.layers.norm import RMSNorm
from griffin.layers.recurrent_block import RecurrentBlock
from griffin.layers.rg_lru import CGLRU, RGLRU, BlockDiagonalLinear

__all__ = [
    "BlockDiagonalLinear", "CGLRU", "CausalConv1D", "GatedMLP", "MultiQueryAttention", "RGLRU", "RMSNorm",
    "RecurrentBlock",
]
