"""Phonebook lookup (Section 6.2, Figure 6c; the task of Jelassi et al., 2024): copy and retrieval from the context.

A book of ``n`` entries ``Full Name: NNNNNNNNNN`` (ten digits, the first one 6-9), one per line, names drawn without
replacement from a shipped list (``names.txt``: 60 first names x 60 last names); a blank line; two example entries
from the book; a blank line; then a third name from the book followed by ``:``. The model decodes greedily; its
answer is the first line of the output, compared exactly (surrounding spaces stripped) with the number. Accuracy is
reported for each book length as the mean and standard deviation over seeds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np
from tqdm import tqdm

from griffin.data.tokenizer import Tokenizer
from griffin.evaluation.generation import generate_until
from griffin.io import atomic_write
from griffin.model import CausalLM

NAMES_FILE = Path(__file__).with_name("names.txt")


@cache
def name_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(first names, last names) of the shipped list."""
    lines = [ln.strip() for ln in NAMES_FILE.read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    split = lines.index("--")
    return tuple(lines[:split]), tuple(lines[split + 1 :])


def max_entries() -> int:
    first, last = name_lists()
    return len(first) * len(last)


@dataclass
class PhonebookExample:
    prompt: str
    answer: str
    entries: int


def make_example(entries: int, rng: random.Random) -> PhonebookExample:
    """One prompt: a book of ``entries`` distinct names (at least 3), two examples, a query; and its answer."""
    if isinstance(entries, bool) or not isinstance(entries, int) or not 3 <= entries <= max_entries():
        raise ValueError(f"a phonebook holds 3 to {max_entries()} entries, got {entries!r}")
    first, last = name_lists()
    picks = rng.sample(range(len(first) * len(last)), entries)
    names = [f"{first[p // len(last)]} {last[p % len(last)]}" for p in picks]
    numbers = [rng.choice("6789") + "".join(rng.choice("0123456789") for _ in range(9)) for _ in names]
    book = [f"{n}: {x}" for n, x in zip(names, numbers, strict=True)]
    shown = rng.sample(range(entries), 3)
    examples = [book[i] for i in shown[:2]]
    prompt = "\n".join(book) + "\n\n" + "\n".join(examples) + "\n\n" + f"{names[shown[2]]}:"
    return PhonebookExample(prompt, numbers[shown[2]], entries)


def make_examples(entries: int, samples: int, seed: int) -> list[PhonebookExample]:
    """``samples`` prompts with books of ``entries`` entries, determined by ``seed``."""
    rng = random.Random(f"phonebook-{entries}-{seed}")
    return [make_example(entries, rng) for _ in range(samples)]


def is_correct(output: str, answer: str) -> bool:
    """Exact match of the output's first line (surrounding spaces stripped) with the number."""
    return output.split("\n", 1)[0].strip() == answer


@dataclass
class PhonebookResult:
    """Accuracy per book length: ``accuracy[i][s]`` for ``entries[i]`` and seed ``seeds[s]``; mean and std over
    seeds; the mean prompt length in tokens."""

    entries: list[int]
    seeds: list[int]
    samples: int
    accuracy: list[list[float]]
    mean: list[float]
    std: list[float]
    prompt_tokens: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_phonebook(model: CausalLM, tokenizer: Tokenizer, entries: Sequence[int] = (10, 20, 40, 80, 160),
                       seeds: Sequence[int] = (0, 1, 2), samples: int = 20, batch_size: int = 8,
                       chunk_size: int = 1024, progress: bool = True) -> PhonebookResult:
    """Greedy phonebook lookup accuracy for each book length (prompts framed with the tokenizer's BOS)."""
    if not entries or not seeds:
        raise ValueError("give at least one book length (entries) and one seed")
    if samples < 1 or batch_size < 1:
        raise ValueError(f"samples={samples} and batch_size={batch_size} must be positive")
    for n in entries:
        if isinstance(n, bool) or not isinstance(n, int) or not 3 <= n <= max_entries():
            raise ValueError(f"book length {n!r} must be an integer in [3, {max_entries()}]")
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    accuracy, lengths = [], []
    with tqdm(total=len(entries) * len(seeds) * samples, desc="phonebook", unit="lookup", disable=not progress,
              dynamic_ncols=True) as bar:
        for n in entries:
            row, tokens = [], []
            for seed in seeds:
                examples = make_examples(n, samples, seed)
                correct = 0
                for start in range(0, samples, batch_size):
                    batch = examples[start : start + batch_size]
                    prompts = [bos + list(tokenizer.encode(e.prompt)) for e in batch]
                    budget = max(len(tokenizer.encode(" " + e.answer)) for e in batch) + 4
                    outputs = generate_until(model, prompts, tokenizer, ["\n"], budget, chunk_size=chunk_size)
                    correct += sum(is_correct(o, e.answer) for o, e in zip(outputs, batch, strict=True))
                    tokens += [len(p) for p in prompts]
                    bar.update(len(batch))
                row.append(correct / samples)
            accuracy.append(row)
            lengths.append(float(np.mean(tokens)))
    acc = np.asarray(accuracy)
    return PhonebookResult(list(entries), list(seeds), samples, accuracy, acc.mean(1).tolist(), acc.std(1).tolist(),
                           lengths)


def write_jsonl(path: str | Path, entries: int, samples: int, seed: int = 0) -> Path:
    """The prompts and answers of one book length as JSONL (fields ``prompt``, ``answer``), for the harness task
    ``phonebook_<entries>``; written atomically."""
    path = Path(path)
    lines = [json.dumps({"prompt": e.prompt, "answer": e.answer, "entries": e.entries})
             for e in make_examples(entries, samples, seed)]
    atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return path
