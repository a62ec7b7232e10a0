"""A task as the trainer's batch source (:class:`griffin.training.source.BatchSource`): fresh sequences every step,
a fixed held-out set for the accuracy curve (Figure 6a), and a position that checkpoints resume exactly.

**The prefix stream** (``prefix_stream``; ``griffin synth --prefix-stream``). Trained on sequences of T tokens, a
recurrent model only ever meets the states that T tokens from an empty state reach; beyond T it meets others, and
fails there (the "unexplored states" of Buitrago Ruiz and Gu, 2025: their State Passing starts each sequence from the
final state of another). Here each row of each batch continues a stream of the task's filler (for induction heads:
random tokens, no trigger), which advances T tokens a step without gradients (``stream_advance`` N: N tokens; the
answers of recall below then reach K N tokens back in K steps): the recurrent blocks start every
training sequence from a state that a prefix of any length reached, as an evaluation sequence far longer than T
presents it, while the answer stays within T tokens of its query. The stream's cache is saved in the checkpoints
(``source_state.safetensors``), so that a run resumes exactly.

**Recall from the stream** (``stream_recall`` K; ``griffin synth --stream-recall K``, with the prefix stream). The
answers above are never more than T tokens back, so nothing asks the state to keep one longer. With K, the second half
of the rows recall from the stream instead: an episode writes a trigger and its answer into the row's stream (the
stream starts a new document there), then for k steps (k drawn from 1 ... K, log-uniformly or, with ``recall_draw``
``uniform``, uniformly: a quarter of the rows' steps then ask from the farthest half) the row's training sequence
is filler ending in the trigger, and its target that answer, up to K N tokens back. The gradient stops at the stream's
state (truncated backpropagation through time), so what is learned is to keep the answer through the T tokens of each
step, whatever state it arrives in, and to read it at the trigger.

Where an episode writes its answer (``recall_episodes``; ``griffin synth --recall-episodes``): ``new-document`` (the
default) starts the row's stream afresh, so the trigger meets an empty state; ``after-filler`` starts it afresh and
writes the trigger after a stretch of filler drawn like k (0 ... K - 1 steps; the row trains on the task's own
sequence meanwhile), so that it meets the states long prefixes reach, as an evaluation sequence's trigger far into it
does; ``continue`` writes into the stream as it is, which still holds the earlier episodes' answers, and asks for the
newest."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from griffin.data import Batch
from griffin.model import Cache, CausalLM
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.synth.evaluate import EVAL_SEED, held_out, score
from griffin.synth.tasks import InductionHeads, Task
from griffin.training.fast import CompiledStep

EPISODES = ("new-document", "after-filler", "continue")  # where a recall episode writes (the module's docstring)
DRAWS = ("log-uniform", "uniform")  # how its steps k are drawn


def stream_options(task: Task, batch_size: int, *, prefix_stream: bool = False, stream_recall: int = 0,
                   recall_episodes: str = EPISODES[0], recall_draw: str = DRAWS[0],
                   stream_advance: int | None = None) -> dict[str, Any]:
    """Check the prefix stream's settings (``griffin synth --prefix-stream``, ``--stream-recall``,
    ``--recall-episodes``, ``--recall-draw``, ``--stream-advance``) before anything trains, raising a ValueError that
    names the offending one; return those that differ from their defaults (what a run records in its options, so
    that the options of runs without them stay as they were)."""
    opts: dict[str, Any] = {}
    if prefix_stream:
        task.filler(1, 1, np.random.default_rng(0))  # a task without a filler stream is refused here
        opts["prefix_stream"] = True
    if isinstance(stream_recall, bool) or not isinstance(stream_recall, int) or stream_recall < 0:
        raise ValueError(f"stream_recall={stream_recall!r} must be a non-negative integer (steps back)")
    if stream_recall:
        if not prefix_stream:
            raise ValueError(f"--stream-recall {stream_recall} recalls from the prefix stream: add --prefix-stream")
        if not isinstance(task, InductionHeads) or batch_size < 2:
            raise ValueError(f"--stream-recall {stream_recall}: recalls from the prefix stream of induction heads, "
                             f"in half of a batch of at least 2 (got {task.name}, batch {batch_size})")
        opts["stream_recall"] = stream_recall
    if stream_advance is not None:
        if isinstance(stream_advance, bool) or not isinstance(stream_advance, int) or stream_advance < 2:
            raise ValueError(f"stream_advance={stream_advance!r} must be an integer of at least 2 (tokens a step: "
                             "room for a trigger and its answer)")
        if not prefix_stream:
            raise ValueError(f"--stream-advance {stream_advance} is how far the prefix stream advances: add "
                             "--prefix-stream")
        opts["stream_advance"] = stream_advance
    for name, value, choices in (("recall_episodes", recall_episodes, EPISODES), ("recall_draw", recall_draw, DRAWS)):
        if value not in choices:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
        if value != choices[0]:
            if not stream_recall:
                raise ValueError(f"{name}={value!r} shapes the episodes of --stream-recall: set --stream-recall K")
            opts[name] = value
    return opts


class _StreamAdvance(nn.Module):
    """The prefix stream's advance: ``model`` takes in tokens (B, N) into the stream's cache (a module, so that
    :class:`griffin.training.fast.CompiledStep` compiles it as it does the training step)."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, positions: Tensor | None, stream: Cache) -> None:
        self.model(tokens, positions, cache=stream, logits_to_keep=1)


class TaskSource:
    """Batch ``i`` of the training stream is drawn from ``np.random.default_rng([seed, 0, i])``, so the stream is
    reproducible from the seed and resumes from the batch index alone. Every row is one sequence from position 0
    (``whole_rows``)."""

    whole_rows = True

    def __init__(self, task: Task, batch_size: int, seed: int = 0, eval_sequences: int = 256,
                 eval_batch_size: int = 32, eval_seed: int = EVAL_SEED, prefix_stream: bool = False,
                 stream_recall: int = 0, recall_episodes: str = EPISODES[0], recall_draw: str = DRAWS[0],
                 stream_advance: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        stream_options(task, batch_size, prefix_stream=prefix_stream, stream_recall=stream_recall,
                       recall_episodes=recall_episodes, recall_draw=recall_draw, stream_advance=stream_advance)
        advance = task.seq_len if stream_advance is None else stream_advance
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.index = 0
        self.prefix_stream = bool(prefix_stream)
        self.stream_advance = advance
        self.stream_recall = stream_recall
        self._recall_rows = range(batch_size - batch_size // 2, batch_size) if stream_recall else range(0)
        self._answer = [-1] * batch_size  # the answer each recall row's stream holds
        self._left = [0] * batch_size  # the steps it is still asked for
        self.recall_episodes, self.recall_draw = recall_episodes, recall_draw
        self._lead = [-1] * batch_size  # after-filler: the filler steps left before the write (-1: none drawn)
        # per batch drawn and not yet continued (a trainer draws every micro-batch of a step first): its index, the
        # (position, answer) each recall row's stream takes in, and the rows whose stream starts a new document
        self._advances: deque[tuple[int, dict[int, tuple[int, int]], list[int]]] = deque()
        self._stream: Cache | None = None
        self._stream_counters: dict[str, Any] = {}  # (length, started) of a resumed stream, until it is made
        self._stream_tensors: dict[str, Tensor] = {}  # its tensors, likewise
        self._compiled_advance: tuple[CausalLM, CompiledStep] | None = None  # (model, its advance under compile)
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
        if self.prefix_stream:
            write, restart = self._recall(batch, np.random.default_rng([self.seed, 3, self.index]))
            self._advances.append((self.index, write, restart))
        self.index += 1
        self.generate_seconds += time.perf_counter() - start
        return batch

    def state_dict(self) -> dict[str, Any]:
        state = {"task": self.task.to_dict(), "seed": self.seed, "batch_size": self.batch_size, "index": self.index}
        if self.prefix_stream:
            stream = self._stream
            state["prefix_stream"] = ({"length": stream.length, "started": stream.started} if stream is not None
                                      else self._stream_counters)
            if self.stream_advance != self.task.seq_len:  # (checkpoints of the default read as before)
                state["stream_advance"] = self.stream_advance
        if self.stream_recall:
            state["stream_recall"] = {"steps": self.stream_recall, "answer": list(self._answer),
                                      "left": list(self._left)}
            if self.recall_episodes != EPISODES[0]:  # (checkpoints of the defaults read as before)
                state["stream_recall"].update(episodes=self.recall_episodes, lead=list(self._lead))
            if self.recall_draw != DRAWS[0]:
                state["stream_recall"]["draw"] = self.recall_draw
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
        advance = state.get("stream_advance", self.task.seq_len)
        if self.prefix_stream and advance != self.stream_advance:
            raise ValueError(f"the checkpoint's prefix stream advanced {advance} tokens a step, this run's "
                             f"{self.stream_advance}")
        self._stream, self._stream_counters = None, dict(state.get("prefix_stream") or {})
        self._advances.clear()
        recall = state.get("stream_recall") or {"steps": 0}
        if recall["steps"] != self.stream_recall:
            raise ValueError(f"the checkpoint recalled from the stream up to {recall['steps']} steps back, this run "
                             f"{self.stream_recall} (0: none)")
        episodes, draw = recall.get("episodes", EPISODES[0]), recall.get("draw", DRAWS[0])
        if self.stream_recall and (episodes, draw) != (self.recall_episodes, self.recall_draw):
            raise ValueError(f"the checkpoint's recall episodes were {episodes}, their steps {draw}; this run's "
                             f"{self.recall_episodes}, {self.recall_draw}")
        if self.stream_recall:
            self._answer, self._left = [int(a) for a in recall["answer"]], [int(k) for k in recall["left"]]
            self._lead = [int(j) for j in recall.get("lead", [-1] * self.batch_size)]

    def state_tensors(self) -> dict[str, Tensor]:
        """The prefix stream's cache (saved beside :meth:`state_dict` in every checkpoint; empty without one)."""
        stream = self._stream
        if stream is None:
            return dict(self._stream_tensors)
        return {name: t.detach().cpu().contiguous() for name, t in stream.tensors().items()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Continue the stream of :meth:`state_tensors` (with :meth:`load_state_dict`'s counters)."""
        self._stream, self._stream_tensors = None, dict(tensors)

    def initial_cache(self, model: CausalLM, compile: bool = False, fallback: bool = False) -> Cache | None:
        """The cache the rows of the batch just drawn continue: with ``prefix_stream``, a copy of the stream's after it
        advanced ``stream_advance`` more filler tokens (drawn from the batch index; with ``stream_recall``, the
        trigger and answer of each episode begun at this batch written in, as a new document; no gradients, in the
        caller's autocast); None without (each row starts from an empty state).

        ``compile`` (the trainer's ``--compile``): the advance runs under ``torch.compile``, as the training step does
        (:class:`griffin.training.fast.CompiledStep`: a compiler failure raises, or with ``fallback`` runs it
        uncompiled); the stream it leaves is the eager advance's within rounding."""
        if not self.prefix_stream:
            return None
        if self._stream is None:
            self._stream = self._new_stream(model)
        if not self._advances:
            raise RuntimeError("initial_cache: every batch drawn has been continued already (draw one first)")
        index, write, restart = self._advances.popleft()
        N = self.stream_advance
        tokens = self.task.filler(self.batch_size, N, np.random.default_rng([self.seed, 1, index]))
        for row, (p, answer) in write.items():
            tokens[row, p], tokens[row, p + 1] = InductionHeads.TRIGGER, answer
        positions = None  # each row continues its document, but those that start a new one (position 0)
        if restart:
            positions = self._stream.position[:, None].cpu() + torch.arange(N)
            positions[restart] = torch.arange(N)
            positions = positions.to(model.device)
        advance = self._advance_step(model, fallback) if compile else _StreamAdvance(model)
        length = self._stream.length
        with torch.no_grad():
            advance(torch.from_numpy(tokens).to(model.device), positions, self._stream)
        # the host-side counters, as an eager forward sets them (a compiled one leaves them to its caller)
        self._stream.length, self._stream.started = length + N, positions is None
        return self._stream.copy()

    def _advance_step(self, model: CausalLM, fallback: bool) -> CompiledStep:
        if self._compiled_advance is None or self._compiled_advance[0] is not model:
            self._compiled_advance = (model, CompiledStep(_StreamAdvance(model), fallback))
        return self._compiled_advance[1]

    def _recall(self, batch: Batch, rng: np.random.Generator) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """Make the recall rows of ``batch`` ask for the answers their streams hold; start an episode on each row
        whose last one ended. Returns what the stream's advance for this batch writes ({row: (position, answer)})
        and the rows it starts as new documents (none without ``stream_recall``)."""
        T, N, V = self.task.seq_len, self.stream_advance, self.task.vocab_size
        write, restart = {}, []
        for row in self._recall_rows:
            if self._left[row] == 0:  # the row's episode ended (or none began): begin the next
                if self._answer[row] >= 0 and self.recall_episodes != "continue":
                    restart.append(row)
                self._answer[row] = -1
                if self.recall_episodes == "after-filler" and self._lead[row] < 0:
                    self._lead[row] = self._steps(rng) - 1
                if self._lead[row] > 0:  # filler before the write: the row trains on the task's sequence
                    self._lead[row] -= 1
                    continue
                self._lead[row] = -1
                self._answer[row] = int(rng.integers(1, V))
                write[row] = (int(rng.integers(0, N - 1)), self._answer[row])
                self._left[row] = self._steps(rng)
            ids = self.task.filler(1, T, rng)[0]
            ids[-1] = InductionHeads.TRIGGER
            batch.input_ids[row] = torch.from_numpy(ids)
            batch.targets[row] = IGNORE_INDEX
            batch.targets[row, -1] = self._answer[row]
            self._left[row] -= 1
        return write, restart

    def _steps(self, rng: np.random.Generator) -> int:
        """k in 1 ... K, log-uniform or uniform (``recall_draw``)."""
        K = self.stream_recall
        if self.recall_draw == "uniform":
            return int(rng.integers(1, K + 1))
        return min(K, int(np.exp(rng.uniform(0.0, np.log(K + 1)))))

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
