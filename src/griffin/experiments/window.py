"""``griffin experiment window``: Griffin with local-attention windows {T/8, T/4, T/2}, the global-attention MQA
Transformer and MQA with local attention at the same windows, each trained at lengths T, 2T and 4T with the same
total tokens (the batch divided by the length factor, the steps fixed) (Appendix F: its bar chart).

The windows are fixed in tokens across the training lengths, as the paper keeps 1K, 2K and 4K across 2K, 4K and
8K. Every run has the same shape (:func:`griffin.experiments.scaling.shape`); its score is its final validation loss
at its own training length (the runs of one length share their held-out sequences).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from griffin.experiments.runner import Grid, Run
from griffin.experiments.scaling import budget_steps, length_run, shape

DEFAULTS = {"seq_len": 64, "batch_size": 32, "steps": 300, "width": 48, "depth": 3, "lr": 3e-3}


def window_grid(seq_len: int = DEFAULTS["seq_len"], batch_size: int = DEFAULTS["batch_size"],
                steps: int = DEFAULTS["steps"], width: int = DEFAULTS["width"], depth: int = DEFAULTS["depth"],
                budget: float = 1.0, lr: float = DEFAULTS["lr"], data: dict[str, Any] | None = None) -> Grid:
    """The 21 runs: at each length L in (T, 2T, 4T), Griffin and local MQA at windows T/8, T/4, T/2 and global MQA."""
    if seq_len % 8:
        raise ValueError(f"seq_len={seq_len} must be divisible by 8 (windows T/8, T/4, T/2)")
    if batch_size % 4:
        raise ValueError(f"batch_size={batch_size} must be divisible by 4 (the 4T runs use a quarter of it)")
    steps = budget_steps(budget, steps)
    windows = (seq_len // 8, seq_len // 4, seq_len // 2)
    runs = []
    for factor in (1, 2, 4):
        length = seq_len * factor
        variants = [("griffin", w, "griffin", None) for w in windows] + [("mqa", length, "mqa", None)]
        variants += [("mqa-local", w, "mqa", ("local_attention",) * depth) for w in windows]
        for label, window, family, blocks in variants:
            model = {**shape(width, depth, seq_len), "family": family, "attention_window": window}
            if blocks:
                model["block_types"] = list(blocks)
            settings = length_run(family, model, seq_len, factor, batch_size, steps, lr, 3, data)
            runs.append(Run(f"{label}-w{window}-T{length}", settings,
                            {"model": label, "window": window, "train_length": length}))
    meta = {"seq_len": seq_len, "windows": list(windows), "steps": steps,
            "tokens_per_run": steps * batch_size * seq_len}
    return Grid("window", runs, meta)


def analyse(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """The bar chart and a table of validation loss by model and window at each training length; the claims checked:
    Griffin's best window beats global MQA at every length, local MQA is worse than global MQA."""
    from griffin.experiments.plots import plot_window
    from griffin.io import write_json

    table: dict[int, dict[str, float]] = {}
    for r in results["runs"]:
        t = r["tags"]
        label = "mqa global" if t["model"] == "mqa" else f"{t['model']} w{t['window']}"
        table.setdefault(t["train_length"], {})[label] = r["summary"]["val_loss"]
    lengths = sorted(table)
    labels = list(dict.fromkeys(k for row in table.values() for k in row))
    rows = ["| model, window | " + " | ".join(f"T = {n}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for label in labels:
        rows.append(f"| {label} | " + " | ".join(f"{table[n][label]:.4f}" if label in table[n] else ""
                                                 for n in lengths) + " |")
    claims = {}
    for n in lengths:
        row = table[n]
        griffin = {k: v for k, v in row.items() if k.startswith("griffin")}
        local = {k: v for k, v in row.items() if k.startswith("mqa-local")}
        glob = [v for k, v in row.items() if k == "mqa global"]
        claims[n] = {"every_griffin_beats_global_mqa": bool(glob) and all(v < glob[0] for v in griffin.values()),
                     "griffin_smallest_window_beats_global_mqa": bool(glob) and bool(griffin)
                     and griffin[min(griffin, key=lambda k: int(k.split("w")[-1]))] < glob[0],
                     "every_local_mqa_worse_than_global": bool(glob) and all(v > glob[0] for v in local.values())}
    summary = {"val_loss": {str(n): table[n] for n in lengths}, "claims": {str(n): c for n, c in claims.items()},
               "table": "\n".join(rows)}
    write_json(out / "window.json", summary)
    plot_window(table, out / "window.png")
    return summary
