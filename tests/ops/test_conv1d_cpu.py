"""The fused CPU Conv1D (griffin.ops.conv1d.cpu) against the reference operator."""

import pytest
import torch

from griffin.ops import conv1d as op
from griffin.ops.conv1d import conv1d_ref
from griffin.ops.conv1d.cpu import conv1d_cpu


def inputs(gen, B, T, D, K, dtype, state_len=0, p_reset=0.15):
    def draw(*shape, dt):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt).requires_grad_()

    x = draw(B, T, D, dt=dtype)
    w = draw(K, D, dt=torch.float64 if dtype == torch.float64 else torch.float32)
    b = draw(D, dt=w.dtype)
    state = draw(B, state_len, D, dt=dtype) if state_len else None
    reset = torch.rand(B, T, generator=gen) < p_reset
    return x, w, b, reset, state


def run(f, x, w, b, reset, state, weights):
    leaves = [t for t in (x, w, b, state) if t is not None]
    y = f(x, w, b, reset, state)
    grads = torch.autograd.grad((y.double() * weights).sum(), leaves)
    return [y.detach().double()] + [g.double() for g in grads]


@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (3, 7, 5, 4), (2, 129, 33, 4), (2, 50, 16, 2), (1, 9, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_len", [0, 3])
def test_matches_reference(gen, shape, dtype, state_len):
    B, T, D, K = shape
    args = inputs(gen, B, T, D, K, dtype, state_len)
    weights = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    fused = run(conv1d_cpu, *args, weights)
    # The reference in float64 on the same (rounded) inputs: the truth both are measured against.
    ref_args = [t if t is None or t.dtype == torch.bool else t.detach().double().requires_grad_() for t in args]
    ref = run(conv1d_ref, *ref_args, weights)
    names = ["y", "dx", "dw", "db"] + (["dstate"] if state_len else [])
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the input gradient is rounded once to bf16
    for name, a, r in zip(names, fused, ref, strict=True):
        assert ((a - r).abs().max() / r.abs().max().clamp(min=1.0)) <= tol, name


def test_float32_forward_is_the_references_to_the_bit(gen):
    x, w, b, reset, state = inputs(gen, 3, 40, 24, 4, torch.float32, 3)
    assert torch.equal(conv1d_cpu(x, w, b, reset, state), conv1d_ref(x, w, b, reset, state))
    assert conv1d_cpu(x.bfloat16(), w, b).dtype == torch.float32  # promoted as x * w + b would be


def test_the_weights_storage_stays_resizable(gen):
    """FSDP2 frees a gathered parameter by resizing its storage to 0 after the forward: the kernels must not take
    the parameters' own storage through .numpy() (which makes it unresizable)."""
    x, w, b, reset, _ = inputs(gen, 2, 9, 5, 4, torch.float32)
    conv1d_cpu(x, w, b, reset).sum().backward()
    for p in (w, b):
        p.untyped_storage().resize_(0)


def test_gradcheck(gen):
    x, w, b, reset, state = inputs(gen, 2, 8, 3, 4, torch.float64, 2, p_reset=0.3)
    assert torch.autograd.gradcheck(lambda *a: conv1d_cpu(*a[:3], reset, a[3]), (x, w, b, state))


def test_document_starts_hide_the_previous_document(gen):
    """Changing every input before a document start changes no output from it on."""
    x, w, b, _, state = inputs(gen, 1, 12, 4, 4, torch.float32, 3)
    reset = torch.zeros(1, 12, dtype=torch.bool)
    reset[0, 6] = True
    y = conv1d_cpu(x, w, b, reset, state)
    x2 = x.detach().clone()
    x2[:, :6] += 5.0
    y2 = conv1d_cpu(x2, w, b, reset, state.detach() + 5.0)
    torch.testing.assert_close(y[:, 6:], y2[:, 6:], rtol=0, atol=0)
    assert not torch.allclose(y[:, 5], y2[:, 5])


def test_opaque_under_torch_compile(gen):
    """The model compiles with fullgraph=True: the operator is one node, and compiled equals eager."""
    x, w, b, reset, _ = inputs(gen, 2, 33, 8, 4, torch.float32)

    def loss(x, w, b):
        return (op.causal_conv1d(x, w, b, reset, backend="cpu").sin() * 3).sum()

    eager = torch.autograd.grad(loss(x, w, b), (x, w, b))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x, w, b), (x, w, b))
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e)


def test_opcheck(gen):
    x, w, b, reset, _ = inputs(gen, 2, 9, 5, 4, torch.float32)
    torch.library.opcheck(torch.ops.griffin.conv1d_cpu_fwd.default, (x, w, b, reset, 0))
    torch.library.opcheck(torch.ops.griffin.conv1d_cpu_fwd.default, (x, w, b, None, 2))


def test_dispatch_and_bad_input(gen, monkeypatch):
    x, w, b, reset, state = inputs(gen, 2, 9, 5, 4, torch.float32, 3)
    assert op._default_backend(x, w, b) == "cpu"
    assert op._default_backend(x[:, :1], w, b) == "ref"  # a decode step
    outs = {be: op.causal_conv1d(x, w, b, reset, state, backend=be) for be in op.BACKENDS}
    torch.testing.assert_close(outs["cpu"], outs["ref"])
    monkeypatch.setenv("GRIFFIN_CONV1D_BACKEND", "ref")
    torch.testing.assert_close(op.causal_conv1d(x, w, b, reset, state), outs["ref"])
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        op.causal_conv1d(x, w, b, backend="fast")
    with pytest.raises(ValueError, match=r"w must be \(temporal width, 5\), got shape \(4, 6\)"):
        op.causal_conv1d(x, torch.zeros(4, 6), b)
    with pytest.raises(ValueError, match="reset must be a bool tensor of shape"):
        op.causal_conv1d(x, w, b, reset.int())
    with pytest.raises(ValueError, match=r"state must be \(2, K - 1, 5\)"):
        op.causal_conv1d(x, w, b, state=state[:1])


def test_compiled_bf16_widens_before_the_operator_with_eager_numbers(gen):
    """Under torch.compile the bf16 input reaches the operator widened to float32 (the cast is the compiler's to
    fuse); the output and gradients equal the eager call's, which widens inside the operator, bit for bit."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.args[0].meta["example_value"].dtype for n in gm.graph.nodes
                    if n.target is torch.ops.griffin.conv1d_cpu_fwd.default)
        return gm.forward

    x, w, b, reset, state = inputs(gen, 2, 29, 24, 4, torch.bfloat16, state_len=3)
    g = torch.randn(2, 29, 24, generator=gen)

    def grads(f):
        for t in (x, w, b, state):
            t.grad = None
        y = f(x, w, b, reset, state)
        (y.float() * g).sum().backward()
        return [y.detach(), *(t.grad for t in (x, w, b, state))]

    compiled = grads(torch.compile(conv1d_cpu, backend=backend, fullgraph=True))
    assert seen == [torch.float32]
    for got, want in zip(compiled, grads(conv1d_cpu), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
