"""Layers with weight-only int8 weights (Section 5: decoding reads every weight once per token, so a byte per weight
instead of two or four is that much less time): the linear layer, the embedding and the output layer tied to it, and
the RG-LRU's block-diagonal gates.

Each holds ``weight`` (int8, the float layer's shape) and ``weight_scale`` (float32, one per output row and group of
inputs; :mod:`griffin.ops.matvec`), so a quantised model's state-dict names are the float model's plus one
``.weight_scale`` per quantised matrix. Activations, biases and outputs stay in the model's dtype (a linear layer's
output has its input's dtype; embedded rows are float32, cast by the model). The forward passes here are the
reference (dequantise, then a float32 matmul, a bounded block of rows at a time); a decoder swaps in the CPU kernel
that reads the int8 weights directly (:mod:`griffin.inference.cpu.linear`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from griffin.layers.rg_lru import BlockDiagonalLinear
from griffin.ops.matvec import (
    check_group_size,
    dequantize_blocks_int8,
    dequantize_int8,
    groups_of,
    matvec_ref,
    quantize_blocks_int8,
    quantize_int8,
)


class Int8Linear(nn.Module):
    """``x W^T + b`` with W stored as int8 and float32 scales (:func:`griffin.ops.matvec.quantize_int8`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_group_size(group_size, in_features)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, groups_of(in_features, group_size),
                                                        device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_float(cls, layer: nn.Linear, group_size: int = 0, name: str = "") -> Int8Linear:
        """The int8 layer closest to ``layer`` (its bias shared)."""
        check_group_size(group_size, layer.in_features, name)
        q = cls(layer.in_features, layer.out_features, False, group_size, layer.weight.dtype, "meta")
        q.weight, q.weight_scale = quantize_int8(layer.weight, group_size)
        q.bias = layer.bias
        return q

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight matrix in ``dtype`` (a new tensor)."""
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return matvec_ref(x, [self.weight], [self.weight_scale], [self.bias], out_dtype=x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}")


class Int8Embedding(nn.Module):
    """Rows of an int8 (vocab, D) matrix, dequantised to float32 as they are looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group_size: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        check_group_size(group_size, embedding_dim)
        self.num_embeddings, self.embedding_dim, self.group_size = num_embeddings, embedding_dim, group_size
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(num_embeddings, groups_of(embedding_dim, group_size),
                                                        device=device))

    @classmethod
    def from_float(cls, layer: nn.Embedding, group_size: int = 0, name: str = "") -> Int8Embedding:
        check_group_size(group_size, layer.embedding_dim, name)
        q = cls(layer.num_embeddings, layer.embedding_dim, group_size, "meta")
        q.weight, q.weight_scale = quantize_int8(layer.weight, group_size)
        return q

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, ids: Tensor) -> Tensor:
        rows, scale = self.weight[ids].float(), self.weight_scale[ids].float()  # (..., D), (..., groups)
        return (rows.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"


class Int8TiedOutput(nn.Module):
    """The output layer when it shares an :class:`Int8Embedding`'s matrix: ``x E^T``, no tensor of its own."""

    def __init__(self, embed: Int8Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # a list, so that the embedding is not registered (and saved) twice

    @property
    def weight(self) -> Tensor:
        return self.embed[0].weight

    @property
    def weight_scale(self) -> Tensor:
        return self.embed[0].weight_scale

    @property
    def bias(self) -> None:
        return None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.embed[0].dequantize(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return matvec_ref(x, [self.weight], [self.weight_scale], out_dtype=x.dtype)


class Int8BlockDiagonalLinear(nn.Module):
    """The RG-LRU's block-diagonal gates (:class:`griffin.layers.BlockDiagonalLinear`, Section 2.4) with int8 weights:
    ``w`` (H, Din, Dout) int8 in the float layer's layout and ``w_scale`` (H, Dout) float32, one scale per block and
    output column (:func:`griffin.ops.matvec.quantize_blocks_int8`: a block's Din inputs are few, 256 at 2B, so no
    groups); the bias ``b`` stays in the model's dtype. The forward pass is the reference: dequantise, then the
    blocks' matmul in float32, returned in the input's dtype."""

    def __init__(self, blocks: int, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % blocks or out_features % blocks:
            raise ValueError(f"widths {in_features} -> {out_features} are not divisible by blocks={blocks}")
        self.blocks = blocks
        shape = (blocks, in_features // blocks, out_features // blocks)
        self.register_buffer("w", torch.zeros(shape, dtype=torch.int8, device=device))
        self.register_buffer("w_scale", torch.ones(blocks, shape[2], device=device))
        self.b = nn.Parameter(torch.zeros(blocks, shape[2], dtype=dtype, device=device))

    @classmethod
    def from_float(cls, layer: BlockDiagonalLinear) -> Int8BlockDiagonalLinear:
        """The int8 gates closest to ``layer`` (its bias shared)."""
        H, Din, Dout = layer.w.shape
        q = cls(H, H * Din, H * Dout, layer.w.dtype, "meta")
        q.w, q.w_scale = quantize_blocks_int8(layer.w)
        q.b = layer.b
        return q

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The block-diagonal weights (H, Din, Dout) in ``dtype`` (a new tensor)."""
        return dequantize_blocks_int8(self.w, self.w_scale, dtype)

    def forward(self, x: Tensor) -> Tensor:
        H, Din, _ = self.w.shape
        xb = x.reshape(-1, H, Din).transpose(0, 1).float()  # (blocks, N, in/blocks)
        y = torch.baddbmm(self.b.float()[:, None, :], xb, self.dequantize())
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        blocks, d_in, d_out = self.w.shape
        return f"blocks={blocks}, in_features={blocks * d_in}, out_features={blocks * d_out}"
