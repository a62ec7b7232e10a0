"""GeLU (griffin.ops.gelu): the sigmoid form of the tanh approximation against F.gelu, and which form runs where."""

import pytest
import torch
import torch.nn.functional as F

from griffin.ops.gelu import gelu, gelu_tanh_by_sigmoid


def test_sigmoid_form_is_the_tanh_approximation_float64(gen):
    x = torch.randn(4099, generator=gen, dtype=torch.float64) * 4
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-30, -30.0, 30.0, 1e4, -1e4], dtype=torch.float64)])
    torch.testing.assert_close(gelu_tanh_by_sigmoid(x), F.gelu(x, approximate="tanh"), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_gelu_takes_the_sigmoid_form_with_the_gradients_of_f_gelu(gen, dtype):
    """Compiled on a CPU the tanh approximation runs as x sigmoid(2z) (no tanh, no gelu in the graph), with
    F.gelu's values and gradients in float64 within the dtype's rounding; the exact GeLU and eager calls stay
    F.gelu."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    x = (torch.randn(3, 257, generator=gen, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    out = torch.compile(lambda t: gelu(t, "tanh"), backend=backend, fullgraph=True)(x)
    assert any("sigmoid" in t for t in graphs[0]) and not any("gelu" in t or "tanh" in t for t in graphs[0])
    x64 = x.detach().double().requires_grad_()
    ref = F.gelu(x64, approximate="tanh")
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((out.double() * g).sum(), x)
    (want,) = torch.autograd.grad((ref * g).sum(), x64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.compile(lambda t: gelu(t, "none"), backend=backend, fullgraph=True)(x)
    assert any("gelu" in t for t in graphs[1])
    assert torch.equal(gelu(x, "tanh"), F.gelu(x, approximate="tanh"))  # eager: F.gelu itself
