"""The linear scan h_t = a_t * h_{t-1} + b_t (paper, Section 2.4, eq. 4 and Section 4.2).

One operator, :func:`linear_scan`, is the single place where fast implementations plug in.
:func:`linear_scan_ref` is the plain, readable reference every fast path is tested against;
:func:`linear_scan_assoc` is the associative (parallel prefix) scan the paper compares against (Appendix,
Figure 9): log2(T) whole-sequence steps, O(T log T) work, any device.

Conventions (shared by every backend):
  a, b:   (B, T, D) tensors of the same dtype.
  h0:     optional initial state (B, D); it is promoted to the accumulation dtype.
  reset:  optional (B, T) bool; where True, h_{t-1} is treated as zero (a document starts at t),
          so h_t = b_t and the gradient with respect to a_t there is zero.
  return: (h, h_last): h is (B, T, D) in b's dtype, h_last is (B, D) in the accumulation dtype.
The accumulation dtype is float32 for 16/32-bit inputs, float64 for float64 and complex64/128 for
complex inputs (used by the CG-LRU).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

BACKENDS = ("ref", "cpu", "assoc")
_ENV_VAR = "GRIFFIN_SCAN_BACKEND"


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


def default_backend(a: Tensor) -> str:
    """The backend used when none is asked for: $GRIFFIN_SCAN_BACKEND, else the fastest available.

    That is "cpu" (numba kernels, :mod:`griffin.ops.scan_cpu`) for real floating CPU tensors, with or without
    requires_grad, and "ref" for everything else (complex dtypes, other devices) and for a single time step
    (decoding), where one multiply-add beats a kernel launch.
    """
    forced = os.environ.get(_ENV_VAR)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{_ENV_VAR}={forced!r} is not one of {BACKENDS}")
        return forced
    if a.shape[1] > 1 and a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                                    torch.float16):
        return "cpu"
    return "ref"


def linear_scan(
    a: Tensor,
    b: Tensor,
    h0: Tensor | None = None,
    reset: Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """h_t = a_t * h_{t-1} + b_t along dim 1; see the module docstring for shapes and dtypes."""
    backend = backend or default_backend(a)
    if backend == "ref":
        return linear_scan_ref(a, b, h0, reset)
    if backend == "assoc":
        return linear_scan_assoc(a, b, h0, reset)
    if backend == "cpu":
        from griffin.ops.scan_cpu import linear_scan_cpu  # numba is imported on first use only

        return linear_scan_cpu(a, b, h0, reset)
    raise ValueError(f"linear_scan: unknown backend {backend!r}; choose one of {BACKENDS}")
