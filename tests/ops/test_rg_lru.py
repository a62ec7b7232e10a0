"""Every backend of the RG-LRU operator against the paper's formula in float64, at the extremes of the decay.

Section 2.4 bounds the gradient of sqrt(1 - a_t^2), which is infinite where a_t = 1: with Lambda very negative,
softplus(Lambda) underflows, a_t is 1 in float32 and 1 - a_t^2 is 0. Without the bound every gradient of the layer is
NaN (inf times the zero derivative of log a_t). Each backend must give the gradients of the bounded formula.
"""

import os

import pytest
import torch

from griffin.ops.rg_lru import BACKENDS, rg_lru
from tests.conftest import max_relative_error, rg_lru_formula

# Lambda from a = 1 in float32 and float64 (-200, -60) through ordinary decays to a_t near 0 (10).
EXTREME_LAMBDAS = [-200.0, -60.0, -5.0, 0.0, 3.0, 10.0]


def inputs(gen, B, T, lambdas, reset_p=0.1):
    D = len(lambdas)
    x, gate_x, gate_a = (torch.randn(B, T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    h0 = torch.randn(B, D, generator=gen, dtype=torch.float64)
    reset = torch.rand(B, T, generator=gen) < reset_p
    return x, gate_x, gate_a, torch.tensor(lambdas, dtype=torch.float64), h0, reset


def on_device(backend: str, *tensors):
    """The tensors where ``backend`` runs: CUDA for Triton on a GPU machine (the interpreter runs CPU tensors)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return [t.to(device) for t in tensors]


def value_and_grads(fn, leaves, reset, dy, dh):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y, h_last = fn(*leaves[:4], 8.0, leaves[4], reset)
    ((y.double() * dy.to(y.device)).sum() + (h_last.double() * dh.to(y.device)).sum()).backward()
    return [y.detach().cpu(), h_last.detach().cpu()] + [t.grad.cpu() for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_at_extreme_decays_match_the_bounded_formula(gen, backend):
    B, T = 2, 23
    x, gate_x, gate_a, lam, h0, reset = inputs(gen, B, T, EXTREME_LAMBDAS)
    dy = torch.randn(B, T, len(EXTREME_LAMBDAS), generator=gen, dtype=torch.float64)
    dh = torch.randn(B, len(EXTREME_LAMBDAS), generator=gen, dtype=torch.float64)
    # float32 inputs for the backend; the float64 truth on the same (rounded) values.
    leaves32 = [t.float() for t in (x, gate_x, gate_a, lam, h0)]
    *where, reset_where = on_device(backend, *leaves32, reset)
    got = value_and_grads(lambda *a: rg_lru(*a, backend=backend), where, reset_where, dy, dh)
    truth = value_and_grads(rg_lru_formula, [t.double() for t in leaves32], reset, dy, dh)
    names = ["y", "h_last", "dx", "dgate_x", "dgate_a", "dLambda", "dh0"]
    for name, g, t in zip(names, got, truth, strict=True):
        assert torch.isfinite(g).all(), f"{backend}: {name} is not finite"
        assert max_relative_error(g, t) < 1e-4, f"{backend}: {name}"


@pytest.mark.parametrize("steps", [1, 23], ids=["decode_step", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_inputs_keep_the_recurrence_in_float32(gen, backend, steps):
    """With bfloat16 activations every backend computes a_t, sqrt(1 - a_t^2) and the state in at least float32, so
    y is the float64 formula rounded once. a_t rounded to bfloat16 (steps of 2^-8 below 1) would change the decay it
    encodes; sqrt(1 - a_t^2) from it loses every digit near a_t = 1. The decode step (one token) and the whole
    sequence must agree: they are the same model."""
    lambdas = [-200.0, -9.0, -7.0, -5.0, -3.0, 0.0, 3.0] * 8  # a from 1 through 0.9999, 0.999 ... to 0.05
    x, gate_x, gate_a, lam, h0, reset = inputs(gen, 4, steps, lambdas, reset_p=0.0 if steps == 1 else 0.1)
    leaves = [t.bfloat16() for t in (x, gate_x, gate_a, lam)] + [h0.float()]
    x_, gate_x_, gate_a_, lam_, h0_, reset_ = on_device(backend, *leaves, reset)
    y, h_last = (t.cpu() for t in rg_lru(x_, gate_x_, gate_a_, lam_, 8.0, h0_, reset_, backend=backend))
    truth_y, truth_h = rg_lru_formula(*(t.double() for t in leaves[:4]), 8.0, leaves[4].double(), reset)
    assert y.dtype == torch.bfloat16 and h_last.dtype == torch.float32
    # One rounding to bfloat16 (2^-9), with margin. Triton's interpreter truncates float32 -> bfloat16 (a GPU rounds
    # to nearest), which can cost one more unit.
    interpreted = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    assert max_relative_error(y, truth_y) < (2**-7 if interpreted else 2**-8), backend
    # The state in float32: log a_t (down to -8 softplus(3) = -24 here) rounded in float32 compounds over the steps,
    # up to 23 * 24 * 2^-24 = 3.3e-5 (over 150 seeds: 1.4e-5 for Triton's interpreter, 8.9e-6 for torch, 3.9e-7 for
    # the float64 CPU kernel); a_t in bfloat16 would be off by 2^-9 at once.
    assert max_relative_error(h_last, truth_h) < 5e-5, backend
