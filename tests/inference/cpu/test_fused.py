"""The fused decode step (griffin.inference.cpu.fused): each residual block of the CPU decode copy runs its element-wise
work through griffin.inference.cpu.block_step, and equals the same copy without the fusion; every other input goes
through the block as it is (Section 5)."""

import copy

import pytest
import torch

import griffin.inference.cpu.fused as fused_step
from griffin import Decoder, prefill
from griffin.inference.cpu.fused import FusedResidualBlock, FusedResidualBlocks, fused_step_swapped
from griffin.inference.cpu.linear import matvec_swapped
from griffin.inference.generate import decode_model
from griffin.model import ResidualBlock
from griffin.quantize import quantize_int8
from tests.inference.cpu.test_linear import tiny

FAMILIES = ["mqa", "hawk", "griffin"]


def unfused_copy(model, batch):
    """The decode copy without the fusion: the matvec kernel at one row and for int8, oneDNN otherwise."""
    return decode_model(model, batch, fuse=False)


@torch.no_grad()
def steps_of(model, prompts, tokens):
    _, cache = prefill(model, prompts, max_length=prompts.shape[1] + len(tokens) + 1)
    decoder = Decoder(model, cache)
    return torch.stack([decoder(t) for t in tokens]).float(), cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_step_equals_the_unfused_copy(gen, family, dtype, batch):
    """Logits and caches over 6 steps. float32: to float32 rounding. bfloat16 (and int8 weights with bfloat16
    activations): the kernels round where the model rounds, so most steps are bit for bit; an element that rounds
    the other way (the gates' sums in another order) is carried by the later layers, so the logits stay within 2% of
    their range (over 40 seeds per family the largest gap was 0.9%; a wrong gate or state moves them by O(1))."""
    int8 = dtype == "int8"
    model = tiny(family, gen, torch.bfloat16 if int8 else dtype)
    model = quantize_int8(model) if int8 else model
    prompts = torch.randint(0, 32, (batch, 5), generator=gen)
    tokens = list(torch.randint(0, 32, (6, batch), generator=gen))
    fused = decode_model(model, batch)
    assert all(isinstance(b, FusedResidualBlock) for b in fused.blocks)
    got, got_cache = steps_of(fused, prompts, tokens)
    want, want_cache = steps_of(unfused_copy(model, batch), prompts, tokens)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert (got - want).abs().max() <= tol * scale
    for name, t in want_cache.tensors().items():
        torch.testing.assert_close(got_cache.tensors()[name].float(), t.float(), rtol=tol, atol=tol * scale, msg=name)


def test_the_swap_shares_the_blocks_modules(gen):
    model = tiny("griffin", gen)
    fast = decode_model(model, 1)
    for block, original in zip(fast.blocks, model.blocks, strict=True):
        assert isinstance(block, FusedResidualBlock) and isinstance(original, ResidualBlock)  # the model is untouched
        assert block.channel_pre_norm.scale is original.channel_pre_norm.scale
    unfused = matvec_swapped(model)
    assert fused_step_swapped(copy.deepcopy(unfused)).state_dict().keys() == unfused.state_dict().keys()  # names
    assert fast.blocks[0].weights is not None and fast.blocks[2].weights is None  # recurrent / local attention
    assert decode_model(fast, 1) is fast  # already a decode copy


@pytest.mark.parametrize("family", ["mqa", "griffin"])
@torch.no_grad()
def test_every_block_takes_its_kernel_at_a_decode_step(gen, family, monkeypatch):
    """Recurrent and attention blocks (global and local) alike: a step calls the temporal block's kernel once per
    block, and never the block's own forward."""
    calls = {"attention": 0, "recurrent": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fused_step, "attention_step", counted("attention", fused_step.attention_step))
    monkeypatch.setattr(fused_step, "recurrent_step", counted("recurrent", fused_step.recurrent_step))
    model = tiny(family, gen)  # float32: oneDNN's matmuls at 2 rows on every CPU, so the kernels run one by one
    fused = decode_model(model, 2)
    _, cache = prefill(fused, torch.randint(0, 32, (2, 5), generator=gen), max_length=9)
    for block in fused.blocks:
        monkeypatch.setattr(block.reference[0], "forward", None)  # a step that fell back would call it and fail
    decoder = Decoder(fused, cache)
    for token in torch.randint(0, 32, (3, 2), generator=gen):
        decoder(token)
    kinds = [b.block_type for b in model.blocks]
    assert calls["attention"] == 3 * sum(k != "recurrent" for k in kinds)
    assert calls["recurrent"] == 3 * kinds.count("recurrent")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_stack_step_equals_the_kernel_by_kernel_step(gen, family, dtype, batch, monkeypatch):
    """Where every block's four projections are matvec swaps (the decode copy at one row; at 3 rows the matvec copy,
    which the decoder makes for int8 models), a step runs the whole stack in one call
    (griffin.inference.cpu.block_step.stack_step: per block the same kernels around its four matmuls in one parallel
    region; recurrent only, attention only with a global cache, and both with a local ring of 6 slots that wraps after
    the 9-token prompt): once per step, and the logits and caches of 6 steps equal those of the same copy calling the
    kernels one by one. LLVM may vectorise a kernel's sums differently inside the one call, so float32 agrees to its
    rounding. In bfloat16 and int8 the kernels round where the model rounds: at least 95% of the logits' and float
    caches' entries are the same bits, the rest within the tolerance of :func:`test_fused_step_equals_the_unfused_copy`
    (a float32 difference can flip a bfloat16 rounding; a rounding left out of the one call, which that tolerance alone
    lets through, changes most entries: mutation ``decode-block-row-rounding``)."""
    int8 = dtype == "int8"
    model = tiny(family, gen, torch.bfloat16 if int8 else dtype)
    model = quantize_int8(model) if int8 else model

    def copy_of():
        copy = decode_model(model, 1) if batch == 1 else fused_step_swapped(matvec_swapped(model, int8pack=False))
        assert isinstance(copy.blocks, FusedResidualBlocks) and all(b.one_call is not None for b in copy.blocks)
        return copy

    prompts = torch.randint(0, 32, (batch, 9), generator=gen)
    tokens = list(torch.randint(0, 32, (6, batch), generator=gen))
    one_by_one = copy_of()
    for block in one_by_one.blocks:
        block.one_call = None
    want, want_cache = steps_of(one_by_one, prompts, tokens)
    calls = {"stack": 0}

    def counted(*args, **kwargs):
        calls["stack"] += 1
        return stack_step(*args, **kwargs)

    stack_step = fused_step.stack_step
    monkeypatch.setattr(fused_step, "stack_step", counted)
    for name in ("rms_norm_step", "recurrent_step", "attention_step", "gelu_product_step"):
        monkeypatch.setattr(fused_step, name, None)  # a step that fell back to the kernels one by one would fail
    got, got_cache = steps_of(copy_of(), prompts, tokens)
    assert calls["stack"] == len(tokens)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert (got - want).abs().max() <= tol * scale
    for name, t in want_cache.tensors().items():
        torch.testing.assert_close(got_cache.tensors()[name].float(), t.float(), rtol=tol, atol=tol * scale, msg=name)
    if dtype != torch.float32:
        pairs = [(got, want)] + [(got_cache.tensors()[n], t) for n, t in want_cache.tensors().items()
                                 if t.is_floating_point()]
        same = sum((g == w).sum().item() for g, w in pairs) / sum(w.numel() for _, w in pairs)
        assert same >= 0.95, f"{same:.1%} of the entries bit for bit"


@pytest.mark.parametrize("variant", ["complex_lru", "float64"])
@torch.no_grad()
def test_blocks_the_kernels_cannot_read_go_through_the_block(gen, variant):
    """The CG-LRU (Appendix B): its recurrent block runs as it is, the norms and MLP are still fused. A float64 model:
    every block runs as it is."""
    if variant == "complex_lru":
        model = tiny("hawk", gen, complex_lru=True)
    else:
        model = tiny("hawk", gen, torch.float64)
    fast = decode_model(model, 1)
    assert all(isinstance(b, FusedResidualBlock) and b.weights is None for b in fast.blocks)
    assert all(b.fusable == (variant != "float64") for b in fast.blocks)
    prompts = torch.randint(0, 32, (1, 5), generator=gen)
    tokens = list(torch.randint(0, 32, (4, 1), generator=gen))
    got, _ = steps_of(fast, prompts, tokens)
    want, _ = steps_of(unfused_copy(model, 1), prompts, tokens)
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()


@torch.no_grad()
def test_other_inputs_go_through_the_block_as_it_is(gen):
    """A prompt, a document start inside a chunk, a cache-less forward: the fused copy computes exactly what the
    unfused one does (same modules, same kernels)."""
    model = tiny("griffin", gen)
    unfused = matvec_swapped(model)
    fused = fused_step_swapped(matvec_swapped(model))
    ids = torch.randint(0, 32, (2, 7), generator=gen)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(fused(ids), unfused(ids))
    caches = [m.init_cache(2, 16) for m in (fused, unfused)]
    assert torch.equal(fused(ids, positions, cache=caches[0]), unfused(ids, positions, cache=caches[1]))
    one = ids[:, :1]  # a first token: a document start, which the fused step leaves to the block
    caches = [m.init_cache(2, 16) for m in (fused, unfused)]
    assert torch.equal(fused(one, cache=caches[0]), unfused(one, cache=caches[1]))


def test_autograd_goes_through_the_block(gen):
    """With autograd on, a one-token step with a cache runs the block itself (the kernels keep no graph)."""
    model = tiny("hawk", gen)
    fused, unfused = fused_step_swapped(copy.deepcopy(model)), copy.deepcopy(model)
    caches = [prefill(m, [[1, 2, 3]], max_length=8)[1] for m in (fused, unfused)]
    got, want = (m(torch.tensor([[4]]), cache=c) for m, c in zip((fused, unfused), caches, strict=True))
    assert got.requires_grad and torch.equal(got, want)


@torch.no_grad()
def test_stack_step_follows_a_cache_whose_tensors_were_replaced(gen):
    """The stack views its cache's tensors, prepared once: a cache tensor replaced by another (equal) one is read and
    updated from then on, not the old one (the cache's tensors after the steps equal those of a run that replaced
    nothing)."""
    model = tiny("griffin", gen, torch.bfloat16)
    prompts = torch.randint(0, 32, (1, 5), generator=gen)
    tokens = list(torch.randint(0, 32, (4, 1), generator=gen))
    runs = []
    for replace in (True, False):
        copy = decode_model(model, 1)
        _, cache = prefill(copy, prompts, max_length=16)
        decoder = Decoder(copy, cache)
        logits = [decoder(t) for t in tokens[:2]]
        if replace:
            cache.blocks[0].h = cache.blocks[0].h.clone()
            cache.blocks[2].k = cache.blocks[2].k.clone()
        logits += [decoder(t) for t in tokens[2:]]
        runs.append((torch.stack(logits), cache))
    (got, got_cache), (want, want_cache) = runs
    assert torch.equal(got, want)
    for name, t in want_cache.tensors().items():
        assert torch.equal(got_cache.tensors()[name], t), name


@torch.no_grad()
def test_a_new_view_of_the_same_cache_reuses_the_stack(gen):
    """griffin serve steps a new view of its cache (its first rows) at every step: where the view's tensors lie where
    the last step's did, the stack prepared then is used again (not prepared at every step); a view of fewer rows gets
    its own."""
    model = tiny("griffin", gen, torch.bfloat16)
    copy = fused_step_swapped(matvec_swapped(model, int8pack=False))  # (one call per block at two rows)
    _, cache = prefill(copy, torch.randint(0, 32, (2, 5), generator=gen), max_length=16)
    stacks = []
    for rows in (2, 2, 1):
        view = cache.map(lambda t, rows=rows: t[:rows])
        view.started = True
        stacks.append(copy.blocks._stack_for(view, rows))
    assert stacks[0] is stacks[1] and stacks[2] is not stacks[1] and stacks[2].batch_size == 1


@torch.no_grad()
def test_stack_step_with_a_full_global_cache_writes_nothing(gen):
    """A global attention cache with no slot left stops the stack's step with a clear error before any block has
    written its cache (not after the blocks before it)."""
    model = tiny("mqa", gen, torch.bfloat16)
    copy = decode_model(model, 1)
    _, cache = prefill(copy, torch.randint(0, 32, (1, 5), generator=gen), max_length=8)
    last = cache.blocks[-1]
    last.count.fill_(last.k.shape[1])  # the last block's cache full
    before = {name: t.clone() for name, t in cache.tensors().items()}
    ctx = copy.context(torch.zeros(1, 1, dtype=torch.long), None, cache)
    x = torch.randn(1, 1, model.config.width, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="full"):
        copy.blocks(x, ctx, cache)
    for name, t in cache.tensors().items():
        assert torch.equal(t, before[name]), name


@torch.no_grad()
def test_stack_step_rejects_rows_and_tokens_that_do_not_fit(gen):
    """stack_step called with rows of another shape or dtype than its stack's, or without the tokens' document ids
    where it has attention blocks: a ValueError naming them, before any cache is written."""
    model = tiny("griffin", gen, torch.bfloat16)
    copy = decode_model(model, 1)
    _, cache = prefill(copy, torch.randint(0, 32, (1, 5), generator=gen), max_length=8)
    stack = copy.blocks._stack_for(cache, 1)
    ctx = copy.context(torch.zeros(1, 1, dtype=torch.long), None, cache)
    before = {name: t.clone() for name, t in cache.tensors().items()}
    width = model.config.width
    for x, segments, match in ((torch.zeros(2, width, dtype=torch.bfloat16), ctx.segments, rf"\(1, {width}\)"),
                               (torch.zeros(1, width), ctx.segments, "bfloat16"),
                               (torch.zeros(1, width, dtype=torch.bfloat16), None, "segments")):
        with pytest.raises(ValueError, match=match):
            fused_step.stack_step(x, stack, ctx.rope, segments, ctx.cache_len)
    for name, t in cache.tensors().items():
        assert torch.equal(t, before[name]), name
