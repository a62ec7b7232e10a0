"""``griffin experiment scaling``: held-out loss against training FLOPs for a ladder of sizes of each family, with a
power law fitted per family (Section 3.1, Figure 1a).

The shape rules (Appendix C, Table 5), applied to every rung of every family:

- width D and depth N from the ladder; recurrent width D_RNN = 4D/3 rounded to a multiple of 16; MLP expansion 3;
- heads of dimension 128 (D/128 heads, the paper's) from D = 256 on; below, two heads of dimension D/2 (D/128
  would be less than one head); one key/value head (MQA) throughout;
- RG-LRU gates in min(16, D_RNN/16) diagonal blocks; Griffin's local-attention window T/2 (the paper's 1024 at
  T = 2048).

Training: tokens = ``tokens_per_parameter`` x parameters x ``budget`` (Chinchilla's 20 tokens per parameter, the
paper's ratio: 1.9B tokens at 100M), all rungs at the same sequence length and batch on the same data; one learning
rate rule across sizes, lr(D) = ``lr`` x sqrt(``lr_width`` / D); 5% of the steps (at least 10) of linear warm-up,
then cosine decay to 10%. The held-out loss of a rung is its final validation loss on the same fixed held-out
sequences for every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from griffin.config import FAMILIES, PAPER_SIZES
from griffin.experiments.runner import Grid, Run

#: Training tokens of the paper's rungs (Appendix C, Table 5: "Training Tokens (Optimal Scaling)").
PAPER_TOKENS = {"100m": 1.9e9, "200m": 3.9e9, "400m": 7.8e9, "1.3b": 25e9, "3b": 60e9, "7b": 132.5e9, "14b": 300e9}
MIN_STEPS = 50


def check_families(families: tuple[str, ...]) -> None:
    """Refuse a family name that is not one of :data:`griffin.config.FAMILIES`."""
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; the families are {', '.join(FAMILIES)}")


def budget_steps(budget: float, steps: int) -> int:
    """``budget`` x ``steps`` optimizer steps, refused below :data:`MIN_STEPS`."""
    scaled = int(round(budget * steps))
    if scaled < MIN_STEPS:
        raise ValueError(f"--budget={budget:g} leaves {scaled} steps per run, fewer than {MIN_STEPS}: raise --budget")
    return scaled


def length_run(family: str, model: dict[str, Any], seq_len: int, factor: int, batch_size: int, steps: int, lr: float,
               evaluations: int, data: dict[str, Any] | None) -> dict[str, Any]:
    """The settings of a run at ``factor`` x ``seq_len`` with ``batch_size`` / ``factor`` sequences and the steps
    fixed (the same tokens at every length: Section 6.1, Appendix F), evaluated ``evaluations`` times on
    4 x ``factor`` held-out batches (the same held-out tokens at every length)."""
    return {**(data or {}), "preset": f"{family}-tiny", "model": model, "seq_len": seq_len * factor,
            "batch_size": batch_size // factor, "max_steps": steps, "warmup_steps": max(10, steps // 20), "lr": lr,
            "eval_interval": max(1, steps // evaluations), "ckpt_interval": max(1, steps // evaluations),
            "eval_batches": 4 * factor, "keep_last": 1}


def shape(width: int, depth: int, seq_len: int, rnn_width: int | None = None, heads: int | None = None) -> dict:
    """The ModelConfig fields of a rung of width D and depth N, by the rules of the module docstring (the paper's
    own D_RNN and heads where given)."""
    if width % (128 if width >= 256 else 8):
        raise ValueError(f"width={width} must be a multiple of 8 (two heads, RoPE on half of each), and of 128 "
                         "from 256 on (heads of dimension 128)")
    rnn = rnn_width or 16 * max(1, round(4 * width / 3 / 16))
    head_dim = 128 if width >= 256 else width // 2
    return {"width": width, "depth": depth, "rnn_width": rnn, "mlp_expansion": 3,
            "num_heads": heads or width // head_dim, "head_dim": head_dim, "num_kv_heads": 1,
            "gate_blocks": min(16, rnn // 16), "attention_window": max(1, seq_len // 2)}


@dataclass
class Ladder:
    """A ladder of sizes trained for every family (the CPU default, or the paper's from a config file)."""

    rungs: list[dict[str, Any]]  # each: name, width, depth (and optionally rnn_width, heads, tokens, families)
    families: tuple[str, ...] = FAMILIES
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    tokens_per_parameter: float = 20.0
    lr: float = 3e-3
    lr_width: int = 128
    vocab_size: int = 256
    train: dict[str, Any] = field(default_factory=dict)  # further griffin train settings for every run

    def grid(self, budget: float = 1.0, data: dict[str, Any] | None = None) -> Grid:
        """The runs: every family at every rung, ``budget`` x the tokens of each."""
        from griffin.model import count_parameters
        from griffin.training import TrainConfig

        if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
            raise ValueError(f"--budget={budget!r} must be a positive number")
        runs = []
        tokens_per_step = self.batch_size * self.grad_accum * self.seq_len
        for rung in self.rungs:
            check_families(rung.get("families", self.families))
            for family in rung.get("families", self.families):
                model = {"family": family, "vocab_size": self.vocab_size,
                         **shape(rung["width"], rung["depth"], self.seq_len, rung.get("rnn_width"), rung.get("heads"))}
                cfg = TrainConfig.from_dict({"preset": f"{family}-tiny", "model": model, "progress": False},
                                            source=f"rung {rung['name']}")
                params = count_parameters(cfg.model_config())
                tokens = budget * rung.get("tokens", self.tokens_per_parameter * params)
                steps = int(round(tokens / tokens_per_step))
                if steps < MIN_STEPS:
                    raise ValueError(f"--budget={budget:g} gives rung {rung['name']} ({family}, {params:,} "
                                     f"parameters) {steps} steps of {tokens_per_step:,} tokens, fewer than "
                                     f"{MIN_STEPS}: raise --budget")
                lr = self.lr * math.sqrt(self.lr_width / rung["width"])
                settings = {"warmup_steps": max(10, steps // 20), "eval_interval": max(1, steps // 4),
                            "ckpt_interval": max(1, steps // 4), **self.train, **(data or {}),
                            "preset": f"{family}-tiny", "model": model, "seq_len": self.seq_len,
                            "batch_size": self.batch_size, "grad_accum": self.grad_accum, "max_steps": steps, "lr": lr}
                runs.append(Run(f"{family}-{rung['name']}", settings,
                                {"family": family, "rung": rung["name"], "width": rung["width"],
                                 "depth": rung["depth"], "parameters": params, "tokens": steps * tokens_per_step}))
        meta = {"budget": budget, "seq_len": self.seq_len, "tokens_per_parameter": self.tokens_per_parameter,
                "lr_rule": f"lr = {self.lr:g} * sqrt({self.lr_width} / width)", "batch_size": self.batch_size}
        return Grid("scaling", runs, meta)


#: The CPU ladder: five widths from 32 to 64 (about 50K to 180K parameters), depth 3 (Griffin: two recurrent blocks
#: and one local-attention block), sequences of 128 bytes.
CPU_LADDER = Ladder(rungs=[{"name": f"d{w}", "width": w, "depth": 3} for w in (32, 40, 48, 56, 64)],
                    train={"eval_batches": 16, "log_interval": 10, "keep_last": 1})


def paper_ladder(path: str | Path) -> Ladder:
    """A ladder from a config file (``configs/experiments/scaling-paper.toml``: the paper's sizes and tokens)."""
    from griffin.training.config import read_toml

    data = read_toml(path)
    known = set(Ladder.__dataclass_fields__)
    unknown = sorted(set(data) - known - {"model"})
    if unknown:
        raise ValueError(f"{path}: unknown ladder key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
    rungs = data.get("rungs")
    if not isinstance(rungs, list) or not rungs:
        raise ValueError(f"{path}: needs [[rungs]] tables (name, width, depth, ...)")
    for rung in rungs:
        size = rung.get("size")
        if size is not None:  # the paper's shape and tokens by name
            if size not in PAPER_SIZES:
                raise ValueError(f"{path}: unknown size {size!r}; the paper's are {', '.join(PAPER_SIZES)}")
            width, rnn, depth, heads = PAPER_SIZES[size]
            rung.update({"name": rung.get("name", size), "width": width, "rnn_width": rnn, "depth": depth,
                         "heads": heads, "tokens": rung.get("tokens", PAPER_TOKENS[size])})
        for key in ("name", "width", "depth"):
            if key not in rung:
                raise ValueError(f"{path}: a rung lacks {key!r}: {rung}")
    fields = {k: v for k, v in data.items() if k != "model"}
    if "families" in fields:
        fields["families"] = tuple(fields["families"])
    return Ladder(**fields)


def scaling_grid(budget: float = 1.0, families: tuple[str, ...] | None = None, ladder: Ladder | None = None,
                 data: dict[str, Any] | None = None) -> Grid:
    """The scaling experiment's grid: ``ladder`` (the CPU ladder by default) for ``families``."""
    ladder = ladder or CPU_LADDER
    if families:
        check_families(families)
        ladder = Ladder(**{**ladder.__dict__, "families": tuple(families)})
    return ladder.grid(budget, data)


def analyse(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Fit loss = a * C^-b per family, write ``fits.json``, ``scaling.png`` and a Markdown table; return them."""
    import numpy as np

    from griffin.experiments.fit import crossover, fit_power_law, lowest_at
    from griffin.experiments.plots import plot_scaling
    from griffin.io import write_json

    points: dict[str, list[tuple[float, float, str]]] = {}
    for r in results["runs"]:
        points.setdefault(r["tags"]["family"], []).append((r["summary"]["flops"], r["summary"]["val_loss"],
                                                           r["tags"]["rung"]))
    fits = {}
    for family, pts in points.items():
        compute, loss = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        fits[family] = fit_power_law(compute, loss) if len(set(compute)) >= 2 else None
    budgets = sorted({p[0] for pts in points.values() for p in pts})
    usable = {f: fit for f, fit in fits.items() if fit is not None}
    lowest = lowest_at(usable, budgets) if usable else []
    rows = ["| family | rungs | exponent b | 95% interval | a | R² |", "|---|---|---|---|---|---|"]
    for family, fit in fits.items():
        if fit is None:
            rows.append(f"| {family} | {len(points[family])} | (one budget: no fit) | | | |")
            continue
        lo, hi = fit.b_ci95
        rows.append(f"| {family} | {fit.n} | {fit.b:.4f} ± {fit.b_stderr:.4f} | {lo:.4f} – {hi:.4f} | {fit.a:.3g} "
                    f"| {fit.r2:.3f} |")
    measured = ["| rung | " + " | ".join(points) + " |", "|---|" + "---|" * len(points)]
    rungs = list(dict.fromkeys(r["tags"]["rung"] for r in results["runs"]))
    for rung in rungs:
        cells = []
        for family in points:
            hit = [p for p in points[family] if p[2] == rung]
            cells.append(f"{hit[0][1]:.4f} at {hit[0][0]:.2e}" if hit else "")
        measured.append(f"| {rung} | " + " | ".join(cells) + " |")
    summary = {"fits": {f: (fit.to_dict() if fit else None) for f, fit in fits.items()},
               "lowest_fitted_at_budget": dict(zip([f"{b:.3e}" for b in budgets], lowest, strict=True)),
               "lowest_measured_at_rung": {rung: min(((p[1], f) for f in points for p in points[f] if p[2] == rung),
                                                     default=(None, None))[1] for rung in rungs},
               "crossovers": {f"{f} / {g}": crossover(usable[f], usable[g]) for i, f in enumerate(usable)
                              for g in list(usable)[i + 1:]},
               "table": "\n".join(rows), "measured": "\n".join(measured)}
    write_json(out / "fits.json", summary)
    plot_scaling(points, usable, out / "scaling.png")
    return summary
