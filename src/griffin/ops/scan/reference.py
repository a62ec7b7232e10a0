"""Reference linear scans (paper, Section 2.4, eq. 4): the plain loop every fast path is tested against, and the
associative (parallel prefix) scan the paper compares with (Appendix D, Figure 9). Shapes and dtypes: see
:mod:`griffin.ops.scan`."""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence is accumulated in: never below float32."""
    if dtype.is_complex:
        return torch.promote_types(dtype, torch.complex64)
    return torch.promote_types(dtype, torch.float32)


def check_scan_inputs(a: Tensor, b: Tensor, h0: Tensor | None, reset: Tensor | None) -> None:
    """Raise a clear error for inputs no backend can scan."""
    if a.dim() != 3:
        raise ValueError(f"linear_scan: a must have shape (batch, time, dim), got {tuple(a.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"linear_scan: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        raise TypeError(f"linear_scan: expected floating point inputs, got {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"linear_scan: a is on {a.device} but b is on {b.device}")
    batch, _, dim = a.shape
    if h0 is not None and tuple(h0.shape) != (batch, dim):
        raise ValueError(f"linear_scan: h0 must have shape {(batch, dim)}, got {tuple(h0.shape)}")
    if reset is not None:
        if tuple(reset.shape) != tuple(a.shape[:2]):
            raise ValueError(f"linear_scan: reset must have shape {tuple(a.shape[:2])}, got {tuple(reset.shape)}")
        if reset.dtype != torch.bool:
            raise TypeError(f"linear_scan: reset must be a bool tensor, got {reset.dtype}")


def linear_scan_ref(
    a: Tensor, b: Tensor, h0: Tensor | None = None, reset: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Reference scan: a Python loop over time, differentiated by autograd."""
    check_scan_inputs(a, b, h0, reset)
    acc = accumulation_dtype(a.dtype)
    if reset is not None:
        a = a * ~reset[..., None]
    h = b.new_zeros(b.shape[0], b.shape[2], dtype=acc) if h0 is None else h0.to(acc)
    hs = []
    for t in range(a.shape[1]):
        h = a[:, t].to(acc) * h + b[:, t].to(acc)
        hs.append(h)
    if not hs:
        return b.clone(), h
    return torch.stack(hs, dim=1).to(b.dtype), h


def linear_scan_assoc(
    a: Tensor, b: Tensor, h0: Tensor | None = None, reset: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Associative scan (Hillis-Steele): the pairs (a_t, b_t) compose as (a, b) o (a', b') = (a a', a b' + b),
    so after the steps d = 1, 2, 4, ... each position holds the composition of everything up to it."""
    check_scan_inputs(a, b, h0, reset)
    acc = accumulation_dtype(a.dtype)
    out_dtype, T = b.dtype, a.shape[1]
    a, b = a.to(acc), b.to(acc)
    if reset is not None:
        a = a * ~reset[..., None]
    if T == 0:
        return b.to(out_dtype), b.new_zeros(b.shape[0], b.shape[2]) if h0 is None else h0.to(acc)
    h0 = b.new_zeros(b.shape[0], b.shape[2]) if h0 is None else h0.to(acc)
    b = torch.cat([a[:, :1] * h0[:, None] + b[:, :1], b[:, 1:]], dim=1)  # fold the initial state in
    d = 1
    while d < T:
        b = torch.cat([b[:, :d], a[:, d:] * b[:, :-d] + b[:, d:]], dim=1)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], dim=1)
        d *= 2
    return b.to(out_dtype), b[:, -1]
