"""The peers of the fused RG-LRU kernel in ``benchmarks/scan_gpu.py``: accelerated-scan and fla's HGRN kernels.

None of them fuses the RG-LRU's gates, so each gets the gate math in PyTorch (Section 2.4:
a_t = exp(-c softplus(Lambda) sigmoid(gate_a_t)), b_t = sqrt(1 - a_t^2) sigmoid(gate_x_t) x_t, from
:func:`griffin.ops.rg_lru.rg_lru_gates`) and scans h_t = a_t h_{t-1} + b_t with its own kernel. Every peer is
wrapped to the fused kernel's signature, ``(x, gate_x, gate_a, a_param) -> (y, h_last)``, so the benchmark times
them alike and :func:`max_rel_error` checks each against the reference before it is timed.

- ``accelerated-scan``: ``accelerated_scan.scalar.scan`` (Triton, chunks of 2048 steps scanned with
  ``tl.associative_scan``), layout (B, D, T);
- ``accelerated-scan-warp``: ``accelerated_scan.warp.scan`` (CUDA warp scan, compiled by ``load_inline`` when
  imported: needs nvcc and ninja; T a power of 2);
- ``fla-hgrn-recurrent`` / ``fla-hgrn-chunk``: ``fla.ops.hgrn.fused_recurrent_hgrn`` and ``chunk_hgrn``, given
  the log of the decay (h_t = exp(g_t) h_{t-1} + x_t), layout (B, T, D).

None of these packages is a dependency of griffin, and the GPU machine has no internet: their wheels travel with
the working tree (``benchmarks/wheels`` is git-ignored):

    pip download --no-deps -d benchmarks/wheels accelerated-scan==0.3.1 fla-core==0.6.0 einops   # with internet
    pip install --no-deps --no-index benchmarks/wheels/*.whl                                      # on the GPU
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from griffin.ops.rg_lru import rg_lru_gates, rg_lru_ref

C = 8.0
ScanFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _log_a(gate_a: Tensor, a_param: Tensor) -> Tensor:
    """log a_t = -c softplus(Lambda) sigmoid(gate_a_t) (Section 2.4), in float32."""
    return -C * F.softplus(a_param.float()) * torch.sigmoid(gate_a.float())


def _accelerated_scan(scan: Callable[[Tensor, Tensor], Tensor]) -> ScanFn:
    def fn(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor) -> tuple[Tensor, Tensor]:
        a, b = (t.to(x.dtype) for t in rg_lru_gates(x, gate_x, gate_a, a_param, C, None))  # the peer's dtype is x's
        h = scan(a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()).transpose(1, 2)  # over the last axis
        return h, h[:, -1].float()

    return fn


def _fla(scan: Callable[..., tuple[Tensor, Tensor | None]]) -> ScanFn:
    def fn(x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor) -> tuple[Tensor, Tensor]:
        b = rg_lru_gates(x, gate_x, gate_a, a_param, C, None)[1].to(x.dtype)
        h, _ = scan(b, _log_a(gate_a, a_param).to(x.dtype))
        return h, h[:, -1].float()

    return fn


def peer_scans(cuda: bool = True) -> dict[str, ScanFn | str]:
    """Every peer by name: its wrapped function, or why it is not available. ``cuda=False`` leaves out
    accelerated-scan's warp kernel (its import compiles CUDA code)."""
    found: dict[str, ScanFn | str] = {}
    try:
        from accelerated_scan.scalar import scan as scalar_scan

        found["accelerated-scan"] = _accelerated_scan(scalar_scan)
    except ImportError as err:
        found["accelerated-scan"] = f"not importable ({err})"
    if cuda:
        try:
            from accelerated_scan.warp import scan as warp_scan

            found["accelerated-scan-warp"] = _accelerated_scan(warp_scan)
        except Exception as err:  # ImportError, or the CUDA build failing at import
            reason = " ".join(str(err).split())[:300]
            found["accelerated-scan-warp"] = f"not importable ({type(err).__name__}: {reason})"
    try:
        from fla.ops.hgrn import chunk_hgrn, fused_recurrent_hgrn

        found["fla-hgrn-recurrent"] = _fla(fused_recurrent_hgrn)
        found["fla-hgrn-chunk"] = _fla(chunk_hgrn)
    except ImportError as err:
        found["fla-hgrn-recurrent"] = found["fla-hgrn-chunk"] = f"not importable ({err})"
    return found


def max_rel_error(fn: ScanFn, x: Tensor, gate_x: Tensor, gate_a: Tensor, a_param: Tensor) -> float:
    """Largest relative error (2-norm) of fn's y and of its gradients for x, gate_x, gate_a and Lambda against
    :func:`griffin.ops.rg_lru.rg_lru_ref` in float64 on the same inputs."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    dy = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float64)
    outs = []
    for f, dtype in ((fn, x.dtype), (rg_lru_ref, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_x, gate_a, a_param)]
        y, _ = f(*leaves)
        outs.append([y, *torch.autograd.grad(y, leaves, dy.to(y.dtype))])
    return max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*outs, strict=True))
