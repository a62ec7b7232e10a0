"""Weight-only int8 (Section 5: a decode step reads every weight once, so fewer bytes per weight is fewer
milliseconds per token), and the reference for the weight matmuls of a decode step.

A weight matrix W (out, in) is stored as int8 values q and float32 scales s, one per output row and group of
``group_size`` consecutive inputs (``group_size`` 0: one group per row, i.e. per output channel):
W[n, k] ~ q[n, k] * s[n, k // group_size], with s = max |W| over the group / 127 and q = round(W / s) in
[-127, 127] (symmetric, no zero point). :func:`matvec_ref` is the plain computation every kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

QMAX = 127
MIN_GROUP = 8  # the smallest group of inputs sharing a scale (and the multiple a group size must be)
CHUNK_ELEMENTS = 1 << 24  # weights the reference widens to float32 at a time (64 MiB)


def check_group_size(group_size: int, in_features: int | None = None, name: str = "") -> int:
    """``group_size`` if it can quantise a matrix with ``in_features`` inputs, else a ValueError naming it (and the
    layer ``name``): 0 (per output channel) or a multiple of 8 that divides the inputs."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0 or group_size % MIN_GROUP:
        raise ValueError(f"group_size={group_size!r} is not supported: use 0 (one scale per output channel) or a "
                         f"positive multiple of {MIN_GROUP} (e.g. 32, 64, 128)")
    if in_features is not None and group_size and in_features % group_size:
        where = f" of layer {name}" if name else ""
        raise ValueError(f"group_size={group_size} does not divide the {in_features} inputs{where}: choose a "
                         "divisor of every quantised layer's input width, or 0")
    return group_size


def groups_of(in_features: int, group_size: int) -> int:
    """Scales per output row: 1 for per-channel (``group_size`` 0), else in_features / group_size."""
    return 1 if group_size == 0 else in_features // group_size


def quantize_int8(weight: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    """(q int8 (out, in), scale float32 (out, groups)) of a floating (out, in) matrix; computed in float32."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 takes a floating (out, in) matrix, got {weight.dtype} {tuple(weight.shape)}")
    check_group_size(group_size, weight.shape[1])
    n, k = weight.shape
    g = groups_of(k, group_size)
    w = weight.detach().float().reshape(n, g, k // g)
    amax = w.abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (out, in) matrix q * scale in ``dtype`` (the product computed in float32)."""
    n, k = q.shape
    g = scale.shape[1]
    return (q.float().reshape(n, g, k // g) * scale.float()[..., None]).reshape(n, k).to(dtype)


def quantize_blocks_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 (H, Din, Dout), scale float32 (H, Dout)) of block-diagonal weights (H, Din, Dout) (the RG-LRU's gates,
    :class:`griffin.layers.BlockDiagonalLinear`): :func:`quantize_int8` of each block's (Dout, Din) matrix with one
    scale per output column, q stored in the blocks' own layout."""
    if weight.dim() != 3 or not weight.is_floating_point():
        raise ValueError(f"quantize_blocks_int8 takes floating (blocks, in, out) weights, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    H, Din, Dout = weight.shape
    q, scale = quantize_int8(weight.detach().transpose(1, 2).reshape(H * Dout, Din))
    return q.reshape(H, Dout, Din).transpose(1, 2).contiguous(), scale.reshape(H, Dout)


def dequantize_blocks_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The block-diagonal weights (H, Din, Dout) q * scale (one per block and output column) in ``dtype`` (the
    product computed in float32)."""
    return (q.float() * scale.float()[:, None, :]).to(dtype)


INT16_MAX = 32767


def quantize_row_int16(x: Tensor) -> tuple[Tensor, float]:
    """One input row (K,) as int16 steps of ``step`` = max |x| / 32767 (1 for a zero row; computed in float32),
    rounded to nearest even: the form in which the int8 kernel's ``vpdpbusd`` path multiplies it
    (:mod:`griffin.inference.cpu.isa`). Each entry moves by at most step / 2, i.e. max |x| / 65534 (bfloat16 rounds
    any entry above max |x| / 128 by more). x must be finite."""
    xf = x.detach().float()
    amax = xf.abs().max() if xf.numel() else torch.zeros(())
    if not torch.isfinite(amax):
        raise ValueError("quantize_row_int16: the row has an infinite or NaN entry")
    step = amax / INT16_MAX if amax > 0 else torch.ones(())
    return torch.round(xf / step).clamp_(-INT16_MAX, INT16_MAX).to(torch.int16), float(step)


def matvec_ref(x: Tensor, weights: Sequence[Tensor], scales: Sequence[Tensor | None] | None = None,
               biases: Sequence[Tensor | None] | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """x (..., in) times each weight (out_j, in), transposed, plus its bias, the outputs concatenated along the last
    dimension: ``cat([x @ W_j^T + b_j])``. An int8 weight has its scales in ``scales[j]`` and is dequantised
    first. Computed in float32 (the kernels' accumulation dtype), returned in ``out_dtype`` (default x's)."""
    scales = scales if scales is not None else [None] * len(weights)
    biases = biases if biases is not None else [None] * len(weights)
    xf = x.float()
    outs = []
    for w, s, b in zip(weights, scales, biases, strict=True):
        step = max(1, CHUNK_ELEMENTS // w.shape[1])  # output rows dequantised at a time (bounded memory)
        for n in range(0, w.shape[0], step):
            rows = slice(n, n + step)
            wf = dequantize_int8(w[rows], s[rows]) if w.dtype == torch.int8 else w[rows].float()
            outs.append(F.linear(xf, wf, None if b is None else b[rows].float()))
    return torch.cat(outs, -1).to(out_dtype or x.dtype)
