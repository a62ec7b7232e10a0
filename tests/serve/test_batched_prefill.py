"""Prefill of several requests in one forward pass (their one-row caches side by side) gives each request what it
gets alone, for Hawk, Griffin and MQA; requests that share a prefix still wait for its states rather than compute it
side by side; ``Cache.cat`` and ``Cache.select`` are inverse; a bfloat16 model's prefill on a CPU without a bfloat16
matmul multiplies in float32 (:mod:`griffin.inference.cpu.upcast`) and matches the plain bfloat16 model."""

from __future__ import annotations

import copy

import pytest
import torch

from griffin.cache import Cache
from griffin.inference import prefill
from griffin.inference.cpu.upcast import (
    MIN_ROWS,
    UpcastBlockDiagonal,
    UpcastLinear,
    needs_upcast,
    prefill_model,
    upcast_swapped,
)
from griffin.layers.rg_lru import BlockDiagonalLinear
from griffin.serve.engine import Engine
from griffin.serve.sampling import SamplingParams
from tests.serve.conftest import tiny_model
from tests.serve.test_engine import BYTES, random_prompt

B = 8


class Recorder(torch.nn.Module):
    """The engine's prefill model, recording the rows of each forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.rows = model, []

    def forward(self, ids, *args, **kwargs):
        self.rows.append(ids.shape[0])
        return self.model(ids, *args, **kwargs)


@pytest.mark.parametrize("preset,overrides", [("hawk-tiny", {}), ("griffin-tiny", {"attention_window": 5}),
                                              ("mqa-tiny", {})], ids=["hawk", "griffin", "mqa"])
def test_requests_prefilled_together_get_what_each_gets_alone(gen, preset, overrides):
    model = tiny_model(gen, preset, **overrides).double()
    prompts = [random_prompt(gen, 1, 6 * B) for _ in range(7)]
    prompts += [random_prompt(gen, 3 * B, 3 * B) for _ in range(3)]  # whole blocks, all as long
    params = SamplingParams(max_tokens=6, temperature=0)
    together = Engine(model, BYTES, max_batch=len(prompts), prefill_chunk=4 * B, prefix_block=B, max_length=96)
    together.prefill_model = recorder = Recorder(together.prefill_model)
    alone = Engine(model, BYTES, max_batch=1, prefill_chunk=4 * B, prefix_block=B, max_length=96).start()
    try:
        handles = [together.submit(p, params) for p in prompts]
        together.start()
        got = [[u for u in h] for h in handles]
        outs = [[t for u in updates for c in u.choices for t in c.token_ids] for updates in got]
        assert max(recorder.rows) > 1, recorder.rows  # chunks did run side by side
        assert len(recorder.rows) < sum(-(-len(p) // B) for p in prompts)  # fewer passes than chunks
        for prompt, out in zip(prompts, outs, strict=True):
            assert out == alone.generate(prompt, params).choices[0].token_ids
    finally:
        together.stop()
        alone.stop()


def test_requests_sharing_a_prefix_are_not_prefilled_side_by_side(gen):
    """Four requests with a 4-block preamble, queued together with two unrelated ones: the preamble is computed
    once (the others start from its states), while the unrelated ones run beside the first."""
    model = tiny_model(gen, "hawk-tiny")
    eng = Engine(model, BYTES, max_batch=6, prefill_chunk=4 * B, prefix_block=B)
    eng.prefill_model = recorder = Recorder(eng.prefill_model)
    common = random_prompt(gen, 4 * B, 4 * B)
    shared = [common + random_prompt(gen, 1, 5) for _ in range(4)]
    others = [random_prompt(gen, 4 * B + 3, 4 * B + 3) for _ in range(2)]
    handles = [eng.submit(p, SamplingParams(max_tokens=2, temperature=0)) for p in shared[:1] + others + shared[1:]]
    eng.start()
    try:
        for h in handles:
            list(h)
        assert [h.prefix_hit for h in handles] == [0, 0, 0, 4 * B, 4 * B, 4 * B]
        # the first pass: the first shared prompt and the two others, side by side, the followers held back (later
        # passes may run the followers' suffixes beside the first's, from the preamble's states: seed 324969697)
        assert recorder.rows[0] == 3
        assert eng.metrics.value("griffin_prompt_tokens_computed_total") == \
            sum(len(p) for p in shared[:1] + others) + sum(len(p) - 4 * B for p in shared[1:])
    finally:
        eng.stop()


@pytest.mark.parametrize("preset", ["griffin-tiny", "mqa-tiny"])
def test_cat_then_select_gives_back_each_cache(gen, preset):
    model = tiny_model(gen, preset)
    caches = []
    for n in (5, 13, 1):
        _, cache = prefill(model, [random_prompt(gen, n, n)], max_length=32)
        caches.append(cache)
    joined = Cache.cat(caches)
    assert joined.batch_size == 3 and joined.started and joined.length == max(c.length for c in caches)
    for i, cache in enumerate(caches):
        back, want = joined.select([i]).tensors(), cache.tensors()
        assert back.keys() == want.keys()
        for name in want:
            assert torch.equal(back[name], want[name]), name
    if preset == "mqa-tiny":  # a global-attention cache of another size
        with pytest.raises(ValueError, match="max_length"):
            Cache.cat([caches[0], model.init_cache(1, 64)])
    with pytest.raises(ValueError, match="no caches"):
        Cache.cat([])


def test_upcast_layers_match_float64_to_bfloat16_rounding(gen):
    for rows in (1, MIN_ROWS - 1, MIN_ROWS, 3 * MIN_ROWS + 5):
        linear = torch.nn.Linear(24, 40).to(torch.bfloat16)
        gates = BlockDiagonalLinear(24, 24, 4).to(torch.bfloat16)
        x = torch.randn(rows, 24, generator=gen).to(torch.bfloat16)
        for layer, up in ((linear, UpcastLinear(linear.weight, linear.bias)), (gates, UpcastBlockDiagonal(gates))):
            got = up(x)
            if rows < MIN_ROWS:  # short inputs take the layer's own path
                assert torch.equal(got, layer(x))
                continue
            want = copy.deepcopy(layer).double()(x.double())
            assert got.dtype == torch.bfloat16
            # float32 accumulation, then one rounding to bfloat16: within one bfloat16 step of the exact value
            assert ((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-6).all()


def test_the_upcast_copy_shares_the_weights_and_matches_the_bfloat16_model(gen):
    model = tiny_model(gen, "griffin-tiny").to(torch.bfloat16)
    fast = upcast_swapped(model)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in model.parameters()}
    assert any(isinstance(m, UpcastLinear) for m in fast.modules())
    assert any(isinstance(m, UpcastBlockDiagonal) for m in fast.modules())
    ids = torch.tensor([random_prompt(gen, 2 * MIN_ROWS, 2 * MIN_ROWS)])
    with torch.no_grad():
        want = model.float()(ids).double()
        model.to(torch.bfloat16)
        got, plain = fast(ids).double(), model(ids).double()
    # both bfloat16 forwards sit as close to the float32 model as each other
    assert (got - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-2
    assert needs_upcast(model) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert prefill_model(model.float()) is model  # float32: nothing to do
