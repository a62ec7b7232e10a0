"""The decode-step matmul kernel against its reference, and weight-only int8 quantisation (Section 5)."""

import pytest
import torch

from griffin.ops.matvec import check_group_size, dequantize_int8, matvec_ref, quantize_int8
from griffin.ops.matvec.cpu import MatvecWeights, matvec_cpu, matvec_op, tiles_for

ROWS = (37, 16, 5)  # odd counts and a lone row: every tile shape, tiles ending inside a matrix
K = 48


def matrices(gen, dtype, group_size, bias=True):
    weights = [torch.randn(n, K, generator=gen) / K**0.5 for n in ROWS]
    biases = [torch.randn(n, generator=gen) if bias else None for n in ROWS]
    scales = None
    if dtype == torch.int8:
        pairs = [quantize_int8(w, group_size) for w in weights]
        weights, scales = [q for q, _ in pairs], [s for _, s in pairs]
    else:
        weights = [w.to(dtype) for w in weights]
    return weights, scales, biases


@pytest.mark.parametrize("dtype,group_size", [(torch.float32, 0), (torch.bfloat16, 0), (torch.int8, 0),
                                              (torch.int8, 8), (torch.int8, 16)])
@pytest.mark.parametrize("batch", [1, 2, 4, 7, 9])
def test_kernel_equals_reference(gen, dtype, group_size, batch):
    """Weights as stored (bfloat16 widened, int8 times its group scales), float32 sums: equal to the reference up
    to the order of the float32 additions (each sum has K = 48 terms of order 1/sqrt(K))."""
    weights, scales, biases = matrices(gen, dtype, group_size, bias=batch != 2)
    x = torch.randn(batch, K, generator=gen)
    prepared = MatvecWeights.prepare(weights, scales, biases)
    got = matvec_cpu(x, prepared)
    ref = matvec_ref(x, weights, scales, biases)
    assert got.shape == (batch, sum(ROWS)) and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 2e-6 * (1 + ref.abs().max())
    # The same through the operator that torch.compile calls, and with bfloat16 activations (output in bf16).
    tiles = tiles_for([w.shape[0] for w in weights])
    op = matvec_op(x, weights, tiles, torch.from_numpy(prepared.scale), torch.from_numpy(prepared.bias))
    assert torch.equal(op, got)
    xb = x.bfloat16()
    got_b = matvec_cpu(xb, prepared)
    assert got_b.dtype == torch.bfloat16
    assert torch.allclose(got_b.float(), matvec_ref(xb, weights, scales, biases).float(), rtol=2**-7, atol=1e-6)


def test_kernel_input_shapes(gen):
    weights, scales, biases = matrices(gen, torch.float32, 0)
    prepared = MatvecWeights.prepare(weights, scales, biases)
    x = torch.randn(2, 3, K, generator=gen)
    assert torch.allclose(matvec_cpu(x, prepared), matvec_ref(x, weights, scales, biases), atol=1e-5)
    with pytest.raises(ValueError, match="input width 47"):
        matvec_cpu(torch.randn(1, 47), prepared)
    with pytest.raises(ValueError, match="one dtype"):
        MatvecWeights.prepare([weights[0], weights[1].bfloat16()])
    with pytest.raises(ValueError, match="need their scales"):
        MatvecWeights.prepare([quantize_int8(weights[0])[0]])
    with pytest.raises(ValueError, match="float16"):
        MatvecWeights.prepare([weights[0].half()])


@pytest.mark.parametrize("group_size", [0, 8, 24])
def test_quantize_int8_rounds_within_half_a_step(gen, group_size):
    w = torch.randn(20, 48, generator=gen) * torch.rand(20, 1, generator=gen) * 3
    w[3] = 0.0  # an all-zero row: scale 1, values 0
    q, scale = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert scale.shape == (20, 1 if group_size == 0 else 48 // group_size) and scale.dtype == torch.float32
    back = dequantize_int8(q, scale)
    step = scale.repeat_interleave(48 // scale.shape[1], 1)
    # half a step, plus float32 rounding of w / scale and q * scale near a tie (|w| up to 127 steps: ~1e-5 steps)
    assert ((back - w).abs() <= step * (0.5 + 1e-4)).all()
    assert (back[3] == 0).all()
    groups = w.reshape(20, scale.shape[1], -1).abs().amax(-1)  # each group's largest entry is exactly +-127 steps
    assert torch.equal(q.reshape(20, scale.shape[1], -1).abs().amax(-1)[groups > 0], torch.full_like(
        groups[groups > 0], 127, dtype=torch.int8))


@pytest.mark.parametrize("bad", [3, -8, 12, 8.0, True])
def test_unsupported_group_sizes_are_named(bad):
    with pytest.raises(ValueError, match=f"group_size={bad!r}"):
        check_group_size(bad)


def test_group_size_must_divide_the_inputs():
    with pytest.raises(ValueError, match="group_size=32 does not divide the 48 inputs of layer blocks.0.x"):
        check_group_size(32, 48, "blocks.0.x")
    with pytest.raises(ValueError, match="group_size=32"):
        quantize_int8(torch.randn(4, 48), 32)
