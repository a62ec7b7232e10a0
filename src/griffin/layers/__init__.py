"""The building blocks of Section 2, one module per concern; the temporal blocks own their inference caches."""

from griffin.layers.attention import KVCache, MultiQueryAttention
from griffin.layers.context import EMPTY, Context
from griffin.layers.conv1d import CausalConv1D
from griffin.layers.linear_group import LinearGroup
from griffin.layers.mlp import GatedMLP
from griffin.layers.norm import RMSNorm
from griffin.layers.recurrent_block import RecurrentBlock, RecurrentState
from griffin.layers.rg_lru import CGLRU, RGLRU, BlockDiagonalLinear

__all__ = [
    "EMPTY", "BlockDiagonalLinear", "CGLRU", "CausalConv1D", "Context", "GatedMLP", "KVCache", "LinearGroup",
    "MultiQueryAttention", "RGLRU", "RMSNorm", "RecurrentBlock", "RecurrentState",
]
