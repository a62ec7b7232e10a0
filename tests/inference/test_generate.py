"""Prefill + decode with bounded caches equals the full forward pass; sampling; snapshots (Section 5)."""

import math

import pytest
import torch

from griffin import Cache, CausalLM, Decoder, ModelConfig, generate, generate_stream, prefill
from griffin.cache import cache_bytes
from griffin.inference.cpu.prepack import PackedLinear, can_prepack
from griffin.inference.generate import sample
from tests.conftest import DEVICES, perturb_

FAMILIES = ["mqa", "hawk", "griffin"]


def tiny(family, gen, **kw):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = CausalLM(ModelConfig.from_preset(f"{family}-tiny", **kw)).eval()
    perturb_(model, gen)
    return model


def incremental_logits(model, ids, splits, max_length):
    """Logits of feeding ``ids`` through a cache in chunks of the given sizes, then one token at a time."""
    cache = model.init_cache(ids.shape[0], max_length)
    outs, t = [], 0
    for n in splits:
        outs.append(model(ids[:, t : t + n], cache=cache))
        t += n
    while t < ids.shape[1]:
        outs.append(model(ids[:, t : t + 1], cache=cache))
        t += 1
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", [3, 17])  # shorter and longer than the window (6): the ring buffer wraps
@pytest.mark.parametrize("variant", [{}, {"conv1d_document_reset": False}, {"complex_lru": True}])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(gen, family, prompt, variant):
    model = tiny(family, gen, **variant)
    ids = torch.randint(0, 32, (2, 40), generator=gen)
    full = model(ids)
    inc, cache = incremental_logits(model, ids, [prompt], max_length=40)
    assert (inc - full).abs().max() <= 1e-4
    assert cache.length == 40 and cache.position.tolist() == [40, 40]
    chunked, _ = incremental_logits(model, ids, [5, 9, 13], max_length=40)  # chunked prefill across the window
    assert (chunked - full).abs().max() <= 1e-4


@torch.no_grad()
def test_chunked_local_attention_over_the_ring_buffer(gen, monkeypatch):
    """Chunks of 2 queries (below the window, 6), so that prefill chunks attend through several query chunks to
    the ring buffer's keys in their wrapped order; against the full forward with one chunk per sequence."""
    model = tiny("griffin", gen)
    ids = torch.randint(0, 32, (3, 40), generator=gen)
    positions = torch.arange(40).repeat(3, 1)
    positions[1, 17:] -= 17  # a second document in row 1
    full = model(ids, positions)
    monkeypatch.setattr("griffin.ops.attention.MIN_CHUNK", 2)
    monkeypatch.setattr("griffin.ops.attention.MAX_CHUNK", 2)
    assert (model(ids, positions) - full).abs().max() <= 1e-5
    cache = model.init_cache(3)
    outs = [model(ids[:, a:b], positions[:, a:b], cache=cache) for a, b in [(0, 5), (5, 14), (14, 27), (27, 40)]]
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", [{}, {"conv1d_document_reset": False}, {"complex_lru": True}])
@torch.no_grad()
def test_mixed_prompt_lengths_in_one_batch(gen, family, variant):
    """Left-padded prompts of several lengths give each row the logits of its prompt alone. Without the Conv1D
    reset at a prompt's start (HF semantics, every HF import), only zeroed padding keeps the Conv1D from reading it."""
    model = tiny(family, gen, **variant)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (1, 9, 4)]
    logits, cache = prefill(model, prompts, max_length=30, chunk_size=4)
    for i, p in enumerate(prompts):
        expected = model(torch.tensor([p]))[0, -1]
        assert (logits[i] - expected).abs().max() <= 1e-4
    # Decoding continues each row as if it were alone.
    nxt = torch.randint(0, 32, (3, 1), generator=gen)
    step = model(nxt, cache=cache)[:, -1]
    for i, p in enumerate(prompts):
        expected = model(torch.tensor([p + [int(nxt[i])]]))[0, -1]
        assert (step[i] - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", [{}, {"attention_document_mask": False}, {"complex_lru": True}])
@torch.no_grad()
def test_document_starts_near_a_chunk_boundary(gen, family, variant):
    """Packed documents fed through the cache in two chunks equal one full forward pass, for a document start at
    every offset around the boundary: the Conv1D inputs carried across it (the last K-1 = 3 tokens of the first
    chunk) must be dropped when a document starts after them."""
    model = tiny(family, gen, **variant)
    T, cut = 24, 12
    ids = torch.randint(0, 32, (2, T), generator=gen)
    for start in range(cut - 5, cut + 2):
        positions = torch.arange(T).repeat(2, 1)
        positions[0, start:] -= start  # row 0: a second document starts at `start`
        positions[1, start - 2 :] -= start - 2  # row 1: two tokens earlier
        full = model(ids, positions)
        cache = model.init_cache(2, T)
        chunks = [model(ids[:, a:b], positions[:, a:b], cache=cache) for a, b in ((0, cut), (cut, T))]
        err = (torch.cat(chunks, 1) - full).abs().max()
        assert err <= 1e-4, f"document start at {start}, chunk boundary at {cut}: {err}"


@pytest.mark.parametrize("family, compile", [(f, False) for f in FAMILIES] + [("mqa", True), ("griffin", True)])
@torch.no_grad()
def test_rows_at_different_positions_in_one_batch(gen, family, compile):
    """Prompts prefilled alone, then inserted into one running batch: the rows sit at different positions (their
    own RoPE angles, ring-buffer slots and global KV slots), a new prompt replaces a row mid-way, and every row
    decodes what it would alone (eager, and the compiled step)."""
    model = tiny(family, gen)
    lengths = [3, 11, 7]
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in lengths]
    batch = model.init_cache(3, 40)
    for row, prompt in enumerate(prompts):
        _, alone = prefill(model, [prompt], max_length=40)
        batch.insert([row], alone)
    assert batch.position.tolist() == lengths
    decoder = Decoder(model, batch, prepack=False, compile=compile)
    seqs = [list(p) for p in prompts]
    for step in range(8):
        if step == 4:  # a new sequence takes row 0 over; the others go on
            seqs[0] = torch.randint(0, 32, (5,), generator=gen).tolist()
            _, alone = prefill(model, [seqs[0]], max_length=40)
            batch.insert([0], alone)
        tokens = torch.randint(0, 32, (3,), generator=gen)
        logits = decoder(tokens)
        for row in range(3):
            seqs[row].append(int(tokens[row]))
            expected = model(torch.tensor([seqs[row]]))[0, -1]
            assert (logits[row] - expected).abs().max() <= 1e-4, (step, row)
    assert batch.position.tolist() == [len(s) for s in seqs]


@torch.no_grad()
def test_generate_greedy_matches_argmax_of_full_forward(gen):
    model = tiny("griffin", gen)
    prompt = torch.randint(0, 32, (7,), generator=gen).tolist()
    out = generate(model, [prompt], max_new_tokens=12, temperature=0)[0]
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt) :]


@torch.no_grad()
def test_seeded_sampling_is_reproducible_and_stops(gen):
    model = tiny("hawk", gen)
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(model, prompts, 20, temperature=1.0, top_k=10, top_p=0.9, seed=123)
    b = generate(model, prompts, 20, temperature=1.0, top_k=10, top_p=0.9, seed=123)
    assert a == b and all(len(r) == 20 for r in a)
    stop = a[0][4]
    c = generate(model, prompts, 20, temperature=1.0, top_k=10, top_p=0.9, seed=123, stop_tokens=[stop])
    assert c[0] == a[0][: a[0].index(stop) + 1]
    streamed = list(generate_stream(model, prompts, 5, temperature=0.7, seed=7))
    assert len(streamed) == 5 and all(len(s) == 2 for s in streamed)


def test_sample_restrictions(gen):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, 1.0, top_p=0.8, generator=g)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.8
    assert {int(sample(logits, 1.0, top_p=0.5, generator=g)) for _ in range(50)} == {0}
    assert int(sample(logits, 0.0)) == 0


@pytest.mark.parametrize("family", ["hawk", "griffin"])
@torch.no_grad()
def test_snapshot_save_load_fork_continue(gen, family, tmp_path):
    model = tiny(family, gen)
    prompt = torch.randint(0, 32, (1, 23), generator=gen)
    _, cache = prefill(model, prompt)
    cache.save(tmp_path / "state.safetensors")
    restored = Cache.load(tmp_path / "state.safetensors", model.config)
    cont = [[5, 6, 7]]
    a = generate(model, cont, 10, temperature=0.8, seed=1, cache=cache.copy())
    b = generate(model, cont, 10, temperature=0.8, seed=1, cache=restored)
    full = generate(model, [prompt[0].tolist() + cont[0]], 10, temperature=0.8, seed=1)
    assert a == b == full
    forked = cache.fork(4)
    outs = generate(model, cont * 4, 6, temperature=0, cache=forked)
    assert all(o == outs[0] for o in outs) and outs[0] == generate(model, cont, 6, temperature=0, cache=cache)[0]


def test_snapshot_from_another_config_is_refused(gen, tmp_path):
    model = tiny("griffin", gen)
    _, cache = prefill(model, [[1, 2, 3]])
    cache.save(tmp_path / "s.safetensors")
    other = ModelConfig.from_preset("griffin-tiny", attention_window=7)
    with pytest.raises(ValueError, match="different model config.*attention_window"):
        Cache.load(tmp_path / "s.safetensors", other)
    with pytest.raises(ValueError, match="different model config"):
        generate(CausalLM(other), [[1]], 2, cache=cache)


def test_cache_memory_is_bounded_for_hawk_and_griffin_and_linear_for_mqa():
    sizes = {}
    for family in FAMILIES:
        cfg = ModelConfig.from_preset(f"{family}-tiny")
        sizes[family] = [cache_bytes(cfg, 2, n) for n in (10, 100, 1000)]
    assert sizes["hawk"][0] == sizes["hawk"][2]
    assert sizes["griffin"][1] == sizes["griffin"][2]  # past the window
    assert sizes["mqa"][2] - sizes["mqa"][1] == 10 * (sizes["mqa"][1] - sizes["mqa"][0])
    # The analytical size matches what the cache tensors actually hold.
    for family in FAMILIES:
        model = CausalLM(ModelConfig.from_preset(f"{family}-tiny"))
        _, cache = prefill(model, [[1] * 50] * 2, max_length=50)
        expected = cache_bytes(model.config, 2, 50, torch.float32)
        # counters (2 x int64 per row) and the slots' step/segment bookkeeping come on top
        bookkeeping = sum(t.numel() * t.element_size() for name, t in cache.tensors().items()
                          if name.split(".")[-1] in ("count", "segment", "position"))
        assert cache.nbytes() - bookkeeping == expected


@pytest.mark.parametrize(
    "kwargs,err,needle",
    [
        (dict(prompts=[]), ValueError, "empty prompt list"),
        (dict(prompts=[[1], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[[1, 99]]), ValueError, "token id 99 outside the vocabulary"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens=-1"),
        (dict(temperature=-0.5), ValueError, "temperature=-0.5"),
        (dict(temperature=math.nan), ValueError, "temperature=nan"),
        (dict(top_p=0.0), ValueError, "top_p=0.0"),
        (dict(top_p=1.5), ValueError, "top_p=1.5"),
        (dict(top_k=-3), ValueError, "top_k=-3"),
        (dict(prompts=torch.zeros(1, 3)), TypeError, "integers"),
    ],
)
def test_bad_generation_input(gen, kwargs, err, needle):
    model = tiny("griffin", gen)
    args = dict(prompts=[[1, 2]], max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(err, match=needle):
        generate(model, args.pop("prompts"), **args)
    assert len(generate(model, [[1, 2]], 3, temperature=0)[0]) == 3  # still usable


def test_prompt_longer_than_global_cache(gen):
    model = tiny("mqa", gen)
    _, cache = prefill(model, [[1, 2, 3]], max_length=5)
    with pytest.raises(ValueError, match="KV cache holds 5 tokens"):
        generate(model, [[4, 5]], 3, cache=cache)
    with pytest.raises(ValueError, match="longer than max_length=2"):
        prefill(model, [[1, 2, 3]], max_length=2)


# The decode path (Decoder / CausalLM.decode_step) against the generic forward-with-cache path -----------------
def decode_both_ways(model, prompts, steps, gen, max_length=None, prepack=False, matvec=False):
    """Prefill ``prompts``, then feed the same random tokens through ``model(tokens[:, None], cache=...)`` and
    through a :class:`Decoder` on a copy of the cache. Returns both logits (steps, B, V) and both caches."""
    _, cache = prefill(model, prompts, max_length=max_length, chunk_size=4)
    copy = cache.copy()
    decoder = Decoder(model, copy, prepack=prepack, matvec=matvec)
    generic, fast = [], []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (len(prompts),), generator=gen)
        generic.append(model(tokens[:, None], cache=cache)[:, -1])
        fast.append(decoder(tokens))
    return torch.stack(generic), torch.stack(fast), cache, copy


def assert_same_cache(a: Cache, b: Cache) -> None:
    assert a.length == b.length
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [{}, {"complex_lru": True}, {"attention_document_mask": False},
                                     {"num_kv_heads": 2, "conv1d_document_reset": False}])
@torch.no_grad()
def test_decoder_is_bitwise_the_forward_path(gen, family, dtype, variant):
    """Same logits and same cache, bit for bit: the decode step does the arithmetic of forward at T = 1."""
    model = tiny(family, gen, **variant).to(dtype)
    batch = int(torch.randint(1, 4, (1,), generator=gen)) * 2 - 1  # 1, 3 or 5 rows
    lengths = torch.randint(1, 12, (batch,), generator=gen).tolist()  # mixed, some past the window (6)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in lengths]
    generic, fast, cache, copy = decode_both_ways(model, prompts, 15, gen, max_length=max(lengths) + 15)
    assert fast.dtype == dtype and fast.shape == (15, batch, 32)
    assert torch.equal(generic, fast)
    assert_same_cache(cache, copy)


@pytest.mark.skipif(not can_prepack(torch.zeros(1, 1)), reason="PyTorch without oneDNN")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_prepacked_decoder_is_the_forward_path_up_to_rounding(gen, family, dtype):
    """The default CPU decoder: oneDNN matmuls from prepacked weights, the rest as above."""
    model = tiny(family, gen).to(dtype)
    if not can_prepack(model.output_weight):
        pytest.skip(f"oneDNN has no {dtype} path on this CPU (bfloat16 needs AVX-512)")
    batch = int(torch.randint(1, 4, (1,), generator=gen)) * 2 - 1
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist()
               for n in torch.randint(1, 12, (batch,), generator=gen).tolist()]
    generic, fast, cache, copy = decode_both_ways(model, prompts, 15, gen, max_length=30, prepack=True)
    if batch > 1:  # the default on CPU for several rows (one row: the matvec kernel, see tests/inference/cpu)
        assert isinstance(Decoder(model, copy).model.lm_head, PackedLinear)
    # float32: a few 1e-6 after 15 steps; bfloat16: a few ulps of logits below 4 (at GRIFFIN_TEST_SEED=1925390895 two
    # of 2,400 logits differed by 0.075, five ulps, after 15 steps of two matmul orders compounding)
    tol = 2e-5 if dtype == torch.float32 else 8e-2
    torch.testing.assert_close(fast, generic, atol=tol, rtol=tol)
    for name, t in cache.tensors().items():
        torch.testing.assert_close(copy.tensors()[name], t, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_decoder_equals_full_forward(gen, family, device):
    model = tiny(family, gen).to(device)
    ids = torch.randint(0, 32, (3, 30), generator=gen).to(device)
    full = model(ids)
    logits, cache = prefill(model, ids[:, :4], max_length=30)
    decoder = Decoder(model, cache)
    steps = [logits] + [decoder(ids[:, t]) for t in range(4, 29)]  # wraps the ring buffer (window 6) 4 times
    assert (torch.stack(steps, 1) - full[:, 3:29]).abs().max() <= 1e-4
    assert cache.length == 29 and cache.position.tolist() == [29] * 3


@torch.no_grad()
def test_decoder_updates_the_cache_in_place_and_snapshots_stay_intact(gen, tmp_path):
    model = tiny("griffin", gen)
    _, cache = prefill(model, torch.randint(0, 32, (2, 9), generator=gen))
    storage = {k: v.data_ptr() for k, v in cache.tensors().items()}
    snapshot = cache.copy()
    before = {k: v.clone() for k, v in snapshot.tensors().items()}
    decoder = Decoder(model, cache, prepack=False)
    tokens = torch.randint(0, 32, (2, 8), generator=gen)
    for t in range(4):
        decoder(tokens[:, t])
    assert {k: v.data_ptr() for k, v in cache.tensors().items()} == storage  # updated in place
    assert all(torch.equal(v, before[k]) for k, v in snapshot.tensors().items())  # the copy did not move
    # save / load / fork mid-decode, then continue: every continuation is the same
    cache.save(tmp_path / "mid.safetensors")
    restored = Cache.load(tmp_path / "mid.safetensors", model.config)
    forked = cache.fork(3, row=1)
    outs = [Decoder(model, c, prepack=False) for c in (cache, restored, forked)]
    for t in range(4, 8):
        a, b, c = (d(tokens[:, t] if i < 2 else tokens[1:, t].expand(3)) for i, d in enumerate(outs))
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a[1:].expand(3, -1), atol=1e-5, rtol=1e-5)  # other batch, other tiling
    # the snapshot replayed through the generic path gives what the decoder gave
    for t in range(8):
        expected = model(tokens[:, t : t + 1], cache=snapshot)[:, -1]
    assert torch.equal(expected, a)


@torch.no_grad()
def test_decoder_follows_a_cache_advanced_by_forward(gen):
    """Mixing decoder steps with chunks through forward: the decoder re-derives its device state."""
    model = tiny("griffin", gen)
    ids = torch.randint(0, 32, (2, 26), generator=gen)
    full = model(ids)
    _, cache = prefill(model, ids[:, :3])
    decoder = Decoder(model, cache)
    out = [decoder(ids[:, 3]), model(ids[:, 4:11], cache=cache)[:, -1], decoder(ids[:, 11])]
    expected = full[:, [3, 10, 11]]
    assert (torch.stack(out, 1) - expected).abs().max() <= 1e-4


def test_decoder_checks_once(gen):
    model = tiny("mqa", gen)
    with pytest.raises(ValueError, match="prefill at least one token per row"):
        Decoder(model, model.init_cache(2, 10))
    _, cache = prefill(model, [[1, 2], [3, 4]], max_length=3)
    decoder = Decoder(model, cache)
    with pytest.raises(ValueError, match=r"must be a \(2,\) int64 tensor"):
        decoder(torch.tensor([1, 2, 3]))
    decoder(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="KV cache holds 3 tokens, all used"):
        decoder(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="different model config"):
        Decoder(tiny("griffin", gen), cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_compiled_decoder_matches_eager(gen, family, device):
    """``compile=True`` (torch.compile of the decode step; on CUDA replayed as a CUDA graph): the same tokens,
    logits within 1e-5."""
    model = tiny(family, gen).to(device)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (2, 9, 5)]
    logits, eager_cache = prefill(model, prompts, max_length=40)
    compiled_cache = eager_cache.copy()
    eager, compiled = Decoder(model, eager_cache, prepack=False), Decoder(model, compiled_cache, compile=True)
    for _ in range(20):
        tokens = logits.argmax(-1)
        logits = eager(tokens)
        assert (compiled(tokens) - logits).abs().max() <= 1e-5
    assert eager_cache.length == compiled_cache.length
    for name, t in eager_cache.tensors().items():
        torch.testing.assert_close(compiled_cache.tensors()[name], t, atol=1e-5, rtol=1e-5, msg=name)
    streamed = generate(model, prompts, 12, temperature=0, max_length=40, compile=True)
    assert streamed == generate(model, prompts, 12, temperature=0, max_length=40)
