"""A task as the trainer's batch source (:class:`griffin.training.source.BatchSource`): fresh sequences every step,
a fixed held-out set for the accuracy curve (Figure 6a), and a position that checkpoints resume exactly."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from griffin.data import Batch
from griffin.model import CausalLM
from griffin.synth.evaluate import EVAL_SEED, held_out, score
from griffin.synth.tasks import Task


class TaskSource:
    """Batch ``i`` of the training stream is drawn from ``np.random.default_rng([seed, 0, i])``, so the stream is
    reproducible from the seed and resumes from the batch index alone. Every row is one sequence from position 0
    (``whole_rows``)."""

    whole_rows = True

    def __init__(self, task: Task, batch_size: int, seed: int = 0, eval_sequences: int = 256,
                 eval_batch_size: int = 32, eval_seed: int = EVAL_SEED) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.index = 0
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
        return {"task": self.task.to_dict(), "seed": self.seed, "batch_size": self.batch_size, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diff = [f"{k}: {state.get(k)!r} in the checkpoint, {mine[k]!r} here" for k in ("task", "seed", "batch_size")
                if state.get(k) != mine[k]]
        if diff:
            raise ValueError("the checkpoint was trained on another task stream: " + "; ".join(diff))
        if not isinstance(state.get("index"), int) or state["index"] < 0:
            raise ValueError(f"the checkpoint's batch index {state.get('index')!r} is not a non-negative integer")
        self.index = state["index"]

    def evaluate(self, model: CausalLM) -> dict[str, float]:
        """Loss per target, accuracy and fraction of perfect sequences on the fixed held-out set."""
        return score(model, self.held_out)
