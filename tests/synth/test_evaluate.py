"""Accuracy through the chunked, cached forward equals the plain forward's, and its memory stays bounded for Hawk at
lengths far beyond training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from griffin import CausalLM, ModelConfig
from griffin.synth import MQAR, InductionHeads, SelectiveCopying, evaluate_lengths
from griffin.synth.evaluate import (
    Tally,
    answer_logits,
    answer_logits_ref,
    chunk_length,
    default_lengths,
    distance_edges,
    score,
)
from tests.conftest import seed_torch

FAMILIES = ("mqa", "hawk", "griffin")


def tiny_model(family: str, gen: torch.Generator, vocab: int = 16) -> CausalLM:
    seed_torch(gen)
    return CausalLM(ModelConfig.from_preset(f"{family}-tiny", vocab_size=vocab)).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, 1000])  # chunks with a remainder, and one chunk without a cache
def test_chunked_answers_equal_the_plain_forward(family, chunk, gen):
    model = tiny_model(family, gen)
    ids = torch.randint(0, 16, (3, 45), generator=gen)
    targets = torch.where(torch.rand(3, 45, generator=gen) < 0.2, torch.randint(0, 16, (3, 45), generator=gen), -100)
    targets[:, 20:30] = -100  # whole chunks without a target
    targets[1, -1] = 5
    with torch.no_grad():
        want = answer_logits_ref(model, ids, targets)
        got = answer_logits(model, ids, targets, chunk)
    assert got.shape == want.shape == ((targets != -100).sum(), 16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("task", [SelectiveCopying(seq_len=40, num_data=4), InductionHeads(seq_len=33),
                                  MQAR(seq_len=48, vocab_size=64, num_pairs=6)])
def test_scores_at_the_training_length_equal_chunked_scores(task, gen):
    model = tiny_model("griffin", gen, task.vocab_size)
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    batches = [task.sample(4, rng) for _ in range(2)]
    whole, chunked = score(model, batches), score(model, batches, chunk_size=9)
    for key in whole:
        assert whole[key] == pytest.approx(chunked[key], rel=1e-5, abs=1e-6)


def test_tally_counts_answers_and_perfect_sequences():
    targets = torch.full((3, 5), -100)
    targets[0, [1, 3]] = torch.tensor([2, 1])
    targets[1, 4] = 0
    targets[2, [0, 4]] = torch.tensor([1, 1])
    logits = torch.zeros(5, 3)
    logits[torch.arange(5), torch.tensor([2, 1, 0, 1, 2])] = 5.0  # answers in (row, position) order; the last wrong
    tally = Tally()
    tally.add(logits, targets)
    m = tally.metrics()
    assert m["accuracy"] == pytest.approx(4 / 5) and m["perfect"] == pytest.approx(2 / 3)
    want = torch.nn.functional.cross_entropy(logits, torch.tensor([2, 1, 0, 1, 1]))
    assert m["val_loss"] == pytest.approx(float(want), rel=1e-6)


def test_tally_by_distance_splits_the_answers_into_bins():
    targets = torch.full((2, 9), -100)
    targets[0, [4, 8]] = torch.tensor([1, 2])
    targets[1, 8] = 0
    logits = torch.zeros(3, 3)
    logits[torch.arange(3), torch.tensor([1, 0, 0])] = 5.0  # the second answer wrong
    edges = distance_edges(9, 2)
    assert edges.tolist() == [1, 5, 9]
    tally = Tally(edges)
    tally.add(logits, targets, np.array([3, 8, 5]))
    bins = tally.by_distance()
    assert [(b["from"], b["to"], b["answers"]) for b in bins] == [(1, 5, 1), (5, 9, 2)]
    assert bins[0]["accuracy"] == 1.0 and bins[1]["accuracy"] == 0.5
    with pytest.raises(ValueError, match="one distance per target"):
        tally.add(logits, targets)
    with pytest.raises(ValueError, match=r"distance bins=9 must be an integer in \[1, 8\]"):
        distance_edges(9, 9)


@pytest.mark.parametrize("task", [SelectiveCopying(seq_len=40, num_data=4), InductionHeads(seq_len=33)])
def test_accuracy_by_distance_adds_up_to_the_accuracy(task, gen):
    model = tiny_model("hawk", gen, task.vocab_size)
    (r,) = evaluate_lengths(model, task, [64], sequences=24, batch_size=8, chunk_size=16, progress=False,
                            distance_bins=3)
    bins = r["by_distance"]
    assert [b["from"] for b in bins] == [1, 22, 43] and bins[-1]["to"] == 64
    answers = 24 * task.targets_per_sequence
    assert sum(b["answers"] for b in bins) == answers
    correct = sum(b["accuracy"] * b["answers"] for b in bins if b["answers"])
    assert correct == pytest.approx(r["accuracy"] * answers)


def test_hawk_evaluates_far_beyond_training_in_bounded_memory(gen):
    """Every forward pass sees at most one chunk, and the state carried between chunks has the same size at every
    length: memory does not grow with the sequence (the induction-heads extrapolation of Figure 6b)."""
    model = tiny_model("hawk", gen)
    task = InductionHeads(seq_len=32)
    seen: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1])) for b in model.blocks]
    sizes = []
    make_cache = model.init_cache

    def init_cache(batch, max_length=None):
        cache = make_cache(batch, max_length)
        sizes.append(cache.nbytes())
        return cache

    model.init_cache = init_cache
    try:
        results = evaluate_lengths(model, task, [32, 256, 2048], sequences=2, batch_size=2, chunk_size=64,
                                   progress=False)
    finally:
        for h in hooks:
            h.remove()
    assert [r["length"] for r in results] == [32, 256, 2048]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["sequences"] == 2 for r in results)
    assert max(seen) <= 64, "no forward pass over more than one chunk"
    assert len(sizes) == 2 and len(set(sizes)) == 1, "a fixed-size state whatever the length"
    assert chunk_length(model, 2, 1 << 20, 64) == 64, "whatever the length"


def test_global_attention_chunks_shrink_with_the_length(gen):
    model = tiny_model("mqa", gen)
    assert chunk_length(model, 8, 256, 1024) == 1024
    assert chunk_length(model, 8, 1 << 16, 1024) < 1024


def test_default_lengths_double_up_to_the_longest():
    assert default_lengths(InductionHeads()) == [256 << i for i in range(9)]
    assert default_lengths(InductionHeads(), 1024) == [256, 512, 1024]


def test_bad_lengths_are_refused(gen):
    model = tiny_model("hawk", gen)
    with pytest.raises(ValueError, match="seq_len=2 is too short"):
        evaluate_lengths(model, InductionHeads(seq_len=32), [64, 2], progress=False)
    with pytest.raises(ValueError, match="seq_len=20 is too short"):
        evaluate_lengths(model, SelectiveCopying(seq_len=64), [20], progress=False)
    with pytest.raises(ValueError, match="at least one"):
        evaluate_lengths(model, InductionHeads(seq_len=32), [], progress=False)


def test_memory_horizons_are_the_inverse_mean_decay(gen):
    """With input-independent gates (a_gate weights zero, bias beta) every step keeps a_t = exp(-c sigmoid(beta)
    softplus(Lambda)): each channel's horizon is 1 / (c sigmoid(beta) softplus(Lambda)), whatever the tokens."""
    from griffin.layers.rg_lru import RGLRU
    from griffin.synth.evaluate import memory_horizons

    model = tiny_model("griffin", gen)
    lrus = [m for m in model.modules() if isinstance(m, RGLRU)]
    assert len(lrus) == model.config.block_types.count("recurrent") >= 2
    want = []
    with torch.no_grad():
        for lru in lrus:
            lru.a_gate.w.zero_()
            lru.a_gate.b.normal_(generator=gen)
            lru.a_param.normal_(generator=gen)
            rate = lru.c * torch.sigmoid(lru.a_gate.b.reshape(-1).double()) * F.softplus(lru.a_param.double())
            want.append(1.0 / rate)
    got = memory_horizons(model, torch.randint(0, 16, (3, 37), generator=gen))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="no RG-LRU"):
        memory_horizons(tiny_model("mqa", gen), torch.zeros(1, 4, dtype=torch.long))


def test_memory_horizons_grow_as_the_recurrence_gate_closes(gen):
    """Every channel whose recurrence gate closes further (r_t smaller on every token, a_t closer to 1) keeps its
    state longer, in every recurrent block."""
    from griffin.layers.rg_lru import RGLRU
    from griffin.synth.evaluate import memory_horizons

    model = tiny_model("hawk", gen)
    ids = torch.randint(0, 16, (2, 64), generator=gen)
    before = memory_horizons(model, ids)
    with torch.no_grad():
        for lru in (m for m in model.modules() if isinstance(m, RGLRU)):
            lru.a_gate.b.sub_(4.0)  # r_t smaller on every token: a_t closer to 1
    after = memory_horizons(model, ids)
    assert all((a > b).all() for a, b in zip(after, before, strict=True))
