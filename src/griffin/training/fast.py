"""The compiled training step (``griffin train --compile``) and what it refuses.

The step of a small model on a CPU is bound by operator dispatch and memory traffic, not arithmetic: dozens of
element-wise operators per block (gates, GeLU, norms, residuals) each stream the activations once, in forward and
backward. The fast path compiles the model with ``torch.compile`` (Inductor fuses those chains into a few C++ or
Triton loops, forward and backward, around the matmuls and griffin's own kernels, which stay opaque custom
operators) and updates the weights with the fused AdamW (one kernel over all parameters instead of a handful of
operators per tensor; :func:`griffin.training.trainer.build_optimizer`). The uncompiled step is the reference;
tests/training/test_fast.py trains both side by side.

What it cannot do it refuses before the first step, naming why, unless ``compile_fallback`` asks to train the
uncompiled step instead (with a warning):

- bf16 autocast on a CPU without a bf16 matmul (no AVX-512-BF16 or AMX): PyTorch emulates it, several times slower
  than fp32 (docs/performance.md); the fallback trains in fp32;
- a model the compiler fails on (no C++ compiler, an operator it cannot trace): found by compiling the first
  training micro-batch's forward and backward once, before any update.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

FALLBACK_HINT = "--compile-fallback trains the uncompiled step instead"


class FastPathError(ValueError):
    """The compiled step cannot run this configuration here (the message says why and what to do)."""


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on ``device`` (CUDA with bf16, or a CPU whose oneDNN has a bf16 kernel)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_autocast(autocast: torch.dtype | None, device: torch.device, fallback: bool) -> torch.dtype | None:
    """The fast path's autocast dtype: ``autocast`` where the device computes it natively; bf16 on a CPU without a
    bf16 matmul is refused (:class:`FastPathError`), or with ``fallback`` replaced by fp32 (None) with a warning."""
    if autocast != torch.bfloat16 or native_bf16(device):
        return autocast
    why = (f"--compile with --precision bf16: this {device.type.upper()} has no native bf16 matmul (no AVX-512-BF16 "
           "or AMX), so bf16 autocast runs emulated, several times slower than fp32")
    if not fallback:
        raise FastPathError(f"{why}; use --precision fp32 (or auto), or {FALLBACK_HINT}")
    warnings.warn(f"{why}: training in fp32 (--compile-fallback)", stacklevel=2)
    return None


class CompiledStep(nn.Module):
    """``torch.compile(module)`` with a way back: :meth:`check` compiles forward and backward on one micro-batch
    before training; a compiler failure there raises :class:`FastPathError`, or with ``fallback`` makes every later
    call run ``module`` uncompiled (``self.compiled`` is then False)."""

    def __init__(self, module: nn.Module, fallback: bool = False) -> None:
        super().__init__()
        self.module = module
        self.fallback = fallback
        self.compiled = True
        # autocast's enter/exit nodes (the loss's float32 logits under bf16) are hashed with their constant arguments,
        # but torch does not list them as cacheable: unmarked, every bf16 start skipped AOTAutograd's cache (5 s)
        self._step: Callable[..., Any] = torch.compile(module, options={"unsafe_marked_cacheable_functions": {
            f"torch.amp.autocast_mode.{name}": torch.__version__ for name in ("_enter_autocast", "_exit_autocast")}})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self._step(*args, **kwargs)
        except TorchDynamoException as error:
            self._failed(error)
            return self._step(*args, **kwargs)

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Compile forward and backward on these inputs (shaped as a training micro-batch; the model returns a
        scalar loss); the gradients this leaves are dropped (set to None)."""
        from torch._dynamo.exc import TorchDynamoException

        try:
            self(*args, **kwargs).backward()
        except TorchDynamoException as error:
            self._failed(error)
        finally:
            for p in self.module.parameters():
                p.grad = None

    def _failed(self, error: Exception) -> None:
        cause = getattr(error, "inner_exception", None) or error  # a backend's own error, inside dynamo's
        text = " ".join(str(cause).split())[:300]
        why = f"--compile: torch.compile failed on this model ({type(cause).__name__}: {text})"
        if not self.fallback:
            raise FastPathError(f"{why}; train without --compile, or {FALLBACK_HINT}") from error
        warnings.warn(f"{why}: training uncompiled (--compile-fallback)", stacklevel=3)
        self.compiled = False
        self._step = self.module
