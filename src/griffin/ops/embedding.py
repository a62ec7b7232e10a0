"""The embedding lookup (the input layer of Section 2) in a compiled CPU step, with a backward that is the same
from run to run.

Inductor decomposes the embedding's backward into a scatter that adds each token's gradient into its row by atomic
adds from every thread. Tokens repeat, so a row is a sum whose order, and so whose rounding, depends on which thread
got there first: a compiled step on more than one thread did not give the same weights twice. Under
``torch.compile`` on a CPU, :func:`embed` is an opaque operator whose backward is aten's
``embedding_dense_backward`` (each row summed in token order, as in an eager step); eager calls, other devices and
other embedding modules keep the module's own forward, the reference. Same numbers either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@torch.library.custom_op("griffin::embedding_cpu_fwd", mutates_args=(), device_types="cpu")
def embedding_cpu_fwd(weight: Tensor, ids: Tensor) -> Tensor:
    """The rows of ``weight`` (V, D) at ``ids``: (*ids.shape, D)."""
    return F.embedding(ids, weight)


@embedding_cpu_fwd.register_fake
def _(weight, ids):
    return weight.new_empty(*ids.shape, weight.shape[1])


@torch.library.custom_op("griffin::embedding_cpu_bwd", mutates_args=(), device_types="cpu")
def embedding_cpu_bwd(grad: Tensor, ids: Tensor, rows: int) -> Tensor:
    """The gradient of the (rows, D) table: ``grad``'s vectors summed into their tokens' rows, in token order."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False)


@embedding_cpu_bwd.register_fake
def _(grad, ids, rows):
    return grad.new_empty(rows, grad.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    weight, ids = inputs
    ctx.rows = weight.shape[0]
    ctx.save_for_backward(ids)


def _backward(ctx, grad: Tensor):
    (ids,) = ctx.saved_tensors
    return embedding_cpu_bwd(grad.contiguous(), ids, ctx.rows), None


embedding_cpu_fwd.register_autograd(_backward, setup_context=_setup_context)


def embed(module: nn.Module, ids: Tensor) -> Tensor:
    """``module(ids)``; through :func:`embedding_cpu_fwd` where a CPU step is being compiled and ``module`` is a plain
    ``nn.Embedding`` (no padding row, norm cap or sparse gradient)."""
    if (torch.compiler.is_compiling() and type(module) is nn.Embedding and module.weight.device.type == "cpu"
            and module.padding_idx is None and module.max_norm is None and not module.sparse
            and not module.scale_grad_by_freq):
        return embedding_cpu_fwd(module.weight, ids)
    return module(ids)


__all__ = ["embed", "embedding_cpu_bwd", "embedding_cpu_fwd"]
