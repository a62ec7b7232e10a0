"""The fused element-wise kernels of a CPU decode step (griffin.inference.cpu.block_step) against their references, the
model's own layers at one token per row (Section 5): RMSNorm with the residual add before it, the gated MLP's GeLU
product, the recurrent block between its two projections (Conv1D step, block-diagonal gates, RG-LRU step, GeLU branch),
and multi-query attention between its projections (RoPE, the cache write, the attention over the cache)."""

import copy

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from griffin import ModelConfig
from griffin.inference.cpu.block_step import (
    BlockStep,
    RecurrentWeights,
    attention_step,
    gelu_product_step,
    narrow,
    recurrent_step,
    rms_norm_step,
    stack_blocks,
    stack_step,
)
from griffin.inference.cpu.matvec import MatvecWeights
from griffin.layers import EMPTY, Context, MultiQueryAttention, RecurrentBlock, RMSNorm
from griffin.layers.quantized import Int8BlockDiagonalLinear
from griffin.layers.recurrent_block import RecurrentState
from griffin.layers.rope import rope_angles
from tests.conftest import perturb_, seed_torch

DTYPES = [torch.float32, torch.bfloat16]


def ulps(dtype: torch.dtype) -> dict:
    """assert_close tolerances: float32 rounding (sums in another order), or one bfloat16 rounding of the result."""
    return dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-12)


@numba.njit
def _narrow_all(x, out):
    for i in range(x.shape[0]):
        out[i] = narrow(x[i], out[i])


def test_bfloat16_rounding_is_torchs(gen):
    """float32 -> bfloat16 in the kernels rounds as ``Tensor.to`` does: to nearest, ties to even, overflow to inf, NaN
    kept, on random values of every magnitude and on the ties and edges."""
    bits = torch.randint(0, 2**32, (100_000,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                          0x7FC00001, 0x00008000, 0x80018000, 0x7F7F8000], dtype=torch.int64)
    x = torch.cat([bits, edges]).to(torch.int32).view(torch.float32)
    out = np.empty(x.shape[0], np.uint16)
    _narrow_all(x.numpy(), out)
    got, want = torch.from_numpy(out).view(torch.bfloat16), x.to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 37), (3, 64), (8, 5)])
def test_rms_norm_step_equals_the_layer(gen, dtype, rows, width):
    norm = RMSNorm(width).to(dtype)
    perturb_(norm, gen, scale=0.5)
    x = torch.randn(rows, width, generator=gen).to(dtype) * 3
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    same, normed = rms_norm_step(x, norm.scale, norm.eps)
    assert same is x
    torch.testing.assert_close(normed, norm(x), **ulps(dtype))
    residual, normed = rms_norm_step(x, norm.scale, norm.eps, delta=delta)
    assert torch.equal(residual, x + delta)  # one rounding of the sum, as the model's add
    torch.testing.assert_close(normed, norm(x + delta), **ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximation", ["tanh", "none"])
@pytest.mark.parametrize("rows,width", [(1, 7), (5, 48)])
def test_gelu_product_step_equals_the_mlp(gen, dtype, approximation, rows, width):
    """From the matmuls' float32 outputs (the matvec kernel's) or from outputs already in the model's dtype. bfloat16:
    the layer's GeLU and product to one rounding; float32: within float32 rounding of the float64 GeLU (closer than
    PyTorch's own float32 GeLU, whose erf loses digits where 1 + erf(z) cancels)."""
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    gate, up = gate_up[:, :width], gate_up[:, width:]
    for given in (gate_up, gate_up.to(dtype)):
        got = gelu_product_step(given, approximation, dtype)
        assert got.dtype == dtype
        if dtype == torch.float32:
            want = F.gelu(gate.double(), approximate=approximation) * up.double()
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * float(up.abs().max()))
        else:
            want = F.gelu(gate.to(dtype), approximate=approximation) * up.to(dtype)
            torch.testing.assert_close(got, want, **ulps(dtype))


def recurrent_case(gen, dtype, rows, width, blocks, conv_width):
    """A perturbed recurrent block, a (rows, 1, D) input and a random cache (a Conv1D history and an RG-LRU state)."""
    seed_torch(gen)
    config = ModelConfig.from_preset("hawk-tiny", width=13, head_dim=8, rnn_width=width, gate_blocks=blocks,
                                     conv1d_width=conv_width)
    block = RecurrentBlock(config).eval()
    perturb_(block, gen, scale=0.3)
    block = block.to(dtype)
    x = torch.randn(rows, 1, 13, generator=gen).to(dtype)
    state = RecurrentState(torch.randn(rows, conv_width - 1, width, generator=gen).to(dtype),
                           torch.randn(rows, width, generator=gen))
    return block, x, state


def gate(layer):
    """A gate's tensors as RecurrentWeights.prepare takes them: (w, b), or (w, b, scale) for int8 gates."""
    return (layer.w, layer.b, layer.w_scale) if isinstance(layer, Int8BlockDiagonalLinear) else (layer.w, layer.b)


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width,blocks,conv_width,int8_gates", [
    (1, 24, 4, 4, False), (3, 21, 3, 2, False), (8, 40, 2, 1, False), (2, 12, 1, 5, False), (1, 24, 4, 4, True),
    (3, 21, 3, 2, True)])
def test_recurrent_step_equals_the_block(gen, dtype, rows, width, blocks, conv_width, int8_gates):
    """The block's output and its cache after one token: the Conv1D history shifted bit for bit, the RG-LRU state
    within float32 rounding, the output within one rounding of its dtype (the kernel computes the gates' sums in
    another order, and e^x and the sigmoid in its own float32 arithmetic). With int8 gates
    (:class:`Int8BlockDiagonalLinear`), the block's reference forward dequantises them."""
    block, x, state = recurrent_case(gen, dtype, rows, width, blocks, conv_width)
    lru = block.rg_lru
    if int8_gates:
        lru.input_gate, lru.a_gate = (Int8BlockDiagonalLinear.from_float(g) for g in (lru.input_gate, lru.a_gate))
    ref_state = RecurrentState(state.conv.clone(), state.h.clone())
    want = block(x, Context(torch.ones(rows, 1, dtype=torch.long)), ref_state)
    weights = RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, gate(lru.input_gate), gate(lru.a_gate),
                                       lru.a_param, lru.c)
    y_u = torch.cat(block.in_proj(x[:, 0]), -1)
    hidden = recurrent_step(y_u, state.conv, state.h, weights, block.config.gelu_approximation, dtype)
    assert torch.equal(state.conv, ref_state.conv)
    torch.testing.assert_close(state.h, ref_state.h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.linear_out(hidden), want[:, 0], **ulps(dtype))


@torch.no_grad()
def test_recurrent_step_reads_float32_projections(gen):
    """The matvec kernel's float32 outputs are rounded to bfloat16 first, as the model's projections are: the same
    step as from the rounded ones."""
    block, x, state = recurrent_case(gen, torch.bfloat16, 3, 24, 4, 4)
    lru = block.rg_lru
    weights = RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, (lru.input_gate.w, lru.input_gate.b),
                                       (lru.a_gate.w, lru.a_gate.b), lru.a_param, lru.c)
    y_u = torch.randn(3, 48, generator=gen)
    other = RecurrentState(state.conv.clone(), state.h.clone())
    a = recurrent_step(y_u, state.conv, state.h, weights, "tanh", torch.bfloat16)
    b = recurrent_step(y_u.to(torch.bfloat16), other.conv, other.h, weights, "tanh", torch.bfloat16)
    assert torch.equal(a, b) and torch.equal(state.conv, other.conv) and torch.equal(state.h, other.h)


def attention_case(gen, dtype, rows, heads, kv_heads, head_dim, window, rope_fraction):
    """A perturbed attention layer (local with ``window`` >= 4, global if None) and its cache after a prompt of 7
    tokens per row, two documents in row 0: its cache holds slots of the first, which the next tokens must not see."""
    seed_torch(gen)
    config = ModelConfig.from_preset("griffin-tiny", width=24, num_heads=heads, num_kv_heads=kv_heads,
                                     head_dim=head_dim, attention_window=window or 8, rope_fraction=rope_fraction)
    layer = MultiQueryAttention(config, local=window is not None).eval()
    perturb_(layer, gen, scale=0.3)
    layer = layer.to(dtype)
    cache = layer.init_cache(rows, 12, dtype, "cpu")
    segments = torch.zeros(rows, 7, dtype=torch.long)
    segments[0, 4:] = 1
    positions = torch.arange(7).repeat(rows, 1)
    positions[0, 4:] -= 4
    prompt = torch.randn(rows, 7, 24, generator=gen).to(dtype)
    layer(prompt, Context(positions, segments=segments, rope=rope_angles(positions, config.rope_dim, 1e4)), cache)
    assert (cache.segment[0] == 0).any() and (cache.segment[0] == 1).any()
    return layer, cache, positions[:, -1:], segments[:, -1:]


ATTENTION = [(1, 4, 1, 8, 4, 0.5), (3, 6, 2, 16, 5, 1.0), (2, 3, 3, 8, None, 0.5), (2, 4, 1, 12, None, 0.0)]


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,window,rope_fraction", ATTENTION)
def test_attention_step_equals_the_layer(gen, dtype, rows, heads, kv_heads, head_dim, window, rope_fraction):
    """Three tokens per row after the prompt (a local ring wraps): the cache written as the layer writes it (keys
    with RoPE bit for bit in bfloat16), the output within one rounding of its dtype (the kernel's sums run in
    another order)."""
    layer, cache, position, segment = attention_case(gen, dtype, rows, heads, kv_heads, head_dim, window,
                                                     rope_fraction)
    ref = copy.deepcopy(cache)
    for _ in range(3):
        position = position + 1
        rope = rope_angles(position, layer.config.rope_dim, 1e4) if rope_fraction else None
        x = torch.randn(rows, 1, 24, generator=gen).to(dtype)
        want = layer(x, Context(position, segments=segment, rope=rope), ref)[:, 0]
        qkv = torch.cat(layer.qkv(x[:, 0]), -1)
        hidden = attention_step(qkv, rope, cache.k, cache.v, cache.segment, cache.count, segment, window is not None,
                                cache.k.shape[1], head_dim**-0.5, dtype)
        torch.testing.assert_close(layer.proj_final(hidden), want, **ulps(dtype))
        assert torch.equal(cache.segment, ref.segment) and torch.equal(cache.count, ref.count)
        for got, expected in ((cache.k, ref.k), (cache.v, ref.v)):
            if dtype == torch.bfloat16:
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@torch.no_grad()
def test_attention_step_reads_only_the_slots_given(gen):
    """A global cache read up to ``slots`` (the model's cache_len): slots past it are not read, even if they hold
    keys of the document; a full global cache is a named error."""
    layer, cache, position, segment = attention_case(gen, torch.float32, 2, 4, 1, 8, None, 0.5)
    rope = rope_angles(position + 1, layer.config.rope_dim, 1e4)
    x = torch.randn(2, 24, generator=gen)
    qkv = torch.cat(layer.qkv(x), -1)
    poisoned = copy.deepcopy(cache)
    poisoned.k[:, 9:] = float("nan")  # past the 8 slots read (7 written + this token)
    poisoned.segment[:, 9:] = segment
    args = (False, 8, 8**-0.5, torch.float32)
    a = attention_step(qkv, rope, cache.k, cache.v, cache.segment, cache.count, segment, *args)
    b = attention_step(qkv, rope, poisoned.k, poisoned.v, poisoned.segment, poisoned.count, segment, *args)
    assert torch.equal(a, b)
    cache.count[1] = 12  # row 1's cache is full: nothing is written, row 0's neither
    before = copy.deepcopy(cache)
    with pytest.raises(ValueError, match="cache is full"):
        attention_step(qkv, rope, cache.k, cache.v, cache.segment, cache.count, segment, *args)
    assert all(torch.equal(now, then) for now, then in zip((cache.k, cache.segment, cache.count),
                                                           (before.k, before.segment, before.count), strict=True))


def test_bad_input_is_named(gen):
    block, x, state = recurrent_case(gen, torch.float32, 2, 24, 4, 4)
    lru = block.rg_lru
    gates = (lru.input_gate.w, lru.input_gate.b), (lru.a_gate.w, lru.a_gate.b)
    weights = RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, *gates, lru.a_param, lru.c)
    with pytest.raises(ValueError, match="y_u must be"):
        recurrent_step(torch.zeros(2, 47), state.conv, state.h, weights, "tanh", torch.float32)
    with pytest.raises(ValueError, match="h must be float32"):
        recurrent_step(torch.zeros(2, 48), state.conv, state.h.double(), weights, "tanh", torch.float32)
    with pytest.raises(ValueError, match="approximation"):
        recurrent_step(torch.zeros(2, 48), state.conv, state.h, weights, "erf", torch.float32)
    with pytest.raises(ValueError, match="do not fit width 24"):
        RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, gates[0], (lru.a_gate.w[:2], lru.a_gate.b),
                                 lru.a_param, lru.c)
    with pytest.raises(ValueError, match="gates must be contiguous float32, bfloat16 or int8 CPU weights, got "
                       "torch.float64"):
        RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, *((g[0].double(), g[1]) for g in gates),
                                 lru.a_param, lru.c)
    with pytest.raises(ValueError, match="of one dtype, got torch.float64"):
        RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, (gates[0][0].double(), gates[0][1]), gates[1],
                                 lru.a_param, lru.c)
    int8 = Int8BlockDiagonalLinear.from_float(lru.a_gate)
    with pytest.raises(ValueError, match="int8 weights need their scales"):
        RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, (int8.w, int8.b), (int8.w, int8.b), lru.a_param,
                                 lru.c)
    with pytest.raises(ValueError, match="delta like x"):
        rms_norm_step(torch.zeros(2, 5), torch.zeros(5), 1e-6, delta=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="gate_up must be"):
        gelu_product_step(torch.zeros(2, 5), "tanh", torch.float32)
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16, got torch.float64"):
        recurrent_step(torch.zeros(2, 48), state.conv.double(), state.h, weights, "tanh", torch.float64)
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16, got torch.float16"):
        gelu_product_step(torch.zeros(2, 6), "tanh", torch.float16)
    k, seg, count = torch.zeros(2, 5, 1, 8), torch.full((2, 5), EMPTY), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"qkv must be \(B, \(H \+ 2 H_kv\) d\)"):
        attention_step(torch.zeros(2, 30), None, k, k.clone(), seg, count, seg[:, :1], True, 5, 1.0, torch.float32)
    with pytest.raises(ValueError, match="caches must be contiguous torch.float32"):
        attention_step(torch.zeros(2, 32), None, k.bfloat16(), k.clone(), seg, count, seg[:, :1], True, 5, 1.0,
                       torch.float32)
    with pytest.raises(ValueError, match="0 < slots <= S"):
        attention_step(torch.zeros(2, 32), None, k, k.clone(), seg, count, seg[:, :1], True, 6, 1.0, torch.float32)


def test_block_step_bad_input_is_named(gen):
    """A block prepared for the stack's one call (:class:`BlockStep`, :func:`stack_blocks`, :func:`stack_step`):
    projections that do not fit the width, rows or a cache of the wrong shape or dtype, get named errors before any
    kernel runs."""
    block, _, state = recurrent_case(gen, torch.float32, 2, 24, 4, 4)
    lru = block.rg_lru
    gates = (lru.input_gate.w, lru.input_gate.b), (lru.a_gate.w, lru.a_gate.b)
    weights = RecurrentWeights.prepare(block.conv_1d.w, block.conv_1d.b, *gates, lru.a_param, lru.c)
    D, R, M = 16, 24, 40
    mixer_in, mixer_out, up, down = (MatvecWeights.prepare([torch.randn(n, k, generator=gen)])
                                     for n, k in ((2 * R, D), (D, R), (2 * M, D), (D, M)))
    scales = (torch.zeros(D), torch.zeros(D))
    step = BlockStep.prepare(scales, (1e-6, 1e-6), mixer_in, mixer_out, up, down, "tanh")
    with pytest.raises(ValueError, match=r"do not fit width 16"):
        BlockStep.prepare(scales, (1e-6, 1e-6), mixer_in, mixer_out, down, up, "tanh")
    with pytest.raises(ValueError, match="norm scales must be contiguous"):
        BlockStep.prepare((scales[0], torch.zeros(D).bfloat16()), (1e-6, 1e-6), mixer_in, mixer_out, up, down, "tanh")
    with pytest.raises(ValueError, match="approximation"):
        BlockStep.prepare(scales, (1e-6, 1e-6), mixer_in, mixer_out, up, down, "erf")
    with pytest.raises(ValueError, match="stack_blocks: no blocks"):
        stack_blocks([], 2)
    with pytest.raises(ValueError, match=r"stack_blocks: for width 24, .* got \(3, 48\)"):
        stack_blocks([(step, weights, (state.conv, state.h))], 3)  # a state of 2 rows
    with pytest.raises(ValueError, match="stack_blocks: h must be float32"):
        stack_blocks([(step, weights, (state.conv, state.h.double()))], 2)
    stack = stack_blocks([(step, weights, (state.conv, state.h))], 2)
    with pytest.raises(ValueError, match=r"x must be contiguous \(2, 16\) torch.float32 CPU rows, got \(16,\)"):
        stack_step(torch.zeros(D), stack, None, None, None)
    out = stack_step(torch.randn(2, D, generator=gen), stack, None, None, None)
    assert out.shape == (2, D) and out.dtype == torch.float32 and torch.isfinite(out).all()
    k, seg, count = torch.zeros(1, 5, 1, 8), torch.full((1, 5), EMPTY), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="stack_blocks: block 0's output projection reads 24 inputs, not the 4 heads"):
        stack_blocks([(step, None, (k, k.clone(), seg, count, True, 1.0))], 1)
    k7 = torch.zeros(1, 5, 1, 7)  # heads of 7: no head count makes the projections' 48 outputs
    with pytest.raises(ValueError, match="stack_blocks: for a cache of"):
        stack_blocks([(step, None, (k7, k7.clone(), seg, count, True, 1.0))], 1)


# Each numba function of the engine that mirrors a layer's math -> the test that compares it with that layer on
# random float32 and bfloat16 inputs (through the kernel that runs it).
MIRRORS = {
    "griffin.ops.jit.narrow": "test_bfloat16_rounding_is_torchs",
    "griffin.inference.cpu.block_step._gelu": "test_gelu_product_step_equals_the_mlp",
    "griffin.inference.cpu.block_step._normalise": "test_rms_norm_step_equals_the_layer",
    "griffin.inference.cpu.block_step._gelu_product_kernel": "test_gelu_product_step_equals_the_mlp",
    "griffin.inference.cpu.block_step._recurrent_head": "test_recurrent_step_equals_the_block",
    "griffin.inference.cpu.block_step._rotated": "test_attention_step_equals_the_layer",
    "griffin.inference.cpu.block_step._attention_write": "test_attention_step_equals_the_layer",
    "griffin.inference.cpu.block_step._attention_task": "test_attention_step_equals_the_layer",
    "griffin.inference.cpu.matvec.block_product": "test_recurrent_step_equals_the_block",
}


def _resolve(path: str) -> object:
    """The object a dotted path names (a module attribute, or a class attribute)."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_each_mirror_names_its_layer_function_and_is_compared_with_it():
    """Every engine function whose docstring says "Mirrors" names layer functions that exist, and is listed with a
    test here that compares it with them; every listed one says what it mirrors."""
    import inspect
    import re

    import griffin.inference.cpu.block_step as block_step
    import griffin.inference.cpu.matvec as matvec
    import griffin.ops.jit as jit

    said = set()
    for module in (block_step, matvec, jit):
        for name, obj in vars(module).items():
            doc = inspect.getdoc(getattr(obj, "py_func", obj)) or "" if callable(obj) else ""
            if getattr(obj, "__module__", None) == module.__name__ and "Mirrors" in doc:
                said.add(f"{module.__name__}.{name}")
                mirrored = re.findall(r":(?:func|meth):`([\w.]+)`", doc[doc.index("Mirrors"):])
                assert mirrored, f"{module.__name__}.{name} says it mirrors, but names no function"
                for path in mirrored:
                    _resolve(path)  # raises if the layer function was renamed or removed
    assert said == set(MIRRORS), f"listed here but not saying what they mirror, or the reverse: {said ^ set(MIRRORS)}"
    for test in MIRRORS.values():
        assert callable(globals()[test])
