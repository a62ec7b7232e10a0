"""Accuracy on a task's answers (Section 6.2, Figure 6): at the training length, and at other lengths through the
chunked forward with a cache, whose memory does not grow with the length for Hawk and Griffin.

Accuracy is the fraction of target positions whose most likely token (over the whole vocabulary) is the target;
``perfect`` is the fraction of sequences with every target right (selective copying: all 16 data tokens copied;
induction heads has one target per sequence, so both are the same).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from griffin.data import Batch
from griffin.interop import load_pretrained
from griffin.layers.rg_lru import RGLRU
from griffin.model import CausalLM
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.synth.tasks import Task, task_from_dict

EVAL_SEED = 1234  # the held-out sequences are the same for every run of a task, whatever its training seed
TASK_FILE = "task.json"
ATTENTION_ELEMENTS = 1 << 25  # bound on the elements of a chunk's attention scores (global attention)


def held_out(task: Task, sequences: int, batch_size: int, seed: int = EVAL_SEED) -> list[Batch]:
    """A fixed held-out set: ``sequences`` sequences of ``task`` in batches of ``batch_size`` (the last may be
    smaller), drawn from a stream of their own (``[seed, 1, seq_len]``; training draws from ``[seed, 0, step]``)."""
    if sequences < 1 or batch_size < 1:
        raise ValueError(f"sequences={sequences} and batch_size={batch_size} must be positive")
    rng = np.random.default_rng([seed, 1, task.seq_len])
    return [task.sample(min(batch_size, sequences - s), rng) for s in range(0, sequences, batch_size)]


def answer_logits_ref(model: CausalLM, input_ids: Tensor, targets: Tensor) -> Tensor:
    """The logits (answers, vocab) at the target positions, in (row, position) order: one plain forward."""
    return model(input_ids)[targets != IGNORE_INDEX]


def chunk_length(model: CausalLM, batch_size: int, seq_len: int, chunk_size: int) -> int:
    """Tokens per chunk: ``chunk_size``, smaller where global attention's scores over the whole sequence would
    exceed ``ATTENTION_ELEMENTS``."""
    if "attention" in model.config.block_types:
        per_query = batch_size * model.config.num_heads * seq_len
        chunk_size = min(chunk_size, max(16, ATTENTION_ELEMENTS // per_query))
    return max(1, chunk_size)


def answer_logits(model: CausalLM, input_ids: Tensor, targets: Tensor, chunk_size: int = 1024) -> Tensor:
    """:func:`answer_logits_ref` in chunks of at most ``chunk_size`` tokens continuing a cache: for Hawk and Griffin
    the memory is that of one chunk and the fixed-size state, whatever the length (global attention keeps a KV cache
    of the whole sequence). Only the logits from each chunk's first target position on are computed."""
    B, T = input_ids.shape
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    chunk = chunk_length(model, B, T, chunk_size)
    device = model.device
    input_ids, targets = input_ids.to(device), targets.to(device)
    cache = None
    if T > chunk:
        cache = model.init_cache(B, T if "attention" in model.config.block_types else None)
    rows, cols, logits = [], [], []
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        mask = targets[:, start:end] != IGNORE_INDEX
        hit = mask.any(0).nonzero()
        first = int(hit[0]) if len(hit) else end - start - 1  # no target here: one position to keep, unused
        out = model(input_ids[:, start:end], cache=cache, logits_to_keep=end - start - first)
        if len(hit):
            r, c = mask[:, first:].nonzero(as_tuple=True)
            rows.append(r)
            cols.append(c + start + first)
            logits.append(out[r, c])
    if not logits:
        return input_ids.new_zeros((0, model.config.vocab_size), dtype=torch.float32)
    rows_, cols_ = torch.cat(rows), torch.cat(cols)
    order = torch.argsort(rows_ * T + cols_)
    return torch.cat(logits)[order]


def distance_edges(seq_len: int, bins: int) -> np.ndarray:
    """``bins`` + 1 edges splitting the recall distances 1 .. seq_len - 1 into equal bins (the last one closed)."""
    if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins < seq_len:
        raise ValueError(f"distance bins={bins!r} must be an integer in [1, {seq_len - 1}] at length {seq_len}")
    return np.linspace(1, seq_len, bins + 1).round().astype(np.int64)


class Tally:
    """Sums of loss, correct answers and perfect sequences over batches; with ``edges``, the correct answers by
    recall distance (a target's position minus its source's, :meth:`Task.sources`) too."""

    def __init__(self, edges: np.ndarray | None = None) -> None:
        self.loss = self.correct = self.answers = self.perfect = self.sequences = 0.0
        self.edges = edges
        bins = 0 if edges is None else len(edges) - 1
        self.bin_correct, self.bin_answers = np.zeros(bins), np.zeros(bins)

    def add(self, logits: Tensor, targets: Tensor, distances: np.ndarray | None = None) -> None:
        """``logits`` (answers, vocab) at the positions of ``targets`` != -100 (B, T), in (row, position) order;
        ``distances`` (answers,): each target's recall distance, needed when the tally has edges."""
        mask = targets != IGNORE_INDEX
        answer = targets[mask].to(logits.device)
        right = logits.argmax(-1) == answer
        if self.edges is not None:
            if distances is None or len(distances) != len(answer):
                raise ValueError("a tally by distance needs one distance per target")
            which = np.clip(np.searchsorted(self.edges, distances, side="right") - 1, 0, len(self.edges) - 2)
            np.add.at(self.bin_answers, which, 1.0)
            np.add.at(self.bin_correct, which, right.cpu().numpy().astype(np.float64))
        self.loss += float(F.cross_entropy(logits.float(), answer, reduction="sum"))
        self.correct += float(right.sum())
        self.answers += len(answer)
        rows = mask.nonzero()[:, 0].to(logits.device)
        wrong = torch.zeros(targets.shape[0], device=logits.device).index_add_(0, rows, (~right).float())
        self.perfect += float((wrong == 0).sum())
        self.sequences += targets.shape[0]

    def metrics(self) -> dict[str, float]:
        n = max(self.answers, 1.0)
        return {"val_loss": self.loss / n, "accuracy": self.correct / n,
                "perfect": self.perfect / max(self.sequences, 1.0)}

    def by_distance(self) -> list[dict[str, Any]]:
        """Per bin of recall distance [from, to): the answers in it and their accuracy (NaN for an empty bin)."""
        if self.edges is None:
            return []
        return [{"from": int(a), "to": int(b), "answers": int(n), "accuracy": float(c / n) if n else math.nan}
                for a, b, n, c in zip(self.edges[:-1], self.edges[1:], self.bin_answers, self.bin_correct,
                                          strict=True)]


@torch.no_grad()
def score(model: CausalLM, batches: Sequence[Batch], chunk_size: int = 1 << 30) -> dict[str, float]:
    """Mean loss per target (``val_loss``), accuracy and the fraction of perfect sequences over ``batches``."""
    was_training = model.training
    model.eval()
    tally = Tally()
    try:
        for batch in batches:
            tally.add(answer_logits(model, batch.input_ids, batch.targets, chunk_size), batch.targets)
    finally:
        model.train(was_training)
    return tally.metrics()


def evaluate_lengths(model: CausalLM, task: Task, lengths: Sequence[int], sequences: int = 64, batch_size: int = 16,
                     chunk_size: int = 1024, seed: int = EVAL_SEED, progress: bool = True,
                     distance_bins: int = 0) -> list[dict[str, Any]]:
    """Accuracy of ``model`` on ``task`` at each sequence length (Figure 6b): ``sequences`` fresh held-out sequences
    per length, through the chunked forward (:func:`answer_logits`). ``distance_bins`` > 0: each length's accuracy
    split too by how far back the answer lies (``by_distance``: that many equal bins of 1 .. length - 1)."""
    if not lengths:
        raise ValueError("give at least one evaluation length")
    tasks = [task.with_length(int(n)) for n in lengths]  # every length checked before anything runs
    edges = [distance_edges(t.seq_len, distance_bins) if distance_bins else None for t in tasks]
    if sequences < 1 or batch_size < 1 or chunk_size < 1:
        raise ValueError(f"sequences={sequences}, batch_size={batch_size} and chunk_size={chunk_size} must be "
                         "positive")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sequences * sum(t.seq_len for t in tasks), unit="tok", unit_scale=True, desc="evaluate",
                   dynamic_ncols=True)
    results = []
    try:
        for t, t_edges in zip(tasks, edges, strict=True):
            start = time.perf_counter()
            tally = Tally(t_edges)
            model.eval()
            with torch.no_grad():
                for batch in held_out(t, sequences, batch_size, seed):
                    distances = None
                    if t_edges is not None:
                        ids, targets = batch.input_ids.numpy(), batch.targets.numpy()
                        distances = (targets != IGNORE_INDEX).nonzero()[1] - t.sources(ids, targets)
                    tally.add(answer_logits(model, batch.input_ids, batch.targets, chunk_size), batch.targets,
                              distances)
                    if bar is not None:
                        bar.update(batch.input_ids.numel())
            results.append({"length": t.seq_len, **tally.metrics(), "sequences": sequences,
                            "seconds": time.perf_counter() - start})
            if t_edges is not None:
                results[-1]["by_distance"] = tally.by_distance()
            if bar is not None:
                m = results[-1]
                bar.write(f"length {t.seq_len:>8}: accuracy {m['accuracy']:.4f}, perfect {m['perfect']:.4f}, "
                          f"loss {m['val_loss']:.4f}")
    finally:
        if bar is not None:
            bar.close()
    return results


def memory_horizons(model: CausalLM, input_ids: Tensor) -> list[Tensor]:
    """Each RG-LRU channel's memory horizon on ``input_ids``, one (width,) tensor per recurrent block in depth order:
    1 / mean_t(-log a_t), the tokens after which the channel's state keeps e^-1 of what it held (Section 2.4). An
    answer kept only in channels whose horizon is short against a distance is lost at that distance: the check of
    what a model trained at T can extrapolate to (Figure 6b)."""
    lrus = [m for m in model.modules() if isinstance(m, RGLRU)]
    if not lrus:
        raise ValueError(f"{model.config.family}: the model has no RG-LRU, so no memory horizon")
    decays: list[Tensor] = []
    forward_with_hooks(model, input_ids, lrus, lambda mod, args, out: decays.append(mod.decay(args[0])))
    return [1.0 / -a.log().mean(dim=(0, 1)) for a in decays]


def forward_with_hooks(model: CausalLM, input_ids: Tensor, modules: Sequence[torch.nn.Module],
                       hook: Callable[[torch.nn.Module, tuple, Any], None]) -> None:
    """One plain forward of ``input_ids`` (eval mode, no gradients) with ``hook`` a forward hook of each of
    ``modules`` meanwhile: how the diagnostics here look inside a model."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()


def run_root(directory: str | Path) -> Path:
    """The run directory of a ``griffin synth`` run directory (itself) or of one of its checkpoints
    (``DIR/checkpoints/NAME``: ``DIR``)."""
    directory = Path(directory)
    return directory if (directory / TASK_FILE).is_file() else directory.parent.parent


def run_files(directory: str | Path) -> tuple[Task, Path]:
    """The task (``task.json``) and the directory of the model of a ``griffin synth`` run: the run's final model
    (``DIR``), or one of its checkpoints (``DIR/checkpoints/NAME``, e.g. of a run still training or stopped)."""
    directory = Path(directory)
    run = run_root(directory)
    spec = run / TASK_FILE
    if not spec.is_file():
        raise FileNotFoundError(f"{directory} holds no {TASK_FILE}: not a `griffin synth` run directory or one of "
                                "its checkpoints")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} holds no model yet (the run has not finished): give one of its "
                                f"checkpoints, e.g. {directory / 'checkpoints' / 'latest'}")
    try:
        return task_from_dict(json.loads(spec.read_text())), directory
    except json.JSONDecodeError as err:
        raise ValueError(f"{spec} is not valid JSON: {err}") from None


def load_run(directory: str | Path) -> tuple[CausalLM, Task]:
    """The model (``load_pretrained``) and the task of a ``griffin synth`` run directory or one of its checkpoints
    (:func:`run_files`)."""
    task, directory = run_files(directory)
    model = load_pretrained(directory)
    if model.config.vocab_size < task.vocab_size:
        raise ValueError(f"{directory}: the model has {model.config.vocab_size} tokens, the task {task.vocab_size}")
    return model, task


def default_lengths(task: Task, longest: int = 1 << 16) -> list[int]:
    """The training length doubled until ``longest``: 256, 512, ..., 65536 for induction heads."""
    count = max(0, int(math.log2(max(longest, task.seq_len) / task.seq_len)))
    return [task.seq_len << i for i in range(count + 1)]
