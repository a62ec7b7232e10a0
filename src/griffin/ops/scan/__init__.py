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

from griffin.ops.scan.reference import accumulation_dtype, check_scan_inputs, linear_scan_assoc, linear_scan_ref

BACKENDS = ("ref", "cpu", "assoc")
_ENV_VAR = "GRIFFIN_SCAN_BACKEND"


def default_backend(a: Tensor) -> str:
    """The backend used when none is asked for: $GRIFFIN_SCAN_BACKEND, else the fastest available.

    That is "cpu" (numba kernels, :mod:`griffin.ops.scan.cpu`) for real floating CPU tensors, with or without
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
        from griffin.ops.scan.cpu import linear_scan_cpu  # numba is imported on first use only

        return linear_scan_cpu(a, b, h0, reset)
    raise ValueError(f"linear_scan: unknown backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "accumulation_dtype", "check_scan_inputs", "default_backend", "linear_scan", "linear_scan_assoc",
           "linear_scan_ref"]
