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

QUICK = dict(steps=2, batch_size=2, eval_every=1, eval_sequences=4, progress=False, tensorboard=False, window=8)


def model_of(family: str) -> CausalLM:
    config = ModelConfig.from_preset(f"{family}-synthetic").replace(vocab_size=16, attention_window=8)
    return CausalLM(config).double()


@pytest.mark.parametrize("family", ["hawk", "griffin"])
def test_each_batch_continues_the_filler_the_stream_took_in(family, gen):
    """After three batches the stream holds the state of its 3 x T filler tokens taken in one sequence, and the step's
    loss (the batch from a copy of that state) is the loss of the batch's targets after all that filler, as one
    sequence: the state a prefix of 3 T tokens leaves, the answer still within the batch (float64)."""
    torch.manual_seed(int(torch.randint(0, 2**20, (1,), generator=gen)))
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    task, model = InductionHeads(seq_len=12), model_of(family)
    source = TaskSource(task, 2, seed=seed, eval_sequences=2, prefix_stream=True)
    for _ in range(3):
        batch = next(source)
        cache = source.initial_cache(model)
    filler = torch.from_numpy(np.concatenate([task.filler(2, 12, np.random.default_rng([seed, 1, i]))
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
