"""The block prefix cache (Section 5): any shared prefix of at least one block hits, down to its last whole block; a
hit gives exactly a cold request's tokens for Hawk, Griffin (window shorter and longer than the block) and MQA; the
state at a block boundary carries the local-attention window; eviction keeps the byte bound, leaves first; the radix
tree's lookup equals the plain reference; bad ``--prefix-block`` values are refused."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from griffin.serve.engine import DEFAULT_PREFIX_BLOCK, Engine, chunk_splits
from griffin.serve.options import ServeConfig, add_serve_arguments, config_from_args
from griffin.serve.prefix_cache import PrefixCache
from griffin.serve.sampling import SamplingParams
from tests.serve.conftest import tiny_model
from tests.serve.test_engine import BYTES, random_prompt

B = 8  # tokens per block in these tests


def diverging(gen: torch.Generator, shared: int, tails: int = 2) -> list[list[int]]:
    """Prompts that share their first ``shared`` tokens, then differ at the next one."""
    common = random_prompt(gen, shared, shared)
    starts = torch.randperm(256, generator=gen)[:tails].tolist()
    return [common + [s] + random_prompt(gen, 2, 12) for s in starts]


def engine(model, **options) -> Engine:
    settings = dict(max_batch=2, prefill_chunk=16, prefix_block=B, max_length=160)
    settings.update(options)
    return Engine(model, BYTES, **settings).start()


@pytest.mark.parametrize("k,r", [(1, 0), (1, 5), (3, 7), (4, 1)])
def test_any_shared_prefix_of_a_block_or_more_hits_down_to_its_last_whole_block(gen, k, r):
    model = tiny_model(gen, "hawk-tiny")
    warm = engine(model)
    try:
        first, second = diverging(gen, k * B + r)
        warm.generate(first, SamplingParams(max_tokens=2, temperature=0))
        computed = warm.metrics.value("griffin_prompt_tokens_computed_total")
        out = warm.generate(second, SamplingParams(max_tokens=2, temperature=0))
        assert out.prefix_hit == k * B
        assert warm.metrics.value("griffin_prompt_tokens_computed_total") - computed == len(second) - k * B
        short = diverging(gen, B - 1)  # less than a block in common: nothing to share
        warm.generate(short[0], SamplingParams(max_tokens=1, temperature=0))
        assert warm.generate(short[1], SamplingParams(max_tokens=1, temperature=0)).prefix_hit == 0
    finally:
        warm.stop()


@pytest.mark.parametrize("preset,overrides", [("hawk-tiny", {}), ("griffin-tiny", {"attention_window": 5}),
                                              ("griffin-tiny", {"attention_window": 21}), ("mqa-tiny", {})],
                         ids=["hawk", "griffin-window-5", "griffin-window-21", "mqa"])
def test_a_block_hit_gives_exactly_a_cold_requests_tokens(gen, preset, overrides):
    """Greedy and seeded requests that share 3-5 blocks with an earlier one: from the cached block state they give
    the tokens of an engine without the cache (which cuts the prompt at the same places)."""
    model = tiny_model(gen, preset, **overrides)
    warm, cold = engine(model), engine(model, prefix_cache_bytes=0)
    try:
        shared = int(torch.randint(3 * B, 6 * B, (1,), generator=gen))
        prompts = diverging(gen, shared, 3)
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        warm.generate(prompts[0], SamplingParams(max_tokens=3, temperature=0))
        for prompt, params in ((prompts[1], SamplingParams(max_tokens=16, temperature=0)),
                               (prompts[2], SamplingParams(max_tokens=16, seed=seed))):
            hit, miss = warm.generate(prompt, params), cold.generate(prompt, params)
            assert hit.prefix_hit == shared // B * B and miss.prefix_hit == 0
            assert hit.choices[0].token_ids == miss.choices[0].token_ids
    finally:
        warm.stop()
        cold.stop()


@pytest.mark.parametrize("window", [5, 21])
def test_the_state_at_a_block_boundary_carries_the_local_attention_window(gen, window):
    """The snapshot after 3 blocks equals, tensor for tensor, a cold prefill of those tokens: the ring buffer holds
    the last ``window`` keys and values, those of earlier blocks included when the window is longer than a block."""
    model = tiny_model(gen, "griffin-tiny", attention_window=window)
    warm = engine(model)
    try:
        prompt = random_prompt(gen, 3 * B + 4, 3 * B + 4)
        warm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
        entry = warm.prefix_cache.lookup(prompt[: 3 * B + 1])
        assert entry is not None and entry.length == 3 * B
        cold = model.init_cache(1)
        with torch.no_grad():
            for start in range(0, 3 * B, B):  # the engine's cuts: every block (prefill_chunk > B)
                model(torch.tensor([prompt[start : start + B]]), torch.arange(start, start + B)[None], cache=cold)
        kv = [b for b, kind in zip(cold.blocks, model.config.block_types, strict=True) if kind == "local_attention"]
        assert kv and all(int(b.count[0]) == 3 * B for b in kv)
        got, want = entry.cache.tensors(), cold.tensors()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    finally:
        warm.stop()


def test_requests_arriving_together_share_the_first_ones_block_states(gen):
    """A request looks the cache up when its prefill begins, not when it arrives: three prompts with a shared
    preamble, queued before the engine runs, prefill the preamble once."""
    model = tiny_model(gen, "hawk-tiny")
    eng = Engine(model, BYTES, max_batch=3, prefill_chunk=16, prefix_block=B)
    prompts = diverging(gen, 5 * B, 3)
    handles = [eng.submit(p, SamplingParams(max_tokens=2, temperature=0)) for p in prompts]
    eng.start()
    try:
        for h in handles:
            list(h)
        assert [h.prefix_hit for h in handles] == [0, 5 * B, 5 * B]
    finally:
        eng.stop()


def test_chunks_are_cut_at_every_block_from_any_cached_anchor():
    length, anchors = 45, sorted({45, 13, *range(B, 45, B)})
    cold = chunk_splits(length, 0, anchors, 16)
    assert cold == [8, 13, 16, 24, 32, 40, 45]
    for start in anchors:
        assert chunk_splits(length, start, anchors, 16) == [p for p in cold if p > start]
    assert chunk_splits(length, 0, anchors, 3) == [3, 6, 8, 11, 13, 16, 19, 22, 24, 27, 30, 32, 35, 38, 40, 43, 45]


# The radix tree -------------------------------------------------------------------------------------------------------
def one_state(gen: torch.Generator):
    model = tiny_model(gen, "hawk-tiny")
    one, logits = model.init_cache(1), torch.zeros(256)
    return one, logits, one.nbytes() + logits.numel() * 4


def test_eviction_keeps_the_byte_bound_and_takes_leaves_first(gen):
    """A shared preamble (states at its blocks: a chain ending in a branch point) then many continuations: the bytes
    never exceed the budget, every evicted state is a leaf (no kept state extends it), the preamble's states stay,
    and no node is left without a state below it."""
    one, logits, size = one_state(gen)
    cache = PrefixCache(max_bytes=7 * size + size // 2, block=4)
    preamble = random_prompt(gen, 12, 12)
    for end in (4, 8, 12):
        cache.store(preamble[:end], one, logits)
    kept = {id(e) for _, _, e in cache.entries()}
    for _ in range(30):
        rest = random_prompt(gen, 1, 10)
        for end in [*range(4, len(rest), 4), len(rest)]:
            before = {id(e): p for _, p, e in cache.entries()}
            cache.store(preamble + rest[:end], one, logits)
            assert cache.nbytes <= cache.max_bytes and len(cache) <= 7
            after = cache.entries()
            gone = [p for k, p in before.items() if k not in {id(e) for _, _, e in after}]
            for p in gone:  # a leaf: no kept state extends it
                assert not any(len(q) > len(p) and q[: len(p)] == p for _, q, _ in after)
        assert kept <= {id(e) for _, _, e in cache.entries()}  # the branch point and its ancestors stay
    assert cache.evictions > 0
    stack = list(cache.roots.values())
    while stack:
        node = stack.pop()
        assert node.parent is None or not node.empty()
        stack += node.children.values()


@pytest.mark.parametrize("block", [1, 2, 3, 5])
def test_lookup_equals_the_reference_on_random_token_trees(gen, block):
    """Random prompts over a 3-token vocabulary (many shared prefixes), in two namespaces, stored with evictions:
    the tree's lookup finds the state the reference finds, and contains agrees with it."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    one, logits, size = one_state(gen)
    cache = PrefixCache(max_bytes=25 * size, block=block)
    stored: list[tuple[str | None, list[int]]] = []
    for _ in range(60):
        ns = rng.choice([None, "adapter"])
        base = rng.choice(stored)[1] if stored and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        cache.store(seq, one, logits, namespace=ns)
        stored.append((ns, seq))
        assert cache.nbytes <= cache.max_bytes
    for _ in range(300):
        ns, base = rng.choice(stored)
        ns = ns if rng.random() < 0.8 else rng.choice([None, "adapter", "other"])
        query = base[: rng.randint(1, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        ref = cache.lookup_reference(query, namespace=ns)
        got = cache.lookup(query, namespace=ns)
        assert got is ref
        assert cache.contains(query, namespace=ns) == (ref is not None and ref.length == len(query))
    assert cache.evictions > 0 and cache.hits + cache.misses == 300


def test_a_state_is_replaced_not_duplicated_and_namespaces_do_not_meet(gen):
    one, logits, size = one_state(gen)
    cache = PrefixCache(max_bytes=10 * size, block=4)
    cache.store([1, 2, 3, 4, 5], one, logits)
    cache.store([1, 2, 3, 4, 5], one, logits + 1)
    assert len(cache) == 1 and cache.nbytes == size
    assert float(cache.lookup([1, 2, 3, 4, 5, 6]).logits[0]) == 1.0
    assert cache.lookup([1, 2, 3, 4, 5], namespace="a") is None
    cache.store([1, 2, 3, 4], one, logits, namespace="a")
    assert cache.lookup([1, 2, 3, 4, 5], namespace="a").length == 4
    assert cache.lookup([1, 2, 3, 4, 5]).length == 5
    assert (cache.hits, cache.misses, cache.hit_tokens) == (3, 1, 14)


# Options --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -64, 2.5, "64", True])
def test_bad_prefix_block_values_are_refused(gen, bad):
    model = tiny_model(gen, "hawk-tiny")
    with pytest.raises(ValueError, match=f"prefix_block={bad!r}"):
        Engine(model, BYTES, prefix_block=bad)
    with pytest.raises(ValueError, match=r"--prefix-block"):
        ServeConfig("ckpt", prefix_block=bad)


def test_the_prefix_block_flag():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert config_from_args(p.parse_args(["ckpt"])).prefix_block == DEFAULT_PREFIX_BLOCK
    assert config_from_args(p.parse_args(["ckpt", "--prefix-block", "0"])).prefix_block == 0
    with pytest.raises(ValueError, match="--prefix-block -3 must be"):
        config_from_args(p.parse_args(["ckpt", "--prefix-block", "-3"]))
    with pytest.raises(ValueError, match="block=0"):
        PrefixCache(1 << 20, block=0)
