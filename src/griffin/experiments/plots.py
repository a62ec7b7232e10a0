"""The experiments' figures (matplotlib PNG, written atomically): Figure 1a, Figure 5 (right), Appendix F's bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from griffin.io import atomic_write

COLORS = {"mqa": "tab:blue", "hawk": "tab:orange", "griffin": "tab:green", "mqa-local": "tab:gray"}


def _figure(width: float = 6.4, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height), dpi=120)


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def _plain_log_ticks(ax: Any) -> None:
    """Log axes labelled at the powers of ten (x) and with plain numbers (y), minor x ticks unlabelled."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))


def plot_scaling(points: dict[str, list[tuple[float, float, str]]], fits: dict[str, Any], path: Path) -> None:
    """Held-out loss against training FLOPs, log-log, with each family's fitted power law (Figure 1a)."""
    import numpy as np

    plt, fig, ax = _figure()
    for family, pts in points.items():
        color = COLORS.get(family)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, label=family)
        if family in fits:
            fit = fits[family]
            c = np.geomspace(min(p[0] for p in pts) / 1.3, max(p[0] for p in pts) * 1.3, 50)
            ax.plot(c, fit.predict(c), "-", color=color, lw=1.2, alpha=0.8,
                    label=f"{family}: L = {fit.a:.3g}·C^-{fit.b:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("held-out loss (nats / token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_long_context(curves: dict[str, tuple[dict[str, Any], dict[str, Any]]], path: Path) -> None:
    """Loss by token position (log-spaced buckets) of each family trained at T (solid) and 4T (dashed)."""
    plt, fig, ax = _figure()
    lengths = sorted({tags["train_length"] for tags, _ in curves.values()})
    for _name, (tags, pp) in curves.items():
        mid = [(a * max(b - 1, a)) ** 0.5 for a, b in zip(pp["bucket_start"], pp["bucket_end"], strict=True)]
        style = "-" if tags["train_length"] == lengths[0] else "--"
        ax.plot(mid, pp["bucket_loss"], style, marker="o", ms=3, color=COLORS.get(tags["family"]),
                label=f"{tags['family']} trained at {tags['train_length']}")
    for n in lengths:
        ax.axvline(n, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean loss (nats / token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_window(table: dict[int, dict[str, float]], path: Path) -> None:
    """Validation loss of each model and window, grouped by training length, the window above each bar (Appendix F)."""
    plt, fig, ax = _figure(7.5, 4.2)
    lengths = sorted(table)
    labels = list(dict.fromkeys(k for row in table.values() for k in row))
    width = 0.8 / len(labels)
    low = min(v for row in table.values() for v in row.values())
    high = max(v for row in table.values() for v in row.values())
    shown: set[str] = set()
    for j, label in enumerate(labels):
        model, window = label.rsplit(" ", 1)
        xs = [i + (j - (len(labels) - 1) / 2) * width for i, n in enumerate(lengths) if label in table[n]]
        ys = [table[n][label] for n in lengths if label in table[n]]
        bars = ax.bar(xs, ys, width, color=COLORS.get(model), edgecolor="black", lw=0.4,
                      label=None if model in shown else model)
        shown.add(model)
        for bar in bars:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), window.removeprefix("w"), ha="center",
                    va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(lengths)), [f"T = {n}" for n in lengths])
    ax.set_ylim(low - 0.1 * (high - low) - 0.01, high + 0.15 * (high - low) + 0.01)
    ax.set_ylabel("validation loss (nats / token)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    _save(plt, fig, path)
