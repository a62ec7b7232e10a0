"""The synthetic tasks' generators follow their specs exactly (Section 6.2, Appendix H, Zoology's MQAR), are
reproducible from a seed, and refuse what they cannot generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from griffin.cli import main
from griffin.synth import MQAR, InductionHeads, SelectiveCopying, TaskSource, make_task, task_from_dict
from griffin.synth.evaluate import held_out

IGNORE = -100


def rng_from(gen: torch.Generator) -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))


def test_selective_copying_follows_the_spec(gen):
    task = SelectiveCopying()
    assert (task.seq_len, task.vocab_size, task.num_data) == (1024, 16, 16)
    batch = task.sample(64, rng_from(gen))
    ids, targets = batch.input_ids.numpy(), batch.targets.numpy()
    assert ids.shape == targets.shape == batch.positions.shape == (64, 1024) and ids.dtype == np.int64
    assert (batch.positions.numpy() == np.arange(1024)).all()
    head, tail = ids[:, :1008], ids[:, 1008:]
    assert (tail == 15).all(), "16 markers end every sequence"
    assert ((head >= 0) & (head <= 14)).all(), "no marker among the first 1008 tokens"
    for row, target in zip(head, targets, strict=True):
        where = np.flatnonzero(row != 0)
        assert len(where) == 16, "exactly 16 data tokens, at distinct positions"
        assert ((row[where] >= 1) & (row[where] <= 14)).all()
        assert (target[:1008] == IGNORE).all()
        assert (target[1008:] == row[where]).all(), "the k-th marker's target is the k-th data token"
    # the data positions are spread over the whole prefix and the data tokens over 1..14
    assert ids[:, :100].any() and ids[:, 900:1008].any()
    assert set(np.unique(targets[:, 1008:])) == set(range(1, 15))


def test_induction_heads_follows_the_spec(gen):
    task = InductionHeads()
    assert (task.seq_len, task.vocab_size) == (256, 16)
    batch = task.sample(256, rng_from(gen))
    ids, targets = batch.input_ids.numpy(), batch.targets.numpy()
    assert ids.shape == (256, 256) and ids.min() >= 0 and ids.max() <= 15
    firsts = []
    for row, target in zip(ids, targets, strict=True):
        triggers = np.flatnonzero(row == 0)
        assert len(triggers) == 2 and triggers[1] == 255, "one trigger at p <= T-3, and one as the last token"
        p = triggers[0]
        assert p <= 253
        firsts.append(p)
        assert 1 <= row[p + 1] <= 15
        assert (target[:255] == IGNORE).all() and target[255] == row[p + 1]
    assert min(firsts) < 32 and max(firsts) > 220, "the first trigger is placed anywhere"
    assert set(np.unique(ids[ids > 0])) == set(range(1, 16))


def test_induction_heads_smallest_sequence(gen):
    batch = InductionHeads(seq_len=3).sample(16, rng_from(gen))
    assert (batch.input_ids[:, 0] == 0).all() and (batch.input_ids[:, 2] == 0).all()
    assert (batch.targets[:, 2] == batch.input_ids[:, 1]).all()


def test_mqar_follows_the_spec(gen):
    task = MQAR()
    assert (task.seq_len, task.vocab_size, task.num_pairs, task.power_a) == (256, 8192, 64, 0.01)
    task = MQAR(seq_len=128, vocab_size=256, num_pairs=16)
    batch = task.sample(64, rng_from(gen))
    ids, targets = batch.input_ids.numpy(), batch.targets.numpy()
    P, half = 16, 128
    assert ids.min() >= 0 and ids.max() < 256
    for row, target in zip(ids, targets, strict=True):
        keys, values = row[0 : 2 * P : 2], row[1 : 2 * P : 2]
        assert len(set(keys)) == P and ((keys >= 1) & (keys < half)).all()
        assert len(set(values)) == P and ((values >= half) & (values < 256)).all()
        assert (target[: 2 * P] == IGNORE).all()
        queries = np.flatnonzero(target != IGNORE)
        assert len(queries) == P and ((queries - 2 * P) % 2 == 0).all() and queries.max() <= 126
        value_of = dict(zip(keys, values, strict=True))
        assert sorted(row[queries]) == sorted(keys), "each key is queried exactly once"
        assert all(target[q] == value_of[row[q]] for q in queries), "a query's target is its key's value"


def test_mqar_query_gaps_follow_zoologys_sampler(gen):
    """Slot occupancy of the Gumbel-top-k draw against numpy's sequential choice(replace=False, p) (Zoology's)."""
    task = MQAR(seq_len=96, vocab_size=64, num_pairs=8, power_a=0.3)
    rng, n = rng_from(gen), 3000
    space = (96 - 16) // 2
    ours = np.zeros(space)
    targets = task.sample(n, rng).targets.numpy()
    slots = (np.flatnonzero(targets.reshape(-1) != IGNORE) % 96 - 16) // 2
    np.add.at(ours, slots, 1)
    p = 0.3 * np.arange(1, space + 1) ** (0.3 - 1)
    p /= p.sum()
    ref = np.zeros(space)
    for _ in range(n):
        np.add.at(ref, rng.choice(space, size=8, replace=False, p=p), 1)
    ours, ref = ours / n, ref / n  # inclusion probability of each slot
    sigma = np.sqrt(2 * ref.clip(1e-3, 1 - 1e-3) * (1 - ref.clip(1e-3, 1 - 1e-3)) / n)
    assert (np.abs(ours - ref) < 5 * sigma).all(), np.abs(ours - ref) / sigma
    assert ref[0] > 2 * ref[-1], "the power law favours early slots"


@pytest.mark.parametrize("name", ["selective_copying", "induction_heads", "mqar"])
def test_generators_are_reproducible_from_a_seed(name, gen):
    task = make_task(name, **({"vocab_size": 512} if name == "mqar" else {}))
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    a = task.sample(4, np.random.default_rng(seed))
    b = task.sample(4, np.random.default_rng(seed))
    c = task.sample(4, np.random.default_rng(seed + 1))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.input_ids, c.input_ids)
    # the training stream: batch i depends on (seed, i) only, and a restored state continues it exactly
    source = TaskSource(task, 3, seed=seed, eval_sequences=2)
    stream = [next(source) for _ in range(4)]
    other = TaskSource(task, 3, seed=seed, eval_sequences=2)
    next(other)
    state = other.state_dict()
    resumed = TaskSource(task, 3, seed=seed, eval_sequences=2)
    resumed.load_state_dict(state)
    for want in stream[1:]:
        assert torch.equal(next(resumed).input_ids, want.input_ids)
    # the held-out set is fixed, whatever the training seed, and differs from the training stream
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(source.held_out, other.held_out, strict=True))
    assert not any(torch.equal(h.input_ids[:3], s.input_ids) for h in held_out(task, 3, 3) for s in stream)


def test_task_spec_round_trips():
    for task in (SelectiveCopying(seq_len=64, num_data=4), InductionHeads(vocab_size=32), MQAR(vocab_size=300)):
        assert task_from_dict(task.to_dict()) == task
    assert InductionHeads().with_length(4096) == InductionHeads(seq_len=4096)


def test_a_resumed_source_refuses_another_stream():
    source = TaskSource(InductionHeads(seq_len=16), 2, seed=0, eval_sequences=2)
    other = TaskSource(InductionHeads(seq_len=32), 2, seed=0, eval_sequences=2)
    with pytest.raises(ValueError, match="another task stream.*task"):
        other.load_state_dict(source.state_dict())


@pytest.mark.parametrize("make, match", [
    (lambda: make_task("copying"), "unknown task 'copying'"),
    (lambda: make_task("induction_heads", num_pairs=3), "unknown parameter 'num_pairs'"),
    (lambda: SelectiveCopying(seq_len=31), "seq_len=31 is too short.*seq_len >= 32"),
    (lambda: SelectiveCopying(vocab_size=2), "vocab_size=2 is too small"),
    (lambda: SelectiveCopying(num_data=0), "num_data=0 must be a positive integer"),
    (lambda: InductionHeads(seq_len=2), "seq_len=2 is too short"),
    (lambda: InductionHeads(vocab_size=2), "vocab_size=2 is too small"),
    (lambda: MQAR(seq_len=255), "seq_len=255 is too short.*seq_len >= 256"),
    (lambda: MQAR(vocab_size=129), "vocab_size=129 is too small for num_pairs=64.*vocab_size >= 130"),
    (lambda: MQAR(power_a=0.0), "power_a=0.0 must lie in"),
    (lambda: InductionHeads().with_length(0), "seq_len=0 must be a positive integer"),
    (lambda: InductionHeads().sample(0, np.random.default_rng(0)), "batch_size=0"),
])
def test_bad_tasks_are_refused_clearly(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_tasks_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["synth", "copying", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "invalid choice: 'copying'" in capsys.readouterr().err
    assert main(["synth", "selective-copying", "--out", str(tmp_path), "--seq-len", "20"]) == 2
    assert "seq_len=20 is too short" in capsys.readouterr().err
    assert main(["synth", "mqar", "--out", str(tmp_path), "--vocab-size", "64"]) == 2
    assert "vocab_size=64 is too small" in capsys.readouterr().err
    assert main(["synth", "induction_heads", "--out", str(tmp_path), "--family", "hawk", "--max-steps", "0"]) == 2
    assert "steps=0 must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists(), "nothing ran"


@pytest.mark.parametrize("task", [SelectiveCopying(seq_len=40, num_data=5), InductionHeads(seq_len=30),
                                  MQAR(seq_len=64, vocab_size=40, num_pairs=6)])
def test_sources_point_at_the_token_each_target_copies(task, gen):
    ids, targets = task.generate(9, rng_from(gen))
    rows, cols = (targets != IGNORE).nonzero()
    src = task.sources(ids, targets)
    assert src.shape == rows.shape and (src < cols).all() and (src >= 0).all()
    np.testing.assert_array_equal(ids[rows, src], targets[rows, cols])
    if isinstance(task, InductionHeads):  # right after the first trigger
        assert (ids[rows, src - 1] == InductionHeads.TRIGGER).all()
    if isinstance(task, MQAR):  # a value right after its key, the key the query asks for
        np.testing.assert_array_equal(ids[rows, src - 1], ids[rows, cols])
    if isinstance(task, SelectiveCopying):  # the k-th data token for the k-th marker
        assert (np.diff(src.reshape(9, -1), axis=1) > 0).all()


def test_sources_refuse_sequences_of_another_task(gen):
    task = InductionHeads(seq_len=30)
    ids, targets = task.generate(3, rng_from(gen))
    ids[1, :-1] = 5
    with pytest.raises(ValueError, match="no trigger before the last position"):
        task.sources(ids, targets)
