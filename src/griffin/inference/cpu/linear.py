"""The weight matmuls of a decode step at memory bandwidth on CPU (Section 5.1), applied from outside the model as a
module swap.

At batch 1-8 a decode step of a 1-3B model is bound by reading its weights (docs/performance.md, "CPU decode at
1–3B", measured by benchmarks/decode_cpu.py). :func:`matvec_swapped` makes a copy of the model that shares every
tensor, in which

- each :class:`griffin.layers.LinearGroup` (attention's q/k/v, the recurrent block's two branches, the MLP's two
  up-projections) is one :class:`MatvecLinear`: one call of the CPU kernel over all its matrices, no copy of them;
- every other linear layer (and the output layer, tied or not) is a :class:`MatvecLinear` of its own,
- the RG-LRU's block-diagonal gates (float or int8) are :class:`MatvecBlockDiagonal`,

whether the weights are float32, bfloat16 or int8 (:mod:`griffin.quantize`). The kernel is
:mod:`griffin.inference.cpu.matvec`; under ``torch.compile`` it is the opaque operator ``griffin::matvec``. Results
equal the layers' own up to float32 rounding (the sums' order); the layers' biases and int8 scales are copied
(concatenated) here, so later changes to those are not seen (make a new copy after training). With ``int8pack`` (the
decoder's choice where :func:`int8pack_for` says so: beyond :data:`KERNEL_INT8_ROWS` rows, or several rows on a host
without ``vpdpbusd``), int8 layers of a bfloat16 model with per-channel scales and an input width divisible by 16 run
instead through PyTorch's own int8 matmul (:class:`Int8PackLinear`), faster than the kernel's widened several-row path.
The :class:`griffin.inference.Decoder` uses this swap for int8 models and for float models decoding one row (where the
kernel's one-row path is faster than oneDNN's matmul: docs/performance.md); float models decoding several rows go
through oneDNN's prepacked matmuls (:mod:`griffin.inference.cpu.prepack`). docs/architecture.md tables the routes.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from griffin.inference.cpu.isa import FAST_DOTS
from griffin.inference.cpu.matvec import GATE_DTYPES, WEIGHT_DTYPES, MatvecWeights, block_diagonal_cpu, matvec_cpu
from griffin.layers import BlockDiagonalLinear, LinearGroup
from griffin.layers.quantized import Int8BlockDiagonalLinear, Int8Linear, Int8TiedOutput
from griffin.model import TiedOutput

LINEAR_LAYERS = (nn.Linear, TiedOutput, Int8Linear, Int8TiedOutput)


def can_matvec(layer: nn.Module) -> bool:
    """Whether the CPU kernel reads ``layer``'s weight: a linear layer with a contiguous float32, bfloat16 or int8 CPU
    matrix."""
    if not isinstance(layer, LINEAR_LAYERS):
        return False
    w = layer.weight
    return w.device.type == "cpu" and w.dtype in WEIGHT_DTYPES and w.dim() == 2 and w.is_contiguous()


class MatvecLinear(nn.Module):
    """Linear layers that read one input, as one call of the CPU kernel over their weights (shared). Returns the
    output (one layer) or the tuple of outputs (``group=True``), in the input's dtype."""

    def __init__(self, layers: Sequence[nn.Module], group: bool = False) -> None:
        super().__init__()
        weights = [layer.weight for layer in layers]
        scales = [getattr(layer, "weight_scale", None) for layer in layers]
        biases = [getattr(layer, "bias", None) for layer in layers]
        self.prepared = MatvecWeights.prepare(weights, scales, biases)
        self.group, self.sizes = group, [w.shape[0] for w in weights]
        for j, w in enumerate(weights):  # registered, for torch.compile to see them as the module's tensors
            if isinstance(w, nn.Parameter):
                self.register_parameter(f"weight{j}", w)
            else:
                self.register_buffer(f"weight{j}", w, persistent=False)
        self.register_buffer("tiles", torch.from_numpy(self.prepared.tiles), persistent=False)
        self.register_buffer("scale", torch.from_numpy(self.prepared.scale), persistent=False)
        self.register_buffer("bias", torch.from_numpy(self.prepared.bias), persistent=False)
        self.register_buffer("sums", torch.from_numpy(self.prepared.sums), persistent=False)

    def side_by_side(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """The layers' outputs side by side (..., sum of their widths) in ``out_dtype`` (default: x's; float32 is the
        kernel's own, not rounded)."""
        if torch.compiler.is_compiling():
            weights = [getattr(self, f"weight{j}") for j in range(len(self.sizes))]
            out = torch.ops.griffin.matvec.default(x, weights, self.tiles, self.scale, self.bias, self.sums)
            return out if out_dtype is None else out.to(out_dtype)
        return matvec_cpu(x, self.prepared, out_dtype)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        out = self.side_by_side(x)
        return tuple(out.split(self.sizes, -1)) if self.group else out

    def extra_repr(self) -> str:
        return f"in_features={self.prepared.in_features}, out_features={self.sizes}"


class MatvecBlockDiagonal(nn.Module):
    """A :class:`griffin.layers.BlockDiagonalLinear` (the RG-LRU's gates; float32 or bfloat16 weights, shared), or its
    int8 version (:class:`griffin.layers.quantized.Int8BlockDiagonalLinear`, with its scales), through
    :func:`griffin.inference.cpu.matvec.block_diagonal_cpu`: each block's matrix read once per row, in place of a
    batched matmul over the blocks."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.w = layer.w
        self.register_buffer("bias", layer.b.detach().float().contiguous(), persistent=False)
        scale = getattr(layer, "w_scale", None)
        self.register_buffer("w_scale", None if scale is None else scale.detach().float().contiguous(),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.griffin.block_diagonal.default(x, self.w, self.bias, self.w_scale)
        return block_diagonal_cpu(x, self.w, self.bias, self.w_scale)

    def extra_repr(self) -> str:
        blocks, d_in, d_out = self.w.shape
        return f"blocks={blocks}, in_features={blocks * d_in}, out_features={blocks * d_out}"


def can_block_diagonal(layer: nn.Module) -> bool:
    """Whether :class:`MatvecBlockDiagonal` computes ``layer``: block-diagonal gates with contiguous float32, bfloat16
    or int8 CPU weights."""
    return (isinstance(layer, (BlockDiagonalLinear, Int8BlockDiagonalLinear)) and layer.w.device.type == "cpu"
            and layer.w.is_contiguous() and layer.w.dtype in GATE_DTYPES)


KERNEL_INT8_ROWS = 8  # up to this many rows, int8 layers decode through the kernel (where the host has vpdpbusd)


def int8pack_for(batch_size: int) -> bool:
    """Whether the int8 layers of a decode step of ``batch_size`` rows go through PyTorch's int8 matmul
    (:class:`Int8PackLinear`) rather than the kernel: beyond :data:`KERNEL_INT8_ROWS` rows, or at several rows on a
    host without the unsigned x signed byte instruction (:data:`griffin.inference.cpu.isa.FAST_DOTS`), where the kernel
    widens each weight to float32."""
    return batch_size > 1 and ("int8" not in FAST_DOTS or batch_size > KERNEL_INT8_ROWS)


def can_int8pack(layer: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether PyTorch's own weight-only int8 CPU matmul (``torch._weight_int8pack_mm``, the kernel gpt-fast and
    torchao use) computes ``layer`` for activations of ``dtype``: an int8 layer with one scale per output channel on
    CPU, bfloat16 activations (in float32 the kernel is slower than :class:`MatvecLinear`), and an input width that
    is a multiple of 16 (other widths give wrong results or crash it)."""
    return (isinstance(layer, (Int8Linear, Int8TiedOutput)) and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int8pack_mm") and layer.weight.device.type == "cpu"
            and layer.weight_scale.shape[1] == 1 and layer.weight.shape[1] % 16 == 0)


class Int8PackLinear(nn.Module):
    """An int8 layer (weights shared) through ``torch._weight_int8pack_mm``: bfloat16 ``x W^T`` times each output
    channel's scale (rounded to bfloat16), plus the bias. Equal to the dequantised layer up to bfloat16 rounding."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.register_buffer("weight", layer.weight, persistent=False)
        self.register_buffer("scale", layer.weight_scale[:, 0].to(torch.bfloat16), persistent=False)
        self.bias = layer.bias

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"Int8PackLinear computes bfloat16 activations, got {x.dtype}")
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


def _fusable(layers: list[nn.Module]) -> bool:
    if not all(can_matvec(layer) for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    groups = {getattr(layer, "weight_scale", torch.empty(0, 1)).shape[1] for layer in layers}
    return len({w.dtype for w in weights}) == 1 and len({w.shape[1] for w in weights}) == 1 and len(groups) == 1


def matvec_swapped(model: nn.Module, int8pack: bool = True) -> nn.Module:
    """A copy of ``model`` sharing its tensors, whose linear layers run through the CPU kernel (see the module
    docstring); layers the kernel cannot read are left as they are. ``int8pack=False``: int8 layers too (faster than
    PyTorch's int8 matmul at one row, and up to :data:`KERNEL_INT8_ROWS` rows where the host has ``vpdpbusd``)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    dtype = getattr(model, "dtype", None)  # the activations' (CausalLM)
    fused: set[int] = set()
    for module in list(clone.modules()):  # groups first, so that their layers are still the original ones
        for name, child in list(module.named_children()):
            if isinstance(child, LinearGroup) and _fusable(layers := child.layers()) and not (int8pack and all(
                    can_int8pack(layer, dtype) for layer in layers)):
                setattr(module, name, MatvecLinear(layers, group=True))
                fused.update(id(layer) for layer in layers)
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if id(child) in fused:
                continue
            if int8pack and can_int8pack(child, dtype):
                setattr(module, name, Int8PackLinear(child))
            elif can_block_diagonal(child):
                setattr(module, name, MatvecBlockDiagonal(child))
            elif can_matvec(child):
                setattr(module, name, MatvecLinear([child]))
    return clone
