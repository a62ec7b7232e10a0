"""The copy and retrieval tasks of Section 6.2 and Appendix H, and Zoology's MQAR: seeded on-the-fly generators.

Each task is a frozen dataclass (its spec, written to ``task.json``) whose :meth:`Task.sample` draws a batch from a
``numpy.random.Generator``: input ids, each token's position (every row is one document), and targets that are
-100 except at the positions that carry the loss, all (batch, seq_len) int64. Everything is vectorised numpy, so a
batch costs a small part of a training step.

- :class:`SelectiveCopying` (Appendix H, after Mamba): noise token 0, data tokens 1 .. V-2, marker V-1. The first
  ``seq_len - num_data`` positions hold ``num_data`` data tokens at distinct sorted random positions, noise
  elsewhere; then ``num_data`` markers. At the k-th marker the target is the k-th data token.
- :class:`InductionHeads` (Section 6.2): trigger token 0, ordinary tokens 1 .. V-1 drawn uniformly; one trigger at
  a random position p <= T-3, followed by the answer x[p+1], and the trigger again as the last token (no other
  trigger). The only loss is at the last position, target x[p+1].
- :class:`MQAR` (Zoology's multi-query associative recall, Arora et al. 2023): ``num_pairs`` key-value pairs
  (distinct keys from 1 .. V/2-1, distinct values from V/2 .. V-1), then a query region where each key appears
  once at an even offset ``2·gap`` with gaps drawn without replacement, P(gap = i) ∝ (i+1)^(power_a - 1), the
  other positions random tokens of the whole vocabulary. The target at each query is its key's value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from griffin.data import Batch
from griffin.ops.cross_entropy import IGNORE_INDEX


def _positive_int(task: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{task}: {name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class Task:
    """A synthetic task: a sequence length, a vocabulary, and a generator of batches."""

    name: ClassVar[str] = ""
    window: ClassVar[int] = 0  # Griffin's local-attention window for this task (Section 6.2)
    seq_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the offending value if the task cannot be generated."""
        for f in dataclasses.fields(self):
            if f.type in ("int", int):
                _positive_int(self.name, f.name, getattr(self, f.name))

    @property
    def answers(self) -> int:
        """How many tokens a target can be (the baseline predicts them uniformly)."""
        raise NotImplementedError

    @property
    def baseline_loss(self) -> float:
        """Loss per target of predicting the targets' (uniform) marginal distribution: log(answers)."""
        return math.log(self.answers)

    @property
    def targets_per_sequence(self) -> int:
        raise NotImplementedError

    def filler(self, batch_size: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``length`` tokens per row of what fills a sequence between the tokens that matter (no query, no answer):
        the long prefixes a model meets beyond its training length (``griffin synth --prefix-stream``). A task
        without such a stream raises a ValueError naming it."""
        raise ValueError(f"{self.name} has no filler stream to continue: --prefix-stream trains induction heads")

    def with_length(self, seq_len: int) -> Task:
        """The same task at another sequence length (checked)."""
        return dataclasses.replace(self, seq_len=seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}

    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """``batch_size`` sequences drawn from ``rng``."""
        _positive_int(self.name, "batch_size", batch_size)
        ids, targets = self.generate(batch_size, rng)
        positions = torch.arange(self.seq_len).repeat(batch_size, 1)
        return Batch(torch.from_numpy(ids), positions, torch.from_numpy(targets))

    def generate(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, targets), each (batch_size, seq_len) int64."""
        raise NotImplementedError

    def sources(self, ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """For each target (in row, position order, as ``targets != -100`` lists them), the position of the token it
        copies: the target's position minus it is how far back the model must recall."""
        raise NotImplementedError


@dataclass(frozen=True)
class SelectiveCopying(Task):
    """Copy the data tokens, in order, at the markers; ignore the noise (Appendix H)."""

    name: ClassVar[str] = "selective_copying"
    window: ClassVar[int] = 512
    seq_len: int = 1024
    vocab_size: int = 16
    num_data: int = 16

    NOISE: ClassVar[int] = 0

    @property
    def marker(self) -> int:
        return self.vocab_size - 1

    @property
    def answers(self) -> int:
        return self.vocab_size - 2

    @property
    def targets_per_sequence(self) -> int:
        return self.num_data

    def check(self) -> None:
        super().check()
        if self.vocab_size < 3:
            raise ValueError(f"{self.name}: vocab_size={self.vocab_size} is too small: the task needs a noise token, "
                             "at least one data token and a marker (vocab_size >= 3)")
        if self.seq_len < 2 * self.num_data:
            raise ValueError(f"{self.name}: seq_len={self.seq_len} is too short for num_data={self.num_data}: the "
                             f"data tokens need {self.num_data} positions before the {self.num_data} markers "
                             f"(seq_len >= {2 * self.num_data})")

    def generate(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        B, T, N = batch_size, self.seq_len, self.num_data
        span = T - N
        where = np.sort(np.argsort(rng.random((B, span)), axis=1)[:, :N], axis=1)
        data = rng.integers(1, self.vocab_size - 1, (B, N))
        ids = np.full((B, T), self.NOISE, np.int64)
        np.put_along_axis(ids, where, data, axis=1)
        ids[:, span:] = self.marker
        targets = np.full((B, T), IGNORE_INDEX, np.int64)
        targets[:, span:] = data
        return ids, targets

    def sources(self, ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
        span = self.seq_len - self.num_data
        data = (ids[:, :span] != self.NOISE).nonzero()[1]  # row by row, in order: the k-th is the k-th target's
        if data.size != ids.shape[0] * self.num_data:
            raise ValueError(f"{self.name}: not sequences of this task ({data.size} data tokens in {ids.shape[0]} "
                             f"rows, expected {self.num_data} each)")
        return data


@dataclass(frozen=True)
class InductionHeads(Task):
    """Recall the token that followed the trigger when the trigger comes again (Section 6.2)."""

    name: ClassVar[str] = "induction_heads"
    window: ClassVar[int] = 128
    seq_len: int = 256
    vocab_size: int = 16

    TRIGGER: ClassVar[int] = 0

    @property
    def answers(self) -> int:
        return self.vocab_size - 1

    @property
    def targets_per_sequence(self) -> int:
        return 1

    def check(self) -> None:
        super().check()
        if self.vocab_size < 3:
            raise ValueError(f"{self.name}: vocab_size={self.vocab_size} is too small: the task needs the trigger and "
                             "at least two ordinary tokens (vocab_size >= 3)")
        if self.seq_len < 3:
            raise ValueError(f"{self.name}: seq_len={self.seq_len} is too short: the trigger, its answer and the "
                             "final trigger need seq_len >= 3")

    def generate(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        B, T = batch_size, self.seq_len
        rows = np.arange(B)
        ids = rng.integers(1, self.vocab_size, (B, T))
        first = rng.integers(0, T - 2, B)  # p in [0, T-3]
        ids[rows, first] = self.TRIGGER
        ids[:, -1] = self.TRIGGER
        targets = np.full((B, T), IGNORE_INDEX, np.int64)
        targets[:, -1] = ids[rows, first + 1]
        return ids, targets

    def filler(self, batch_size: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """Random ordinary tokens (no trigger): a prefix before the trigger, as long as wanted."""
        _positive_int(self.name, "batch_size", batch_size)
        _positive_int(self.name, "length", length)
        return rng.integers(1, self.vocab_size, (batch_size, length))

    def sources(self, ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
        first = (ids[:, :-1] == self.TRIGGER).argmax(1)
        if not (ids[np.arange(len(ids)), first] == self.TRIGGER).all():
            raise ValueError(f"{self.name}: a sequence has no trigger before the last position")
        return first + 1


@dataclass(frozen=True)
class MQAR(Task):
    """Multi-query associative recall (Zoology): key-value pairs, then each key queried once."""

    name: ClassVar[str] = "mqar"
    window: ClassVar[int] = 128
    seq_len: int = 256
    vocab_size: int = 8192
    num_pairs: int = 64
    power_a: float = 0.01

    @property
    def answers(self) -> int:
        return self.vocab_size - self.vocab_size // 2

    @property
    def targets_per_sequence(self) -> int:
        return self.num_pairs

    def check(self) -> None:
        super().check()
        P, V = self.num_pairs, self.vocab_size
        if V // 2 - 1 < P or V - V // 2 < P:
            raise ValueError(f"{self.name}: vocab_size={V} is too small for num_pairs={P}: keys come from "
                             f"1..{V // 2 - 1} and values from {V // 2}..{V - 1}, each distinct "
                             f"(vocab_size >= {2 * P + 2})")
        if self.seq_len < 4 * P:
            raise ValueError(f"{self.name}: seq_len={self.seq_len} is too short for num_pairs={P}: the pairs take "
                             f"{2 * P} tokens and the queries {2 * P} more (seq_len >= {4 * P})")
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)) or \
                not 0 < self.power_a <= 1:
            raise ValueError(f"{self.name}: power_a={self.power_a!r} must lie in (0, 1]")

    def generate(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        B, T, P, V = batch_size, self.seq_len, self.num_pairs, self.vocab_size
        half = V // 2
        keys = 1 + np.argsort(rng.random((B, half - 1)), axis=1)[:, :P]
        values = half + np.argsort(rng.random((B, V - half)), axis=1)[:, :P]
        # Query slots without replacement, P(slot i) ∝ (i+1)^(a-1): the Gumbel-top-k form of numpy's sequential
        # choice(replace=False, p=...) that Zoology uses; the k-th slot drawn takes the k-th key.
        space = (T - 2 * P) // 2
        log_w = (self.power_a - 1.0) * np.log(np.arange(1, space + 1))
        gaps = np.argsort(-(log_w + rng.gumbel(size=(B, space))), axis=1)[:, :P]
        ids = rng.integers(0, V, (B, T))
        ids[:, 0 : 2 * P : 2] = keys
        ids[:, 1 : 2 * P : 2] = values
        queries = 2 * P + 2 * gaps
        np.put_along_axis(ids, queries, keys, axis=1)
        targets = np.full((B, T), IGNORE_INDEX, np.int64)
        np.put_along_axis(targets, queries, values, axis=1)
        return ids, targets

    def sources(self, ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
        rows, cols = (targets != IGNORE_INDEX).nonzero()
        keys = ids[:, 0 : 2 * self.num_pairs : 2]  # (B, P)
        match = keys[rows] == ids[rows, cols][:, None]
        if not match.any(1).all():
            raise ValueError(f"{self.name}: a query's key is not among its sequence's pairs")
        return 2 * match.argmax(1) + 1  # the value's position


TASKS: dict[str, type[Task]] = {t.name: t for t in (SelectiveCopying, InductionHeads, MQAR)}


def make_task(name: str, **params: Any) -> Task:
    """The task ``name`` with its defaults overridden by ``params`` (None values are ignored)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=2)
        raise ValueError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    params = {k: v for k, v in params.items() if v is not None}
    for key in params:
        if key not in fields:
            raise ValueError(f"{name}: unknown parameter {key!r}; it has {', '.join(sorted(fields))}")
    return cls(**params)


def task_from_dict(data: dict[str, Any]) -> Task:
    """The task written by :meth:`Task.to_dict` (``task.json``)."""
    if not isinstance(data, dict) or "name" not in data:
        raise ValueError(f"a task spec is a mapping with a 'name', got {data!r}")
    params = dict(data)
    return make_task(params.pop("name"), **params)
