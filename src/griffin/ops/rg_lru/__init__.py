"""The RG-LRU recurrence as one operator (paper, Section 2.4 and Appendix A).

Given x (after the Conv1D) and the pre-activations of the two gates,

    r_t = sigmoid(gate_a_t)                       recurrence gate
    i_t = sigmoid(gate_x_t)                       input gate
    log a_t = -c * softplus(Lambda) * r_t         a_t = a^(c r_t) with a = sigmoid(-Lambda), in log space
    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)

At a document start (``reset``) the state is dropped and the input is not normalised: h_t = i_t * x_t.
:func:`rg_lru_ref` is the readable reference; :func:`rg_lru` is the dispatched operator where fused
kernels plug in: a fused Triton kernel on NVIDIA GPUs, a fused numba kernel on CPU, or the gate math in
PyTorch followed by :func:`griffin.ops.scan.linear_scan`.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from griffin.ops.rg_lru.reference import (
    MAX_SQRT_GRADIENT,
    check_rg_lru_inputs,
    rg_lru_gates,
    rg_lru_ref,
    sqrt_bound_derivative,
)
from griffin.ops.scan import linear_scan

BACKENDS = ("triton", "cpu", "torch", "ref")
_ENV_VAR = "GRIFFIN_RG_LRU_BACKEND"


def rg_lru(
    x: Tensor,
    gate_x: Tensor,
    gate_a: Tensor,
    a_param: Tensor,
    c: float = 8.0,
    h0: Tensor | None = None,
    reset: Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """The RG-LRU operator (see the module docstring). Returns y (like x) and the fp32 final state.

    backend: "triton" (fused GPU kernel, :mod:`griffin.ops.rg_lru.triton`), "cpu" (fused CPU kernel,
    :mod:`griffin.ops.rg_lru.cpu`), "torch" (PyTorch gate math, then :func:`linear_scan` with its default backend)
    or "ref" (:func:`rg_lru_ref`). None: ``$GRIFFIN_RG_LRU_BACKEND`` if set, else "triton" for 16/32-bit CUDA
    inputs when Triton is importable, "cpu" for real floating CPU inputs, else "torch"; always "torch" for one
    time step (decoding).
    """
    check_rg_lru_inputs(x, gate_x, gate_a, a_param)
    if backend is None:
        backend = os.environ.get(_ENV_VAR) or _default_backend(x)
    if backend == "triton":
        from griffin.ops.rg_lru.triton import rg_lru_triton

        return rg_lru_triton(x, gate_x, gate_a, a_param, c, h0, reset)
    if backend == "cpu":
        from griffin.ops.rg_lru.cpu import rg_lru_cpu  # numba is imported on first use only

        return rg_lru_cpu(x, gate_x, gate_a, a_param, c, h0, reset)
    if backend == "ref":
        return rg_lru_ref(x, gate_x, gate_a, a_param, c, h0, reset)
    if backend == "torch":
        a, b = rg_lru_gates(x, gate_x, gate_a, a_param, c, reset)
        y, h_last = linear_scan(a, b, h0, reset)
        return y.to(x.dtype), h_last
    raise ValueError(f"rg_lru: unknown backend {backend!r}; choose one of {BACKENDS}")


def _default_backend(x: Tensor) -> str:
    if x.shape[1] == 1:
        return "torch"  # a decode step: a few tiny element-wise ops beat any kernel launch
    if x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        if importlib.util.find_spec("triton") is not None:
            return "triton"
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return "cpu"
    return "torch"


__all__ = ["BACKENDS", "MAX_SQRT_GRADIENT", "check_rg_lru_inputs", "rg_lru", "rg_lru_gates", "rg_lru_ref",
           "sqrt_bound_derivative"]
