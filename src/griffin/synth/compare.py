"""``griffin synth compare TASK``: the three families trained with the same budget and seeds (Section 6.2).

Writes, under ``OUT``: one run directory per family (``OUT/mqa``, ``OUT/hawk``, ``OUT/griffin``, each a
``griffin synth`` run), ``accuracy.png`` (held-out accuracy against training step: Figure 6a), ``lengths.png``
(accuracy against evaluation length on a log axis: Figure 6b) when lengths are evaluated, ``compare.json`` (every
number) and ``table.md`` (steps to 90% and 99%, final accuracy, accuracy at the longest length, wall time).

With ``init`` (an earlier comparison of the same task, e.g. at a shorter length: a length curriculum), each family
starts from its model there, ``init/FAMILY``, instead of a new one.

A family whose run directory already holds a finished run with the same settings is not trained again, and one
that was interrupted resumes from its last checkpoint (lengths already evaluated for that very model are not
evaluated again), so the comparison can be re-run to finish.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from griffin.config import FAMILIES
from griffin.flops import cpu_name
from griffin.interop import load_pretrained
from griffin.io import atomic_write, write_json
from griffin.synth.evaluate import evaluate_lengths
from griffin.synth.plots import plot_accuracy, plot_lengths
from griffin.synth.tasks import Task
from griffin.synth.train import RESULT_FILE, SynthResult, check_init, check_prefix_stream, resolve_options, train_task
from griffin.training import StopRequest

LENGTHS_FILE = "lengths.json"


def finished_run(directory: Path, task: Task, options: dict[str, Any]) -> SynthResult | None:
    """The run in ``directory`` if it finished training ``task`` with the same settings (:func:`resolve_options`)."""
    path = directory / RESULT_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    same = data.get("task") == task.to_dict() and data.get("options") == json.loads(json.dumps(options))
    done = data.get("steps") == options["steps"] or data.get("stopped_early", False)
    return SynthResult(**data) if same and done else None


def _fmt(value: float | int | None, pattern: str = "{:.3f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return pattern.format(value)


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    longest = any(r.get("lengths") for r in rows)
    head = ["family", "parameters", "steps to 90%", "steps to 99%", "final accuracy", "perfect sequences"]
    head += ["accuracy at longest length", "evaluation at lengths (s)"] if longest else []
    head += ["training wall time (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["family"], f"{r['parameters']:,}", _fmt(r["steps_to_90"], "{}"), _fmt(r["steps_to_99"], "{}"),
                 _fmt(r["accuracy"]), _fmt(r["perfect"])]
        if longest:
            last = r["lengths"][-1] if r.get("lengths") else None
            cells.append(f"{last['accuracy']:.3f} at {last['length']:,}" if last else "—")
            cells.append(_fmt(r.get("lengths_wall_s"), "{:.0f}"))
        cells.append(f"{r['wall_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(task: Task, out: str | Path, families: Sequence[str] = FAMILIES, *, lengths: Sequence[int] = (),
            attention_max_length: int = 8192, eval_length_sequences: int = 32, eval_batch_size: int = 8,
            chunk_size: int = 1024, progress: bool = True, tensorboard: bool = True, threads: int = 0,
            stop: StopRequest | None = None, **train_options: Any) -> dict[str, Any]:
    """Train each family on ``task`` with the same ``train_options`` (budget, learning rate, seed) into
    ``out/FAMILY``, evaluate at ``lengths`` (global attention only up to ``attention_max_length``: its cost grows
    with the square of the length), and write the plots, ``compare.json`` and ``table.md``. ``stop``: see
    :func:`~griffin.synth.train.train_task` (the same call again resumes the comparison)."""
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose among {', '.join(FAMILIES)}")
    if not families:
        raise ValueError("give at least one family")
    init = train_options.pop("init", None)  # an earlier comparison: each family starts from its own run there
    family_options = {family: dict(train_options, init=None if init is None else str(Path(init) / family))
                      for family in families}
    options = {family: resolve_options(task, **family_options[family]) for family in families}  # all checked first
    for family in families:
        check_prefix_stream(family, options[family])
    if init is not None:
        for family in families:
            check_init(options[family]["init"], task, family)
    lengths = [int(n) for n in lengths]
    for n in lengths:  # checked before any training
        task.with_length(n)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in families:
        directory = out / family
        result = finished_run(directory, task, options[family])
        if result is None:
            resume = (directory / "checkpoints").is_dir()
            result = train_task(task, family, directory, resume=resume, progress=progress, tensorboard=tensorboard,
                                threads=threads, stop=stop, **family_options[family])
        row = result.to_dict()
        row["lengths"] = []
        family_lengths = [n for n in lengths if "attention" not in _block_types(directory) or n <= attention_max_length]
        settings = {"lengths": family_lengths, "sequences": eval_length_sequences, "wall_s": result.wall_s}
        done = directory / LENGTHS_FILE
        previous = json.loads(done.read_text()) if done.is_file() else {}
        if family_lengths and previous.get("settings") == settings:  # this very model, evaluated alike before
            row["lengths"], row["lengths_wall_s"] = previous["lengths"], previous["wall_s"]
        elif family_lengths:
            start = time.perf_counter()
            model = load_pretrained(directory)
            row["lengths"] = evaluate_lengths(model, task, family_lengths, sequences=eval_length_sequences,
                                              batch_size=eval_batch_size, chunk_size=chunk_size, progress=progress)
            row["lengths_wall_s"] = time.perf_counter() - start
            write_json(done, {"task": task.to_dict(), "family": family, "lengths": row["lengths"],
                              "wall_s": row["lengths_wall_s"], "settings": settings})
        rows.append(row)
    title = f"{task.name} (T={task.seq_len})"
    plot_accuracy({r["family"]: [(h["step"], h["accuracy"]) for h in r["history"]] for r in rows},
                  out / "accuracy.png", title)
    if lengths:
        plot_lengths({r["family"]: [(m["length"], m["accuracy"]) for m in r["lengths"]] for r in rows},
                     out / "lengths.png", f"{task.name}: trained at T={task.seq_len}", task.seq_len)
    summary = {"task": task.to_dict(), "families": list(families), "options": {**options[families[0]], "init": init},
               "lengths": lengths, "attention_max_length": attention_max_length,
               "eval_length_sequences": eval_length_sequences,
               "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "platform": platform.platform()},
               "runs": rows}
    write_json(out / "compare.json", summary)
    atomic_write(out / "table.md", lambda tmp: Path(tmp).write_text(table(rows)))
    return summary


def _block_types(directory: Path) -> tuple[str, ...]:
    return tuple(json.loads((directory / "config.json").read_text())["block_types"])
