"""``griffin experiment long-context``: each family trained on sequences of T and of 4T tokens with the same total
tokens and steps (the batch divided by 4), then scored by token position up to 16T on held-out documents
(Section 6.1, Figure 5 right: do models trained on longer sequences use longer contexts, and what do they lose on
short ones?).

Every run has the same model shape (:func:`griffin.experiments.scaling.shape`, Griffin's local-attention window fixed
at T/2 for both lengths, as the paper keeps 1024 for 2K and 8K); the evaluation is
:func:`griffin.evaluation.loss.per_position_loss` (streamed with a fixed-size state for Hawk and Griffin) over
windows of 16T tokens cut one after another from the validation documents, each scored from a fresh state (the
paper's held-out books are long enough to give many such windows; a corpus of source files has few documents of
16T tokens, whose first lines, licence headers and imports, would otherwise dominate the short positions).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from griffin.config import FAMILIES
from griffin.experiments.runner import Grid, Run
from griffin.experiments.scaling import budget_steps, check_families, length_run, shape

DEFAULTS = {"seq_len": 128, "batch_size": 32, "steps": 400, "width": 64, "depth": 3, "eval_factor": 16,
            "max_windows": 128, "lr": 3e-3}


def long_context_grid(families: tuple[str, ...] = FAMILIES, seq_len: int = DEFAULTS["seq_len"],
                      batch_size: int = DEFAULTS["batch_size"], steps: int = DEFAULTS["steps"],
                      width: int = DEFAULTS["width"], depth: int = DEFAULTS["depth"], budget: float = 1.0,
                      lr: float = DEFAULTS["lr"], data: dict[str, Any] | None = None) -> Grid:
    """Each family at T = ``seq_len`` (``batch_size`` sequences) and at 4T (``batch_size`` / 4), ``budget`` x
    ``steps`` steps each: the same tokens for both lengths."""
    check_families(families)
    if batch_size % 4:
        raise ValueError(f"batch_size={batch_size} must be divisible by 4 (the 4T runs use a quarter of it)")
    steps = budget_steps(budget, steps)
    runs = []
    for family in families:
        for factor in (1, 4):
            length = seq_len * factor
            model = {"family": family, **shape(width, depth, seq_len)}  # window T/2 for both; vocabulary: the data's
            settings = length_run(family, model, seq_len, factor, batch_size, steps, lr, 4, data)
            runs.append(Run(f"{family}-T{length}", settings, {"family": family, "train_length": length}))
    meta = {"seq_len": seq_len, "eval_length": DEFAULTS["eval_factor"] * seq_len, "steps": steps,
            "tokens_per_run": steps * batch_size * seq_len}
    return Grid("long-context", runs, meta)


def windows(documents: Iterable[np.ndarray], length: int) -> Iterator[np.ndarray]:
    """Consecutive, non-overlapping windows of ``length`` tokens of each document (a shorter tail is left out)."""
    for doc in documents:
        for start in range(0, len(doc) - length + 1, length):
            yield doc[start : start + length]


def per_position_evaluation(max_length: int, max_windows: int = DEFAULTS["max_windows"]):
    """The evaluation of each finished run: the loss by position up to ``max_length`` on the first ``max_windows``
    windows of that length of the validation documents (the same windows for every run)."""

    def evaluate(run: Run, run_dir: Path, data: Path) -> dict[str, Any]:
        from griffin.evaluation.documents import prepared_documents
        from griffin.evaluation.loss import per_position_loss
        from griffin.interop import load_pretrained

        model = load_pretrained(run_dir / "checkpoints" / "latest").eval()
        result = per_position_loss(model, windows(prepared_documents(data, "val"), max_length), max_length,
                                   chunk_size=512, batch_size=8, max_documents=max_windows, progress=False)
        return {"per_position": result.to_dict()}

    return evaluate


def analyse(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Figure 5 (right): loss by position of the T and 4T runs of each family; which length wins where."""
    from griffin.experiments.plots import plot_long_context
    from griffin.io import write_json

    curves = {r["name"]: (r["tags"], r["evaluation"]["per_position"]) for r in results["runs"]}
    rows = ["| family | trained at | " + " | ".join(f"[{a}, {b})" for a, b in zip(
        next(iter(curves.values()))[1]["bucket_start"], next(iter(curves.values()))[1]["bucket_end"], strict=True))
        + " |"]
    rows.append("|---|---|" + "---|" * len(next(iter(curves.values()))[1]["bucket_loss"]))
    for _name, (tags, pp) in curves.items():
        rows.append(f"| {tags['family']} | {tags['train_length']} | " + " | ".join(f"{v:.3f}" for v in
                                                                                 pp["bucket_loss"]) + " |")
    verdict = {}
    for family in dict.fromkeys(t["family"] for t, _ in curves.values()):
        pair = sorted((t["train_length"], pp) for t, pp in curves.values() if t["family"] == family)
        (short_len, short), (long_len, long) = pair[0], pair[-1]
        beyond = [i for i, a in enumerate(short["bucket_start"]) if a >= long_len]
        within = [i for i, b in enumerate(short["bucket_end"]) if b <= short_len]
        verdict[family] = {
            "long_better_beyond_4T": all(long["bucket_loss"][i] < short["bucket_loss"][i] for i in beyond),
            "short_better_within_T": sum(short["bucket_loss"][i] for i in within) / max(1, len(within))
            < sum(long["bucket_loss"][i] for i in within) / max(1, len(within)),
            "mean_loss_beyond_4T": {short_len: _mean(short["bucket_loss"], beyond),
                                    long_len: _mean(long["bucket_loss"], beyond)},
            "mean_loss_within_T": {short_len: _mean(short["bucket_loss"], within),
                                   long_len: _mean(long["bucket_loss"], within)}}
    summary = {"verdict": verdict, "table": "\n".join(rows)}
    write_json(out / "long_context.json", summary)
    plot_long_context(curves, out / "long_context.png")
    return summary


def _mean(values: list[float], index: list[int]) -> float | None:
    return sum(values[i] for i in index) / len(index) if index else None
