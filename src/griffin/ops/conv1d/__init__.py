"""The causal depthwise Conv1D of the recurrent block as one operator (Section 2.3).

:func:`conv1d_ref` is the readable reference (a sum of shifted slices, differentiated by autograd);
:func:`causal_conv1d` dispatches to the fused CPU kernels of :mod:`griffin.ops.conv1d.cpu` (one pass over x in the
forward, one over the output gradient in the backward, opaque to torch.compile) or to the reference.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from griffin.ops.conv1d.reference import check_conv1d_inputs, conv1d_ref

BACKENDS = ("cpu", "ref")
_ENV_VAR = "GRIFFIN_CONV1D_BACKEND"
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def causal_conv1d(x: Tensor, w: Tensor, b: Tensor, reset: Tensor | None = None, state: Tensor | None = None, *,
                  backend: str | None = None) -> Tensor:
    """y_t = b + sum_s w[K-1-s] x_{t-s} over x (B, T, width) with w (K, width), b (width,); ``reset`` (B, T) drops
    the terms before a document start, ``state`` (B, K-1, width) holds the inputs before x (a cache).

    backend: "cpu" (the fused kernels) or "ref" (:func:`conv1d_ref`); None: ``$GRIFFIN_CONV1D_BACKEND`` if set, else
    "cpu" for CPU floating inputs of more than one time step, else "ref" (a decode step, GPU tensors).
    """
    check_conv1d_inputs(x, w, b, reset, state)
    if backend is None:
        backend = os.environ.get(_ENV_VAR) or _default_backend(x, w, b)
    if backend == "cpu":
        from griffin.ops.conv1d.cpu import conv1d_cpu  # numba is imported on first use only

        return conv1d_cpu(x, w, b, reset, state)
    if backend == "ref":
        return conv1d_ref(x, w, b, reset, state)
    raise ValueError(f"causal_conv1d: unknown backend {backend!r}; choose one of {BACKENDS}")


def _default_backend(x: Tensor, w: Tensor, b: Tensor) -> str:
    on_cpu = all(t.device.type == "cpu" and t.dtype in _KERNEL_DTYPES for t in (x, w, b))
    return "cpu" if on_cpu and x.shape[1] > 1 else "ref"


__all__ = ["BACKENDS", "causal_conv1d", "check_conv1d_inputs", "conv1d_ref"]
