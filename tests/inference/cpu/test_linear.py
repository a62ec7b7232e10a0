"""The decode step through the matvec kernel (fused projections, float and int8 weights) against the reference
step, the model's own forward pass (Section 5)."""

import copy

import pytest
import torch

from griffin import CausalLM, Decoder, ModelConfig, prefill
from griffin.inference.cpu.isa import FAST_DOTS
from griffin.inference.cpu.linear import MatvecBlockDiagonal, MatvecLinear, matvec_swapped
from griffin.inference.cpu.matvec import block_diagonal_cpu
from griffin.layers import BlockDiagonalLinear, LinearGroup
from griffin.layers.quantized import Int8BlockDiagonalLinear
from griffin.quantize import quantize_int8
from tests.conftest import perturb_, seed_torch

FAMILIES = ["mqa", "hawk", "griffin"]


def tiny(family, gen, dtype=torch.float32, **config):
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset(f"{family}-tiny", **config)).eval()
    perturb_(model, gen)
    return model.to(dtype)


@torch.no_grad()
def decode(model, prompts, tokens, **decoder_options):
    """Logits of one decode step per entry of ``tokens`` (the reference run's greedy tokens, so that every path
    sees the same inputs) after the prompts."""
    _, cache = prefill(model, prompts, max_length=prompts.shape[1] + len(tokens) + 1)
    decoder = Decoder(model, cache, **decoder_options)
    return torch.stack([decoder(t).float() for t in tokens])


@torch.no_grad()
def reference_tokens(model, prompts, steps):
    logits, cache = prefill(model, prompts, max_length=prompts.shape[1] + steps + 1)
    tokens = []
    for _ in range(steps):
        tokens.append(logits.float().argmax(-1))
        logits = model(tokens[-1][:, None], cache=cache)[:, -1]
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_matvec_step_equals_reference_step(gen, family, batch):
    """float32: equal to rounding (the kernel's sums run in another order); bfloat16: both accumulate in float32 and
    round each projection to bfloat16, so an element may differ by an ulp, which the following layers carry: after
    8 steps the logits differ by at most 2% of their range (observed: under 1%)."""
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        model = tiny(family, gen, dtype)
        prompts = torch.randint(0, 32, (batch, 7), generator=gen)
        tokens = reference_tokens(model, prompts, 8)
        ref = decode(model, prompts, tokens, prepack=False, matvec=False)
        got = decode(model, prompts, tokens, matvec=True)
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= tol * scale, (dtype, (got - ref).abs().max() / scale)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("instructions", [False, True])
def test_int8_step_equals_int8_reference(gen, family, instructions, monkeypatch):
    """An int8 model's decode step through the kernel (3 rows) against the same model's forward pass, which
    dequantises (the reference). Widened to float32 (``instructions=False``): the same int8 weights, so equal to
    float32 rounding. Through ``vpdpbusd``: each row is first rounded to int16 steps of 1/32767 of its largest entry
    (an error of at most half a step per entry), which moves the logits by more than float32 rounding: within 1e-3 of
    the largest logit (over 200 seeds per family the largest was 3.4e-4; a wrong sum or scale moves them by O(1))."""
    import griffin.inference.cpu.matvec as kernel

    if instructions and "int8" not in kernel.FAST_DOTS:
        pytest.skip("this host has no unsigned x signed byte instruction (AVX-512 VNNI)")
    if not instructions:
        monkeypatch.setattr(kernel, "FAST_DOTS", frozenset())
    model = quantize_int8(tiny(family, gen), group_size=8)
    prompts = torch.randint(0, 32, (3, 7), generator=gen)
    tokens = reference_tokens(model, prompts, 6)
    got = decode(model, prompts, tokens)  # int8 models decode through the kernel by default
    _, cache = prefill(model, prompts, max_length=20)
    with torch.no_grad():
        ref = torch.stack([model(t[:, None], cache=cache)[:, -1].float() for t in tokens])
    assert (got - ref).abs().max() <= (1e-3 if instructions else 2e-5) * ref.abs().max()


def test_swap_fuses_groups_and_shares_weights(gen):
    model = tiny("griffin", gen)
    fast = matvec_swapped(model)
    attn, rec = fast.blocks[2].temporal_block, fast.blocks[0].temporal_block
    for group in (attn.qkv, rec.in_proj, fast.blocks[0].mlp_block.gate_up):
        assert isinstance(group, MatvecLinear) and group.group
    assert isinstance(attn.proj_final, MatvecLinear) and isinstance(fast.lm_head, MatvecLinear)
    assert isinstance(rec.rg_lru.input_gate, MatvecBlockDiagonal) and isinstance(rec.rg_lru.a_gate, MatvecBlockDiagonal)
    assert fast.blocks[0].mlp_block.gate_up.weight0 is model.blocks[0].mlp_block.gate_proj.weight  # no copy
    assert rec.rg_lru.a_gate.w is model.blocks[0].temporal_block.rg_lru.a_gate.w
    assert isinstance(model.blocks[2].temporal_block.qkv, LinearGroup)  # the model itself is untouched


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks,inner,outer", [(3, 5, 7), (4, 40, 20), (1, 33, 33)])
def test_block_diagonal_kernel_equals_the_layer(gen, dtype, blocks, inner, outer, int8):
    """The gates' kernel against BlockDiagonalLinear's own batched matmul, odd block shapes (CG-LRU's gates have
    half as many outputs), several rows and leading dimensions: float32 to rounding; bfloat16 within one bfloat16
    rounding of the output (both sum in float32, then round). int8 gates (one scale per block and output column):
    the kernel's int8 path (each output's sum scaled once) against the int8 layer's reference (the weights
    dequantised, then the float32 matmul), alike."""
    layer = BlockDiagonalLinear(blocks * inner, blocks * outer, blocks)
    with torch.no_grad():
        layer.w.copy_(torch.randn(layer.w.shape, generator=gen) / inner**0.5)
        layer.b.copy_(torch.randn(layer.b.shape, generator=gen))
    layer = layer.to(dtype)
    if int8:
        float_w, layer = layer.w, Int8BlockDiagonalLinear.from_float(layer)
        assert layer.w.dtype == torch.int8 and layer.w_scale.shape == (blocks, outer)
        # half a step, plus the float32 rounding of q * scale (of the weight's size): 1e-6 of half a step was
        # too tight for about 1% of random weights
        err = (layer.dequantize() - float_w.float()).abs().max()
        assert err <= layer.w_scale.max() / 2 + float_w.float().abs().max() * 2**-22
    fast = MatvecBlockDiagonal(layer)
    for shape in [(1, 1), (3, 1), (2, 5)]:
        x = torch.randn(*shape, blocks * inner, generator=gen).to(dtype)
        got, ref = fast(x), layer(x)
        assert got.shape == ref.shape and got.dtype == dtype
        if dtype == torch.float32:
            assert (got - ref).abs().max() <= 2e-6 * (1 + ref.abs().max())
        else:
            assert ((got.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-6).all()
    with pytest.raises(ValueError, match=f"input width {blocks * inner + 1}"):
        fast(torch.randn(1, blocks * inner + 1).to(dtype))
    if int8:
        with pytest.raises(ValueError, match="int8 weights need their scales"):
            block_diagonal_cpu(x, layer.w, fast.bias)
        with pytest.raises(ValueError, match=rf"float32 CPU scales \({blocks}, {outer}\)"):
            block_diagonal_cpu(x, layer.w, fast.bias, layer.w_scale[:, :-1])
        with pytest.raises(ValueError, match="float weights have none"):
            block_diagonal_cpu(x, float_w, fast.bias, layer.w_scale)


def test_groups_keep_state_dict_names_and_follow_swaps(gen):
    """The LinearGroup seam registers nothing (checkpoint names unchanged) and calls the owner's current layers."""
    model = tiny("griffin", gen)
    names = list(model.state_dict())
    assert not [n for n in names if ".qkv." in n or ".gate_up." in n or ".in_proj." in n]
    assert "blocks.2.temporal_block.proj_q.weight" in names and "blocks.0.mlp_block.gate_proj.weight" in names
    mlp = model.blocks[0].mlp_block
    x = torch.randn(2, 3, 16, generator=gen)
    doubled = torch.nn.Linear(16, mlp.up_proj.out_features)
    with torch.no_grad():
        doubled.weight.copy_(2 * mlp.up_proj.weight)
        doubled.bias.copy_(2 * mlp.up_proj.bias)
    expected = 2 * mlp.up_proj(x)
    mlp.up_proj = doubled
    assert torch.allclose(mlp.gate_up(x)[1], expected, atol=1e-6)


def test_compiled_matvec_step_equals_eager(gen):
    model = tiny("griffin", gen)
    prompts = torch.randint(0, 32, (2, 5), generator=gen)
    tokens = reference_tokens(model, prompts, 4)
    eager = decode(model, prompts, tokens, matvec=True)
    compiled = decode(model, prompts, tokens, matvec=True, compile=True)
    assert (compiled - eager).abs().max() <= 1e-5 * eager.abs().max()


def test_compiled_int8_gates_equal_eager(gen):
    """Under torch.compile the int8 gates go through the opaque operator ``griffin::block_diagonal`` with their
    scales: the same outputs as the eager kernel."""
    layer = BlockDiagonalLinear(3 * 16, 3 * 16, 3)
    with torch.no_grad():
        layer.w.copy_(torch.randn(layer.w.shape, generator=gen) / 4)
    fast = MatvecBlockDiagonal(Int8BlockDiagonalLinear.from_float(layer))
    x = torch.randn(2, 48, generator=gen)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fast, fullgraph=True)(x), fast(x))


def test_int8_needs_the_cpu_kernel(gen):
    model = quantize_int8(tiny("hawk", gen))
    _, cache = prefill(model, [[1, 2]])
    with pytest.raises(ValueError, match="CPU kernel only, and matvec=False"):
        Decoder(model, cache, matvec=False)
    with pytest.raises(ValueError, match="on meta"):
        quantize_int8(tiny("hawk", gen).to("meta"))
    on_meta = model.to("meta")  # an int8 model moved to a device without the kernel
    with pytest.raises(ValueError, match="CPU kernel only, and the model is on meta"):
        Decoder(on_meta, on_meta.init_cache(1, 8))


def test_the_decode_copy_is_made_once_and_reused(gen):
    """A caller that decodes many times (griffin serve) makes the decode copy once: a Decoder given that copy uses it
    as it is, for float and int8 models alike, and steps equal those of a Decoder that makes its own copy."""
    from griffin.inference.generate import decode_model, is_swapped

    for model in (tiny("griffin", gen), quantize_int8(tiny("griffin", gen), group_size=8)):
        copy = decode_model(model, 4, matvec=True)
        assert is_swapped(copy) and not is_swapped(model) and decode_model(copy, 2) is copy
        prompts = torch.randint(0, model.config.vocab_size, (2, 5), generator=gen)
        _, cache = prefill(model, prompts)
        _, own = prefill(model, prompts)
        reused, fresh = Decoder(copy, cache, matvec=False), Decoder(model, own, matvec=True)
        assert reused.model is copy
        tokens = prompts[:, -1]
        torch.testing.assert_close(reused(tokens), fresh(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["griffin", "mqa"])
def test_int8_bfloat16_step_through_pytorchs_int8_kernel(gen, family):
    """In bfloat16, int8 layers with per-channel scales and an input width divisible by 16 decode through PyTorch's
    own int8 matmul (the others through the numba kernel): the steps are as close to the int8 model's forward pass
    in float32 as its forward pass in bfloat16 (a fixed tolerance on the bfloat16 difference failed 2 seeds in 40:
    6 steps of bfloat16 rounding compound)."""
    from griffin.inference.cpu.linear import Int8PackLinear

    model = quantize_int8(tiny(family, gen, torch.bfloat16))
    swapped = matvec_swapped(model)
    kinds = {type(m).__name__ for m in swapped.modules()}
    assert "Int8PackLinear" in kinds  # input widths 16 and 48
    assert ("MatvecLinear" in kinds) == (family == "griffin")  # the recurrent block's output layer reads 24
    assert all(m.weight.shape[1] % 16 == 0 for m in swapped.modules() if isinstance(m, Int8PackLinear))
    prompts = torch.randint(0, 32, (3, 7), generator=gen)
    tokens = reference_tokens(model, prompts, 6)
    got = decode(model, prompts, tokens)

    def forward(model):
        _, cache = prefill(model, prompts, max_length=20)
        return torch.stack([model(t[:, None], cache=cache)[:, -1].float() for t in tokens])

    with torch.no_grad():
        ref, exact = forward(model), forward(copy.deepcopy(model).float())
    # As close to the float32 computation as the model's own bfloat16 forward, within a factor 3: over 60 seeds the
    # ratio reached 1.9 (the two bfloat16 paths round in different places, and 6 steps compound it).
    assert (got - exact).abs().max() <= 3 * (ref - exact).abs().max()


def test_one_row_decodes_through_the_kernel_by_default(gen):
    """On CPU the default decode copy of one row is the matvec kernel's (its one-row path), float and int8 alike (int8
    without PyTorch's int8 matmul); of several rows, float models go through oneDNN, and bfloat16 int8 layers through
    the kernel up to KERNEL_INT8_ROWS rows on a host with vpdpbusd, else through PyTorch's int8 matmul; an explicit
    prepack=True keeps oneDNN at one row too. Where oneDNN has no bfloat16 path on this CPU (no AVX-512), bfloat16
    models of several rows go through the kernel too."""
    from griffin.inference.cpu.linear import KERNEL_INT8_ROWS
    from griffin.inference.cpu.prepack import PackedLinear, can_prepack
    from griffin.inference.generate import decode_model

    model = tiny("griffin", gen, torch.bfloat16)
    kinds = lambda m: {type(x).__name__ for x in m.modules()}  # noqa: E731
    assert "MatvecLinear" in kinds(decode_model(model, 1)) and "PackedLinear" not in kinds(decode_model(model, 1))
    several = PackedLinear if can_prepack(model.output_weight) else MatvecLinear
    assert isinstance(decode_model(model, 4).lm_head, several)
    assert isinstance(decode_model(copy.deepcopy(model).float(), 4).lm_head, PackedLinear)  # float32: every CPU
    if can_prepack(model.output_weight):
        assert isinstance(decode_model(model, 1, prepack=True).lm_head, PackedLinear)
    int8 = quantize_int8(model)
    assert "Int8PackLinear" not in kinds(decode_model(int8, 1))
    kernel_rows = "int8" in FAST_DOTS
    assert ("Int8PackLinear" in kinds(decode_model(int8, 4))) != kernel_rows
    assert "Int8PackLinear" in kinds(decode_model(int8, KERNEL_INT8_ROWS + 1))
