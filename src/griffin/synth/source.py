"""A task as the trainer's batch source (:class:`griffin.training.source.BatchSource`): fresh sequences every step,
a fixed held-out set for the accuracy curve (Figure 6a), and a position that checkpoints resume exactly.

**The prefix stream** (``prefix_stream``; ``griffin synth --prefix-stream``). Trained on sequences of T tokens, a
recurrent model only ever meets the states that T tokens from an empty state reach; beyond T it meets others, and
fails there (the "unexplored states" of Buitrago Ruiz and Gu, 2025: their State Passing starts each sequence from the
final state of another). Here each row of each batch continues a stream of the task's filler (for induction heads:
random tokens, no trigger), which advances T tokens a step without gradients: the recurrent blocks start every
training sequence from a state that a prefix of any length reached, as an evaluation sequence far longer than T
presents it, while the answer stays within T tokens of its query. The stream's cache is saved in the checkpoints
(``source_state.safetensors``), so that a run resumes exactly."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from griffin.data import Batch
from griffin.model import Cache, CausalLM
from griffin.synth.evaluate import EVAL_SEED, held_out, score
from griffin.synth.tasks import Task


class TaskSource:
    """Batch ``i`` of the training stream is drawn from ``np.random.default_rng([seed, 0, i])``, so the stream is
    reproducible from the seed and resumes from the batch index alone. Every row is one sequence from position 0
    (``whole_rows``)."""

    whole_rows = True

    def __init__(self, task: Task, batch_size: int, seed: int = 0, eval_sequences: int = 256,
                 eval_batch_size: int = 32, eval_seed: int = EVAL_SEED, prefix_stream: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.index = 0
        self.prefix_stream = bool(prefix_stream)
        if self.prefix_stream:
            task.filler(1, 1, np.random.default_rng(0))  # a task without a filler stream is refused here
        self._stream: Cache | None = None
        self._stream_counters: dict[str, Any] = {}  # (length, started) of a resumed stream, until it is made
        self._stream_tensors: dict[str, Tensor] = {}  # its tensors, likewise
        self.vocab_size = task.vocab_size
        self.description = repr(task)
        self.baseline_loss = task.baseline_loss
        self.eval_seed = eval_seed
        self.held_out = held_out(task, eval_sequences, eval_batch_size, eval_seed)
        self.generate_seconds = 0.0  # time spent drawing training batches (it must stay a small part of a step)

    def __iter__(self) -> TaskSource:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        batch = self.task.sample(self.batch_size, np.random.default_rng([self.seed, 0, self.index]))
        self.index += 1
        self.generate_seconds += time.perf_counter() - start
        return batch

    def state_dict(self) -> dict[str, Any]:
        state = {"task": self.task.to_dict(), "seed": self.seed, "batch_size": self.batch_size, "index": self.index}
        if self.prefix_stream:
            stream = self._stream
            state["prefix_stream"] = ({"length": stream.length, "started": stream.started} if stream is not None
                                      else self._stream_counters)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diff = [f"{k}: {state.get(k)!r} in the checkpoint, {mine[k]!r} here" for k in ("task", "seed", "batch_size")
                if state.get(k) != mine[k]]
        if diff:
            raise ValueError("the checkpoint was trained on another task stream: " + "; ".join(diff))
        if not isinstance(state.get("index"), int) or state["index"] < 0:
            raise ValueError(f"the checkpoint's batch index {state.get('index')!r} is not a non-negative integer")
        self.index = state["index"]
        if self.prefix_stream != ("prefix_stream" in state):
            raise ValueError(f"the checkpoint was trained {'with' if 'prefix_stream' in state else 'without'} the "
                             f"prefix stream, this run {'with' if self.prefix_stream else 'without'} it")
        self._stream, self._stream_counters = None, dict(state.get("prefix_stream") or {})

    def state_tensors(self) -> dict[str, Tensor]:
        """The prefix stream's cache (saved beside :meth:`state_dict` in every checkpoint; empty without one)."""
        stream = self._stream
        if stream is None:
            return dict(self._stream_tensors)
        return {name: t.detach().cpu().contiguous() for name, t in stream.tensors().items()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Continue the stream of :meth:`state_tensors` (with :meth:`load_state_dict`'s counters)."""
        self._stream, self._stream_tensors = None, dict(tensors)

    def initial_cache(self, model: CausalLM) -> Cache | None:
        """The cache the rows of the batch just drawn continue: with ``prefix_stream``, a copy of the stream's after it
        advanced ``seq_len`` more filler tokens (drawn from the batch index; no gradients, in the caller's autocast);
        None without (each row starts from an empty state)."""
        if not self.prefix_stream:
            return None
        if self._stream is None:
            self._stream = self._new_stream(model)
        rng = np.random.default_rng([self.seed, 1, self.index - 1])
        tokens = torch.from_numpy(self.task.filler(self.batch_size, self.task.seq_len, rng)).to(model.device)
        with torch.no_grad():
            model(tokens, cache=self._stream, logits_to_keep=1)
        return self._stream.copy()

    def _new_stream(self, model: CausalLM) -> Cache:
        stream = model.init_cache(self.batch_size)
        if stream.max_length is not None:
            raise ValueError(f"--prefix-stream: a {model.config.family} model's global attention has no fixed-size "
                             "state to continue (Hawk and Griffin have one)")
        if self._stream_tensors:
            mine = stream.tensors()
            if set(mine) != set(self._stream_tensors) or any(
                    mine[k].shape != t.shape for k, t in self._stream_tensors.items()):
                raise ValueError("the checkpoint's prefix stream does not fit this model and batch")
            for name, t in self._stream_tensors.items():
                mine[name].copy_(t)
            stream.length = int(self._stream_counters.get("length", 0))
            stream.started = bool(self._stream_counters.get("started", False))
        self._stream_tensors = {}
        return stream

    def evaluate(self, model: CausalLM) -> dict[str, float]:
        """Loss per target, accuracy and fraction of perfect sequences on the fixed held-out set."""
        return score(model, self.held_out)
