"""The fused CPU RG-LRU (griffin.ops.rg_lru.cpu) against the reference operator."""

import numpy as np
import pytest
import torch

from griffin.ops.rg_lru import rg_lru_ref
from griffin.ops.rg_lru.cpu import rg_lru_cpu


def inputs(gen, B, T, D, dtype, p_reset=0.1, lam_scale=1.0):
    x, gx, ga = (torch.randn(B, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    lam = (torch.randn(D, generator=gen, dtype=torch.float64) * lam_scale).to(dtype).requires_grad_()
    h0 = torch.randn(B, D, generator=gen, dtype=torch.float64).float().requires_grad_()
    reset = torch.rand(B, T, generator=gen) < p_reset
    return x, gx, ga, lam, h0, reset


def run(f, x, gx, ga, lam, h0, reset, weights):
    for t in (x, gx, ga, lam, h0):
        t.grad = None
    y, h_last = f(x, gx, ga, lam, 8.0, h0, reset)
    (y.float() * weights).sum().add((h_last * h_last).sum()).backward()
    return [y.detach().float(), h_last.detach()] + [t.grad.float() for t in (x, gx, ga, lam, h0)]


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 129, 33), (1, 1000, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(gen, shape, dtype):
    B, T, D = shape
    args = inputs(gen, B, T, D, dtype)
    weights = torch.randn(B, T, D, generator=gen)
    fused = run(rg_lru_cpu, *args, weights)
    # Reference in float64 on the same (rounded) inputs: the truth both are measured against.
    ref_args = [t.detach().double().requires_grad_() for t in args[:5]] + [args[5]]
    ref = run(rg_lru_ref, *ref_args, weights.double())
    names = ["y", "h_last", "dx", "dgate_x", "dgate_a", "da_param", "dh0"]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(names, fused, ref, strict=True):
        scale = b.abs().max().clamp(min=1.0)
        assert ((a.double() - b).abs().max() / scale) <= tol, name


def test_gradcheck(gen):
    x, gx, ga, lam, h0, reset = inputs(gen, 2, 6, 3, torch.float64, p_reset=0.3)
    h0 = h0.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: rg_lru_cpu(*a[:4], 8.0, a[4], reset), (x, gx, ga, lam, h0))


def test_extreme_decays_are_stable_over_long_sequences(gen):
    """a_t -> 1 (Lambda very negative, so softplus -> 0) and a_t -> 0 (Lambda large) over T = 4096."""
    B, T, D = 2, 4096, 4
    x = torch.randn(B, T, D, generator=gen)
    gx, ga = torch.zeros(B, T, D), torch.zeros(B, T, D)
    lam = torch.tensor([-30.0, -5.0, 5.0, 60.0])
    y, _ = rg_lru_cpu(x, gx, ga, lam, 8.0)
    ref, _ = rg_lru_ref(x.double(), gx.double(), ga.double(), lam.double(), 8.0)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)


def test_dispatch(gen, monkeypatch):
    from griffin.ops import rg_lru as op

    x, gx, ga, lam, h0, reset = inputs(gen, 2, 9, 5, torch.float32)
    assert op._default_backend(x) == "cpu"
    outs = {b: op.rg_lru(x, gx, ga, lam, 8.0, h0, reset, backend=b)[0] for b in op.BACKENDS if b != "triton"}
    for b, y in outs.items():
        torch.testing.assert_close(y, outs["ref"], msg=b)
    monkeypatch.setenv("GRIFFIN_RG_LRU_BACKEND", "ref")
    torch.testing.assert_close(op.rg_lru(x, gx, ga, lam, 8.0, h0, reset)[0], outs["ref"])
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        op.rg_lru(x, gx, ga, lam, backend="fast")


def test_vectorizable_exp_is_accurate_and_keeps_nan():
    """exp_vectorizable (the kernels' exp) against numpy's: a few ulp on [-708, 709], saturating outside."""
    import numba
    import numpy as np

    from griffin.ops.jit import exp_vectorizable

    @numba.njit
    def apply(z):
        out = np.empty_like(z)
        for k in range(z.size):
            out[k] = exp_vectorizable(z[k])
        return out

    z = np.concatenate([np.linspace(-708.0, 709.0, 1_000_003), np.linspace(-1.0, 1.0, 10_001), [0.0, -0.0]])
    rel = np.abs(apply(z) / np.exp(z) - 1.0)
    assert rel.max() < 1e-15
    edge = apply(np.array([-1e4, -np.inf, 1e4, np.inf, np.nan]))
    assert 0.0 < edge[0] == edge[1] < 1e-307 and 1e307 < edge[2] == edge[3] < np.inf and np.isnan(edge[4])


def test_typed_expm1_and_sigmoid_keep_their_precision_and_digits():
    """expm1_typed and sigmoid_typed (the fused RG-LRU's gate math) in float32 and float64: a few ulp of numpy's
    float64 values over the range, relative also near 0 where exp(z) - 1 cancels, NaN kept, and float32 in, float32
    out (the kernel's arithmetic stays in the inputs' precision)."""
    import numba
    import numpy as np

    from griffin.ops.jit import expm1_typed, sigmoid_typed

    @numba.njit
    def apply(z):
        e, s = np.empty_like(z), np.empty_like(z)
        for k in range(z.size):
            e[k] = expm1_typed(z[k])
            s[k] = sigmoid_typed(z[k])
        return e, s

    @numba.njit
    def scalars(z):
        return expm1_typed(z), sigmoid_typed(z)

    rng = np.random.default_rng(0)
    for dtype, lo, hi, ulps in ((np.float32, -87.0, 88.0, 3), (np.float64, -708.0, 709.0, 8)):
        eps = np.finfo(dtype).eps
        z = np.concatenate([np.linspace(lo, hi, 1_000_003), rng.standard_normal(100_000) * 1e-4,
                            -np.logspace(-30, 1, 10_001), [0.0, -0.0]]).astype(dtype)
        e, s = apply(z)
        scalars(z[0])
        kind = numba.from_dtype(np.dtype(dtype))
        assert scalars.nopython_signatures[-1].return_type == numba.types.UniTuple(kind, 2)  # no widening
        z64 = z.astype(np.float64)
        truth = np.expm1(z64)
        rel = np.abs(e - truth) / np.maximum(np.abs(truth), np.finfo(dtype).tiny)
        assert rel.max() < ulps * eps, dtype
        sig = 1.0 / (1.0 + np.exp(-z64))
        assert (np.abs(s - sig) / np.maximum(sig, np.finfo(dtype).tiny)).max() < ulps * eps, dtype
        nan_e, nan_s = apply(np.array([np.nan], dtype=dtype))
        assert np.isnan(nan_e[0]) and np.isnan(nan_s[0])


def test_compiled_bf16_widens_before_the_operator_with_eager_numbers(gen):
    """Under torch.compile the 16-bit inputs reach the operator widened to float32 (the casts are the compiler's to
    fuse); values and gradients equal the eager call's, which widens inside the operator, bit for bit."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.args[0].meta["example_value"].dtype for n in gm.graph.nodes
                    if n.target is torch.ops.griffin.rg_lru_cpu_fwd.default)
        return gm.forward

    args = inputs(gen, 2, 37, 24, torch.bfloat16)
    weights = torch.randn(2, 37, 24, generator=gen)
    compiled = run(torch.compile(rg_lru_cpu, backend=backend, fullgraph=True), *args, weights)
    assert seen == [torch.float32]
    for got, want in zip(compiled, run(rg_lru_cpu, *args, weights), strict=True):
        assert torch.equal(got, want)


def test_prefetch_is_a_hint_that_reads_nothing_and_never_faults():
    """:func:`griffin.ops.jit.prefetch` (the several-row int8 decode kernel's, up to a block past a matrix's end; the
    reverse scans', rows ahead): any index, inside the array or far outside it, compiles to a hint; a non-contiguous
    array is refused."""
    import numba
    from numba.core.errors import TypingError

    from griffin.ops.jit import prefetch

    @numba.njit
    def touch(w, lo, hi, step):
        for q in range(lo, hi, step):
            prefetch(w, q)
        return w.sum()

    w = np.arange(4 * 96, dtype=np.int8).reshape(4, 96)
    assert touch(w, -(1 << 20), 1 << 24, 4096) == w.sum()
    with pytest.raises(TypingError, match="C-contiguous"):
        touch(w[:, ::2], 0, 8, 1)


@pytest.mark.parametrize("ahead_bytes", [1, 64, 2048, 1 << 20])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 40, 33), (16, 64, 64)])
def test_prefetch_distance_changes_no_bit(gen, monkeypatch, shape, ahead_bytes):
    """The reverse scans (the RG-LRU's and the linear scan's backward) prefetch rows steps ahead
    (griffin.ops.scan.cpu.steps_ahead): any distance, one step to past the sequence's start, gives the same bits."""
    from griffin.ops.scan import linear_scan

    x, gx, ga, lam, h0, reset = inputs(gen, *shape, torch.float32)
    weights = torch.randn(shape, generator=gen)
    a = torch.rand(shape, generator=gen)
    monkeypatch.setattr("griffin.ops.scan.cpu.AHEAD_BYTES", 2048)
    ref = run(rg_lru_cpu, x, gx, ga, lam, h0, reset, weights)
    ref_scan = torch.autograd.grad(linear_scan(a.requires_grad_(), x, h0, reset, backend="cpu")[0], (a, x), weights)
    monkeypatch.setattr("griffin.ops.scan.cpu.AHEAD_BYTES", ahead_bytes)
    for name, out, expected in zip(("y", "h_last", "dx", "dgx", "dga", "dlam", "dh0"),
                                   run(rg_lru_cpu, x, gx, ga, lam, h0, reset, weights), ref, strict=True):
        assert torch.equal(out, expected), name
    scan = torch.autograd.grad(linear_scan(a, x, h0, reset, backend="cpu")[0], (a, x), weights)
    assert all(torch.equal(out, expected) for out, expected in zip(scan, ref_scan, strict=True))
