"""The prefix stream (``griffin synth --prefix-stream``): each training sequence continues a stream of the task's
filler, and a step's loss is that of the sequence continuing everything the stream took in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.synth import InductionHeads, SelectiveCopying, TaskSource, train_task
from griffin.synth.compare import compare
from griffin.synth.source import DRAWS, EPISODES

QUICK = dict(steps=2, batch_size=2, eval_every=1, eval_sequences=4, progress=False, tensorboard=False, window=8)


def model_of(family: str) -> CausalLM:
    config = ModelConfig.from_preset(f"{family}-synthetic").replace(vocab_size=16, attention_window=8)
    return CausalLM(config).double()


@pytest.mark.parametrize("family,advance", [("hawk", None), ("griffin", None), ("hawk", 20)])
def test_each_batch_continues_the_filler_the_stream_took_in(family, advance, gen):
    """After three batches the stream holds the state of its 3 x N filler tokens taken in one sequence (N: T, or
    ``stream_advance``), and the step's loss (the batch from a copy of that state) is the loss of the batch's targets
    after all that filler, as one sequence: the state a prefix of 3 N tokens leaves, the answer still within the batch
    (float64)."""
    torch.manual_seed(int(torch.randint(0, 2**20, (1,), generator=gen)))
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    task, model = InductionHeads(seq_len=12), model_of(family)
    source = TaskSource(task, 2, seed=seed, eval_sequences=2, prefix_stream=True, stream_advance=advance)
    for _ in range(3):
        batch = next(source)
        cache = source.initial_cache(model)
    filler = torch.from_numpy(np.concatenate([task.filler(2, advance or 12, np.random.default_rng([seed, 1, i]))
                                              for i in range(3)], 1))
    assert not (filler == InductionHeads.TRIGGER).any()
    whole = model.init_cache(2)
    with torch.no_grad():
        model(filler, cache=whole)
    for name, t in whole.tensors().items():
        torch.testing.assert_close(cache.tensors()[name], t, msg=name)
    loss = model(batch.input_ids, cache=cache, targets=batch.targets)
    ids = torch.cat([filler, batch.input_ids], 1)
    targets = torch.cat([torch.full_like(filler, IGNORE_INDEX), batch.targets], 1)
    torch.testing.assert_close(loss, model(ids, targets=targets))
    loss.backward()  # the gradient stops at the stream's state: it does not require one
    assert all(not t.requires_grad for t in source.state_tensors().values())


def test_without_the_stream_a_batch_starts_from_an_empty_state():
    assert TaskSource(InductionHeads(seq_len=12), 2).initial_cache(model_of("hawk")) is None


def test_what_cannot_continue_a_stream_is_refused(tmp_path):
    with pytest.raises(ValueError, match="MQA's global attention has no fixed-size state"):
        train_task(InductionHeads(seq_len=16), "mqa", tmp_path / "mqa", prefix_stream=True, **QUICK)
    with pytest.raises(ValueError, match="MQA's global attention"):  # before any family trains
        compare(InductionHeads(seq_len=16), tmp_path / "all", prefix_stream=True, **QUICK)
    assert not (tmp_path / "all" / "hawk").exists()
    with pytest.raises(ValueError, match="selective_copying has no filler stream"):
        train_task(SelectiveCopying(seq_len=24, num_data=4), "hawk", tmp_path / "sc", prefix_stream=True, **QUICK)
    plain = TaskSource(InductionHeads(seq_len=12), 2).state_dict()
    with pytest.raises(ValueError, match="trained without the prefix stream, this run with it"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True).load_state_dict(plain)


@pytest.mark.parametrize("family,episodes,advance", [*[(f, e, 12) for f in ("hawk", "griffin") for e in EPISODES],
                                                     ("hawk", "after-filler", 7), ("hawk", "continue", 20)])
def test_recall_rows_ask_for_the_answer_their_stream_took_in(family, episodes, advance, gen):
    """``stream_recall``: the second half of the rows ask, at the end of filler, for the answer after the last trigger
    their stream took in, for 1 to K steps; each row's prediction is that of one sequence: the stream's tokens since
    its document began, then the row's own (float64). Where the next episode writes (``recall_episodes``): into a new
    document; into a new document after filler (meanwhile the row trains on the task's own sequence); or into the
    stream as it is, over the earlier answers. The stream advances T or ``stream_advance`` tokens a step."""
    torch.manual_seed(int(torch.randint(0, 2**20, (1,), generator=gen)))
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    task, model, N = InductionHeads(seq_len=12), model_of(family), advance
    source = TaskSource(task, 4, seed=seed, eval_sequences=2, prefix_stream=True, stream_recall=3,
                        recall_episodes=episodes, stream_advance=advance)
    taken: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    forward = model.forward

    def spy(ids, positions=None, **kwargs):
        if kwargs.get("logits_to_keep") == 1:  # the stream's advance
            taken.append((ids.clone(), None if positions is None else positions.clone()))
        return forward(ids, positions, **kwargs)

    model.forward = spy
    documents = {row: torch.empty(0, dtype=torch.long) for row in range(4)}
    restarts, written_after, most_triggers = 0, 0, 0
    lead = {row: 0 for row in range(4)}  # the steps a row trained on the task's own sequence since its restart
    for _ in range(30):
        batch = next(source)
        cache = source.initial_cache(model)
        ids, positions = taken[-1]
        for row in range(4):
            new = positions is not None and positions[row, 0] == 0
            restarts += int(new and row >= 2)
            lead[row] = 0 if new else lead[row]
            documents[row] = ids[row] if new else torch.cat([documents[row], ids[row]])
        with torch.no_grad():
            logits = model(batch.input_ids, cache=cache)[:, -1]
            for row in (2, 3):
                query, doc = batch.input_ids[row], documents[row]
                triggers = (doc == InductionHeads.TRIGGER).nonzero()
                if (query[:-1] == InductionHeads.TRIGGER).any():  # the task's own sequence, before the write
                    assert episodes == "after-filler" and len(triggers) == 0
                    lead[row] += 1
                    continue
                assert query[-1] == InductionHeads.TRIGGER
                last = int(triggers.max())
                if episodes != "continue":  # written in the step after the filler
                    assert last // N == lead[row]
                written_after += int(last >= N)
                most_triggers = max(most_triggers, len(triggers))
                assert batch.targets[row, -1] == doc[last + 1] and (batch.targets[row, :-1] == IGNORE_INDEX).all()
                whole = model(torch.cat([doc, query])[None])[0, -1]
                torch.testing.assert_close(logits[row], whole)
        for row in (0, 1):  # the task's own sequences, on a stream without a trigger
            assert not (documents[row] == InductionHeads.TRIGGER).any()
            assert (batch.input_ids[row, :-1] == InductionHeads.TRIGGER).sum() == 1
    if episodes == "continue":  # one document, which holds every episode's answer
        assert restarts == 0 and most_triggers >= 3
    else:  # episodes ended and new documents began, each with one answer
        assert restarts >= 2 and most_triggers == 1
    if episodes == "after-filler":  # some triggers came after a step of filler or more (each of ~24 episodes: 1/2)
        assert written_after >= 1


@pytest.mark.parametrize("draw", DRAWS)
def test_recall_episodes_last_the_steps_drawn(draw, gen):
    """``recall_draw``: each episode asks for its answer k steps, k in 1 ... K, uniform (mean (K + 1) / 2) or the
    whole part of a log-uniform draw from [1, K + 1) (P(k >= j) = 1 - ln j / ln(K + 1))."""
    K, seed = 16, int(torch.randint(0, 2**20, (1,), generator=gen))
    source = TaskSource(InductionHeads(seq_len=8), 4, seed=seed, eval_sequences=2, prefix_stream=True,
                        stream_recall=K, recall_draw=draw)
    left, lengths = [0, 0], []
    for _ in range(1000):
        next(source)
        now = source.state_dict()["stream_recall"]["left"][2:]
        lengths += [k + 1 for before, k in zip(left, now, strict=True) if before == 0]
        left = now
    lengths = np.array(lengths)
    assert lengths.min() == 1 and lengths.max() == K
    j = np.arange(1, K + 1)
    expected = (K + 1) / 2 if draw == "uniform" else float((1 - np.log(j) / np.log(K + 1)).sum())
    assert abs(lengths.mean() - expected) < 5 * lengths.std() / np.sqrt(len(lengths))


def test_stream_recall_is_refused_where_it_cannot_recall(tmp_path):
    with pytest.raises(ValueError, match="add --prefix-stream"):
        train_task(InductionHeads(seq_len=16), "hawk", tmp_path / "h", stream_recall=2, **QUICK)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="stream_recall"):
            TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=bad)
    with pytest.raises(ValueError, match="in half of a batch of at least 2"):
        TaskSource(InductionHeads(seq_len=12), 1, prefix_stream=True, stream_recall=2)
    with pytest.raises(ValueError, match="in half of a batch of at least 2"):  # before the run's directory is made
        train_task(InductionHeads(seq_len=16), "hawk", tmp_path / "b1", prefix_stream=True, stream_recall=2,
                   **{**QUICK, "batch_size": 1})
    assert not (tmp_path / "b1").exists()
    saved = TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2).state_dict()
    with pytest.raises(ValueError, match="up to 2 steps back, this run 3"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=3).load_state_dict(saved)
    with pytest.raises(ValueError, match="recall episodes were new-document, their steps log-uniform; this run's "
                                         "continue, log-uniform"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2,
                   recall_episodes="continue").load_state_dict(saved)
    with pytest.raises(ValueError, match="recall_episodes='later': choose one of"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2, recall_episodes="later")
    with pytest.raises(ValueError, match="their steps log-uniform; this run's new-document, uniform"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2,
                   recall_draw="uniform").load_state_dict(saved)
    with pytest.raises(ValueError, match="recall_draw='linear': choose one of"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2, recall_draw="linear")
    with pytest.raises(ValueError, match="advanced 12 tokens a step, this run's 24"):
        TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_recall=2,
                   stream_advance=24).load_state_dict(saved)
    for bad in (1, 2.5, True):
        with pytest.raises(ValueError, match="stream_advance"):
            TaskSource(InductionHeads(seq_len=12), 2, prefix_stream=True, stream_advance=bad)
    with pytest.raises(ValueError, match="how far the prefix stream advances"):
        TaskSource(InductionHeads(seq_len=12), 2, stream_advance=24)
    with pytest.raises(ValueError, match="how far the prefix stream advances: add --prefix-stream"):
        train_task(InductionHeads(seq_len=16), "hawk", tmp_path / "a", stream_advance=32, **QUICK)
    for option in ({"recall_episodes": "continue"}, {"recall_draw": "uniform"}):
        with pytest.raises(ValueError, match="shapes the episodes of --stream-recall"):
            train_task(InductionHeads(seq_len=16), "hawk", tmp_path / "e", prefix_stream=True, **option, **QUICK)


def test_batches_drawn_ahead_are_continued_in_their_own_order(gen):
    """A trainer draws every micro-batch of a step before the first forward (grad_accum): each batch's cache is that
    of its own advance of the stream (its filler, its episodes' writes and restarts), as when drawn one at a time."""
    torch.manual_seed(int(torch.randint(0, 2**20, (1,), generator=gen)))
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    model = model_of("hawk")
    one, ahead = (TaskSource(InductionHeads(seq_len=12), 4, seed=seed, eval_sequences=2, prefix_stream=True,
                             stream_recall=2) for _ in range(2))
    for _ in range(4):  # pairs of micro-batches
        expected = []
        for _ in range(2):
            batch = next(one)
            expected.append((batch, one.initial_cache(model)))
        drawn = [next(ahead), next(ahead)]
        for (batch, cache), got in zip(expected, drawn, strict=True):
            assert torch.equal(batch.input_ids, got.input_ids) and torch.equal(batch.targets, got.targets)
            for name, t in ahead.initial_cache(model).tensors().items():
                torch.testing.assert_close(t, cache.tensors()[name], msg=name)
    with pytest.raises(RuntimeError, match="draw one first"):
        ahead.initial_cache(model)


def test_the_compiled_advance_takes_in_what_the_eager_one_does(gen):
    """``initial_cache(model, compile=True)`` (the trainer's ``--compile``): the stream's advance under torch.compile
    leaves the cache the eager advance does, within float32 rounding, and the same host-side counters, through the
    stream's first advance, later ones, and the new documents recall episodes start (Griffin: every kind of block)."""
    torch.manual_seed(int(torch.randint(0, 2**20, (1,), generator=gen)))
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    model = model_of("griffin").float()
    sources = [TaskSource(InductionHeads(seq_len=12), 4, seed=seed, eval_sequences=2, prefix_stream=True,
                          stream_recall=2, stream_advance=10) for _ in range(2)]
    restarts = 0
    for _ in range(6):
        for source in sources:
            next(source)
        eager, compiled = sources[0].initial_cache(model), sources[1].initial_cache(model, compile=True)
        restarts += not eager.started  # (an advance with positions: it starts new documents)
        assert (compiled.length, compiled.started) == (eager.length, eager.started)
        for name, t in eager.tensors().items():
            torch.testing.assert_close(compiled.tensors()[name], t, msg=name)
    assert restarts >= 1  # a recall episode began a new document: the advance with positions
