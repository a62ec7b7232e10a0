"""Prefill of a bfloat16 model on a CPU without a bfloat16 matmul, applied from outside the model as a module swap.

A prompt's tokens go through the weight matmuls together, so prefill is bound by arithmetic, not by memory (Section
5). A CPU without AVX-512-BF16 or AMX (AVX2 hosts) has no bfloat16 matmul: PyTorch then multiplies bfloat16 several
times slower than float32 on the same cores. :func:`upcast_swapped` returns a copy of the model (sharing its
parameters) whose weight matmuls, on inputs of at least :data:`MIN_ROWS` rows, convert the weight to float32 for the
call, multiply in float32 and round the result to bfloat16: what a bfloat16 matmul computes (float32 accumulation,
one rounding), in another summation order. Converting a weight costs about one pass over it, small beside a matmul of
many rows; below :data:`MIN_ROWS` (decode steps, short chunks) the bfloat16 matmul is faster and runs as it is.
``benchmarks/serve_load.py`` measures the prefill's tokens/s (docs/performance.md, "Serving"); the weights stay
bfloat16 in memory.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.layers.rg_lru import BlockDiagonalLinear
from griffin.model import TiedOutput

MIN_ROWS = 32  # rows from which float32 beats bfloat16 on an AVX2 host, the weight's conversion included


def needs_upcast(model: nn.Module) -> bool:
    """Whether ``model`` has bfloat16 weights on a CPU on which oneDNN has no bfloat16 matmul."""
    weight = next((p for p in model.parameters() if p.dim() >= 2), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _rows(x: Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


class UpcastLinear(nn.Module):
    """``F.linear(x, weight, bias)`` computed in float32 for inputs of ``min_rows`` rows or more (the replaced layer's
    ``weight`` and ``bias``, shared; see the module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        self.weight, self.bias, self.min_rows = weight, bias, min_rows

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16 or _rows(x) < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


class UpcastBlockDiagonal(nn.Module):
    """:class:`griffin.layers.rg_lru.BlockDiagonalLinear`'s ``x W + b`` (the RG-LRU's gates) computed in float32 for
    inputs of ``min_rows`` rows or more (the replaced layer's ``w`` and ``b``, shared)."""

    def __init__(self, layer: BlockDiagonalLinear, min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        self.layer, self.min_rows = layer, min_rows

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.layer.w, self.layer.b
        if x.dtype != torch.bfloat16 or _rows(x) < self.min_rows:
            return self.layer(x)
        xb = x.float().reshape(-1, w.shape[0], w.shape[1]).transpose(0, 1)
        y = torch.baddbmm(b.float()[:, None, :], xb, w.float())
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1).to(x.dtype)


def upcast_swapped(model: nn.Module, min_rows: int = MIN_ROWS) -> nn.Module:
    """A copy of ``model`` sharing its parameters whose bfloat16 linear layers, tied output layer and RG-LRU gates
    multiply in float32 on inputs of ``min_rows`` rows or more (see the module docstring); the model is not
    touched. Layers of other dtypes (an int8 model's, which already multiply in float32) stay as they are."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, TiedOutput)) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, UpcastLinear(child.weight, getattr(child, "bias", None), min_rows))
            elif isinstance(child, BlockDiagonalLinear) and child.w.dtype == torch.bfloat16:
                setattr(module, name, UpcastBlockDiagonal(child, min_rows))
    return clone


def prefill_model(model: nn.Module) -> nn.Module:
    """The model a prefill should run: :func:`upcast_swapped`'s copy where :func:`needs_upcast`, else ``model``."""
    return upcast_swapped(model) if needs_upcast(model) else model
