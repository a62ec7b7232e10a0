"""The linear scan: the fast CPU backend (griffin.ops.scan.cpu) against the reference and exact results.

Fast outputs are compared with :func:`linear_scan_ref` run in float64 on the same (already rounded) inputs. The
tolerance is a first-order rounding-error bound computed from that float64 truth (unit roundoff u of the
accumulation dtype per multiply and add, plus one rounding to the output dtype), so each comparison allows
what correct float32 (or float64) arithmetic can produce and little more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from griffin.ops import scan
from griffin.ops.scan import cpu as scan_cpu
from griffin.ops.scan import default_backend, linear_scan, linear_scan_ref

TRIALS = range(3)  # fresh inputs from the seeded generator each time (tests.conftest.gen)
SHAPES = [(1, 1, 1), (3, 1, 5), (1, 7, 33), (3, 7, 1), (3, 129, 5), (1, 129, 33), (3, 129, 33)]
LONG_SHAPES = [(1, 4096, 5), (3, 4096, 1)]  # small B·D: the reference's backward is O(T²·B·D)
# (reset pattern, h0 given): no resets, random resets (none at t=0), random resets plus one at t=0
MODES = [("none", False), ("random", False), ("random", True), ("first", True)]
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# half the smallest subnormal: the absolute rounding error near zero
UNDERFLOW = {dtype: torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2 for dtype in UNIT_ROUNDOFF}


def _id(value: object) -> str:
    """Readable test ids: float32, 3x129x33."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else "x".join(map(str, value))


def make_inputs(
    gen: torch.Generator, shape: tuple[int, int, int], dtype: torch.dtype, resets: str, with_h0: bool,
    a_low: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """a uniform in [a_low, 1), b standard normal (both in dtype), h0 float32 normal, reset bool (B, T)."""
    batch, steps, dim = shape
    a = (a_low + (1 - a_low) * torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype)
    b = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    h0 = torch.randn(batch, dim, generator=gen).to(torch.float64 if dtype == torch.float64 else torch.float32)
    reset = torch.rand(batch, steps, generator=gen) < 0.1
    reset[:, 0] = resets == "first"
    return a, b, h0 if with_h0 else None, None if resets == "none" else reset


def scan_and_grads(fn, a, b, h0, reset, g, g_last, dtype=None) -> dict[str, Tensor]:
    """Values of fn(a, b, h0, reset) and the gradients of <h, g> + <h_last, g_last> for a, b and h0 (in dtype)."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (a, b, h0) if x is not None]
    h, h_last = fn(*leaves[:2], leaves[2] if h0 is not None else None, reset)
    grads = torch.autograd.grad((h, h_last), leaves, (g.to(h.dtype), g_last.to(h_last.dtype)))
    out = {"h": h.detach(), "h_last": h_last.detach(), "grad_a": grads[0], "grad_b": grads[1]}
    if h0 is not None:
        out["grad_h0"] = grads[2]
    return out


def fast(a, b, h0=None, reset=None):
    return linear_scan(a, b, h0, reset, backend="cpu")


def rounding_bounds(
    truth: dict[str, Tensor], a, h0, reset, u_acc: float, u_out: float, eta_out: float
) -> dict[str, Tensor]:
    """First-order bounds on |computed - exact| for a scan accumulated with unit roundoff u_acc and rounded to an
    output dtype with unit roundoff u_out and underflow error eta_out.

    Forward:  e_t <= a_t e_{t-1} + u (|a_t h_{t-1}| + |h_t|).  Backward: dh_t = g_t + a_{t+1} dh_{t+1} the same way
    in reverse; grad_a_t = dh_t h_{t-1} adds |h_{t-1}| e(dh_t) + |dh_t| e_{t-1} + u |grad_a_t|. A reset zeroes a_t.
    """
    batch, steps, dim = a.shape
    keep = np.ones((batch, steps, 1)) if reset is None else (~reset).double().numpy()[..., None]
    a_eff = a.double().numpy() * keep
    h, dh = truth["h"].numpy(), truth["grad_b"].numpy()
    h_init = np.zeros((batch, 1, dim)) if h0 is None else h0.double().numpy()[:, None]
    h_prev = np.concatenate([h_init, h[:, :-1]], axis=1) * keep
    e_h, e_dh = np.zeros_like(h), np.zeros_like(h)
    prev = np.zeros((batch, dim))
    for t in range(steps):
        prev = e_h[:, t] = a_eff[:, t] * prev + u_acc * (np.abs(a_eff[:, t] * h_prev[:, t]) + np.abs(h[:, t]))
    nxt, a_next, dh_next = np.zeros((batch, dim)), np.zeros((batch, dim)), np.zeros((batch, dim))
    for t in range(steps - 1, -1, -1):
        nxt = e_dh[:, t] = a_next * nxt + u_acc * (np.abs(a_next * dh_next) + np.abs(dh[:, t]))
        a_next, dh_next = a_eff[:, t], dh[:, t]
    e_prev = np.concatenate([np.zeros((batch, 1, dim)), e_h[:, :-1]], axis=1) * keep
    grad_a = dh * h_prev
    e_ga = e_dh * np.abs(h_prev) + np.abs(dh) * e_prev + u_acc * np.abs(grad_a)

    def rounded(err: np.ndarray, exact: np.ndarray) -> Tensor:
        return torch.from_numpy(err + u_out * (np.abs(exact) + err) + eta_out)

    bounds = {"h": rounded(e_h, h), "h_last": torch.from_numpy(e_h[:, -1]), "grad_b": rounded(e_dh, dh),
              "grad_a": rounded(e_ga, grad_a)}  # fmt: skip
    if h0 is not None and steps:
        a0 = a_eff[:, 0]
        bounds["grad_h0"] = torch.from_numpy(a0 * e_dh[:, 0] + u_acc * np.abs(a0 * dh[:, 0]))
    return bounds


def assert_within_rounding(gen, a, b, h0, reset, tighten: float = 1.0) -> None:
    """Fast scan values and gradients within the rounding bound (times tighten) of the float64 reference."""
    dtype = a.dtype
    g = torch.randn(a.shape, generator=gen, dtype=torch.float64).to(dtype)
    g_last = torch.randn(a.shape[0], a.shape[2], generator=gen, dtype=torch.float64).to(scan.accumulation_dtype(dtype))
    got = scan_and_grads(fast, a, b, h0, reset, g, g_last)
    truth = scan_and_grads(linear_scan_ref, a, b, h0, reset, g, g_last, torch.float64)
    u_acc = UNIT_ROUNDOFF[scan.accumulation_dtype(dtype)] + UNIT_ROUNDOFF[torch.float64]  # fast path + the truth
    low = dtype not in (torch.float32, torch.float64)
    bounds = rounding_bounds(truth, a, h0, reset, u_acc, UNIT_ROUNDOFF[dtype] * low, UNDERFLOW[dtype] * low)
    assert got["h"].dtype == dtype and got["grad_a"].dtype == dtype and got["grad_b"].dtype == dtype
    assert got["h_last"].dtype == scan.accumulation_dtype(dtype)
    assert set(got) == set(truth) == set(bounds)
    for name, value in got.items():
        err = (value.double() - truth[name]).abs()
        allowed = tighten * 1.01 * bounds[name] + 1e-300
        worst = (err - allowed).argmax()
        assert (err <= allowed).all(), (
            f"{name}: error {err.flatten()[worst]:.3g} > bound {allowed.flatten()[worst]:.3g} at flat index {worst}"
        )


@pytest.mark.parametrize("trial", TRIALS)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize(("resets", "with_h0"), MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_matches_reference(gen, trial, shape, resets, with_h0, dtype):
    assert_within_rounding(gen, *make_inputs(gen, shape, dtype, resets, with_h0))


@pytest.mark.parametrize("trial", TRIALS)
@pytest.mark.parametrize("shape", LONG_SHAPES, ids=_id)
@pytest.mark.parametrize(("resets", "with_h0"), [("none", False), ("first", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_matches_reference_long(gen, trial, shape, resets, with_h0, dtype):
    assert_within_rounding(gen, *make_inputs(gen, shape, dtype, resets, with_h0))


@pytest.mark.parametrize("trial", TRIALS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=_id)
def test_matches_reference_other_dtypes(gen, trial, dtype):
    assert_within_rounding(gen, *make_inputs(gen, (3, 129, 33), dtype, "random", True))


@pytest.mark.parametrize("trial", TRIALS)
def test_float32_is_within_float32_rounding_of_float64_truth(gen, trial):
    """Long memory (a in [0.9, 1)) over T = 4096, with resets and h0: values and gradients stay within the
    float32 rounding bound of the float64 truth."""
    a, b, h0, reset = make_inputs(gen, (2, 4096, 4), torch.float32, "random", True, a_low=0.9)
    assert_within_rounding(gen, a, b, h0, reset)


@pytest.mark.parametrize("trial", TRIALS)
def test_low_precision_backward_uses_float32_state(gen, trial):
    """bf16: grad_a = dh_t h_{t-1} with the float32 h_{t-1}, so its error is one bf16 rounding (u = 2^-8), not
    two (which using the bf16-rounded output h would add); the bound is checked with no extra slack."""
    a, b, h0, reset = make_inputs(gen, (3, 129, 33), torch.bfloat16, "random", True, a_low=0.5)
    assert_within_rounding(gen, a, b, h0, reset, tighten=1 / 1.01)


@pytest.mark.parametrize("trial", TRIALS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
def test_low_precision_time_blocks(gen, trial, dtype, monkeypatch):
    """16-bit inputs are scanned in time blocks; blocks of 5 steps (the last one partial, a reset on a block's first
    step) give exactly the one-block result, within the rounding bound of the float64 reference."""
    a, b, h0, reset = make_inputs(gen, (3, 129, 33), dtype, "first", True)
    reset[:, 5] = True
    g, g_last = torch.randn(a.shape, generator=gen).to(dtype), torch.randn(3, 33, generator=gen)
    whole = scan_and_grads(fast, a, b, h0, reset, g, g_last)
    monkeypatch.setattr(scan_cpu, "_BLOCK_BYTES", 5 * 3 * 33 * 4)
    assert len(scan_cpu._time_blocks(a)) == 26
    blocked = scan_and_grads(fast, a, b, h0, reset, g, g_last)
    for name, value in whole.items():
        assert torch.equal(blocked[name], value), name
    assert_within_rounding(gen, a, b, h0, reset)


@pytest.mark.parametrize("a_value", [0.0, 1.0])
@pytest.mark.parametrize("trial", TRIALS)
def test_extreme_decays_over_long_sequences(gen, trial, a_value):
    """a = 1: h is h0 plus the cumulative sum of b (gradients: reverse cumulative sums); a = 0: h = b exactly."""
    B, T, D = 3, 4096, 33
    b = torch.randn(B, T, D, generator=gen, requires_grad=True)
    a = torch.full((B, T, D), a_value, requires_grad=True)
    h0 = torch.randn(B, D, generator=gen, requires_grad=True)
    g, g_last = torch.randn(B, T, D, generator=gen), torch.randn(B, D, generator=gen)
    h, h_last = fast(a, b, h0)
    grad_a, grad_b, grad_h0 = torch.autograd.grad((h, h_last), (a, b, h0), (g, g_last))
    assert torch.isfinite(h).all() and torch.isfinite(grad_a).all()
    if a_value == 0.0:
        dh = g.clone()
        dh[:, -1] += g_last
        h_prev = torch.cat([h0[:, None], b[:, :-1]], dim=1).detach()
        for got, want in ((h, b), (h_last, b[:, -1]), (grad_b, dh), (grad_a, dh * h_prev), (grad_h0, 0 * h0)):
            assert torch.equal(got, want.detach())
        return
    h64 = h0.double()[:, None] + b.double().cumsum(1)
    dh64 = g.double().flip(1).cumsum(1).flip(1) + g_last.double()[:, None]
    h_prev64 = torch.cat([h0.double()[:, None], h64[:, :-1]], dim=1)
    # a float32 running sum of n terms is within (n - 1) u (sum of |terms|) of the exact sum
    u = 2.0**-24
    h_tol = u * T * (h0.double().abs()[:, None] + b.double().abs().cumsum(1))
    dh_tol = u * T * (g.double().abs().flip(1).cumsum(1).flip(1) + g_last.double().abs()[:, None])
    h_prev_tol = torch.cat([torch.zeros(B, 1, D, dtype=torch.float64), h_tol[:, :-1]], dim=1)
    grad_a64 = dh64 * h_prev64
    for name, got, want, tol in (
        ("h", h, h64, h_tol),
        ("h_last", h_last, h64[:, -1], h_tol[:, -1]),
        ("grad_b", grad_b, dh64, dh_tol),
        ("grad_a", grad_a, grad_a64, dh_tol * h_prev64.abs() + dh64.abs() * h_prev_tol + u * grad_a64.abs()),
        ("grad_h0", grad_h0, dh64[:, 0], dh_tol[:, 0]),
    ):
        assert ((got.double() - want).abs() <= tol).all(), name


def test_gradcheck_with_resets_and_initial_state(gen):
    a, b, h0, reset = make_inputs(gen, (2, 9, 3), torch.float64, "random", True)
    reset[1, 4] = True
    args = [x.requires_grad_() for x in (a, b, h0)]
    assert torch.autograd.gradcheck(lambda a, b, h0: fast(a, b, h0, reset), args)
    reset[0, 0] = True  # reset at t = 0: the gradient into h0 is zero for that row
    assert torch.autograd.gradcheck(lambda a, b, h0: fast(a, b, h0, reset), args)
    a2 = torch.rand(1, 4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fast(a, b), (a2, a2.detach().clone().requires_grad_()))


def test_double_backward_is_refused(gen):
    a = torch.rand(1, 3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    h, _ = fast(a, torch.ones(1, 3, 2, dtype=torch.float64))
    (grad_a,) = torch.autograd.grad(h, a, torch.ones_like(h, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad_a.sum().backward()


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_empty_sequence(gen, with_h0, dtype):
    h0 = torch.randn(2, 3, generator=gen, requires_grad=True) if with_h0 else None
    a, b = (torch.rand(2, 0, 3, dtype=dtype, requires_grad=True) for _ in range(2))
    h, h_last = fast(a, b, h0, torch.zeros(2, 0, dtype=torch.bool))
    assert h.shape == (2, 0, 3) and h.dtype == dtype and h_last.shape == (2, 3) and h_last.dtype == torch.float32
    if not with_h0:
        assert torch.equal(h_last, torch.zeros(2, 3))
        return
    assert torch.equal(h_last, h0.detach())
    g_last = torch.randn(2, 3, generator=gen)
    (grad_h0,) = torch.autograd.grad(h_last, h0, g_last)
    assert torch.equal(grad_h0, g_last)


def test_non_contiguous_inputs(gen):
    big_a = torch.rand(5, 3, 9, generator=gen)  # (D', B, T) views transposed to (B, T, D) with strided D
    big_b = torch.randn(3, 9, 10, generator=gen)
    a = big_a.permute(1, 2, 0)
    b = big_b[:, :, ::2]
    h0 = torch.randn(5, 3, generator=gen).t()
    reset = (torch.rand(9, 3, generator=gen) < 0.3).t()
    assert not (a.is_contiguous() or b.is_contiguous() or h0.is_contiguous() or reset.is_contiguous())
    got = fast(a, b, h0, reset)
    want = fast(a.contiguous(), b.contiguous(), h0.contiguous(), reset.contiguous())
    ref = linear_scan_ref(a.double(), b.double(), h0.double(), reset)
    for x, y, r in zip(got, want, ref, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, r.float())


def test_inputs_without_grad_build_no_graph(gen):
    a, b = torch.rand(2, 5, 3, generator=gen), torch.randn(2, 5, 3, generator=gen)
    h, h_last = fast(a, b)
    assert not h.requires_grad and not h_last.requires_grad
    a.requires_grad_()
    with torch.no_grad():
        h2, _ = fast(a, b)
    assert h2.grad_fn is None and torch.equal(h2, h)
    h3, _ = fast(a, b)
    assert h3.grad_fn is not None and torch.equal(h3, h)


def test_default_backend(monkeypatch):
    monkeypatch.delenv("GRIFFIN_SCAN_BACKEND", raising=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert default_backend(torch.zeros(1, 2, 1, dtype=dtype)) == "cpu"
        assert default_backend(torch.zeros(1, 2, 1, dtype=dtype, requires_grad=True)) == "cpu"
        assert default_backend(torch.zeros(1, 1, 1, dtype=dtype)) == "ref"  # a single decode step
    assert default_backend(torch.zeros(1, 2, 1, dtype=torch.complex64)) == "ref"
    assert default_backend(torch.zeros(1, 1, 1, device="meta")) == "ref"
    monkeypatch.setenv("GRIFFIN_SCAN_BACKEND", "ref")
    assert default_backend(torch.zeros(1, 1, 1)) == "ref"
    # complex inputs still scan through the reference by default
    monkeypatch.delenv("GRIFFIN_SCAN_BACKEND")
    a = torch.full((1, 3, 1), 0.5j)
    h, _ = linear_scan(a, torch.ones(1, 3, 1, dtype=torch.complex64))
    torch.testing.assert_close(h, torch.tensor([1, 1 + 0.5j, 1 + 0.5j - 0.25]).reshape(1, 3, 1))


@pytest.mark.parametrize(
    ("a", "b", "h0", "reset", "error", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 3), None, None, ValueError, r"\(2, 3\)"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), None, None, ValueError, r"\(2, 3, 5\)"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 5), None, ValueError, r"\(2, 5\)"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), None, torch.zeros(2, 4, dtype=torch.bool), ValueError,
         r"got \(2, 4\)"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), None, torch.zeros(2, 3), TypeError, "torch.float32"),
        (torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3, 4, dtype=torch.int64), None, None, TypeError,
         "torch.int64"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.float64), None, None, TypeError, "torch.float64"),
        (torch.zeros(1, 2, 1, dtype=torch.complex64), torch.zeros(1, 2, 1, dtype=torch.complex64), None, None,
         TypeError, "torch.complex64"),
        (torch.zeros(1, 2, 1, device="meta"), torch.zeros(1, 2, 1, device="meta"), None, None, ValueError, "meta"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_naming_the_value(a, b, h0, reset, error, match):
    with pytest.raises(error, match=match):
        fast(a, b, h0, reset)


@pytest.mark.parametrize("trial", TRIALS)
@pytest.mark.parametrize("steps", [1, 2, 3, 17, 64, 129])
@pytest.mark.parametrize(("resets", "with_h0"), [("none", False), ("random", True), ("first", True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_id)
def test_associative_scan_matches_reference(gen, trial, steps, resets, with_h0, dtype):
    """The associative scan (the paper's Figure 9 baseline): values and gradients of the float64 reference."""
    a, b, h0, reset = make_inputs(gen, (2, steps, 5), dtype, resets, with_h0)
    g = torch.randn(a.shape, generator=gen, dtype=torch.float64)
    g_last = torch.randn(a.shape[0], a.shape[2], generator=gen, dtype=torch.float64)
    got = scan_and_grads(scan.linear_scan_assoc, a, b, h0, reset, g, g_last)
    truth = scan_and_grads(linear_scan_ref, a, b, h0, reset, g, g_last, torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert got.keys() == truth.keys()
    for name, value in got.items():
        torch.testing.assert_close(value.double(), truth[name], rtol=tol, atol=tol, msg=name)
    assert linear_scan(a, b, h0, reset, backend="assoc")[0].dtype == dtype
