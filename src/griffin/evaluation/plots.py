"""Plots of evaluations (matplotlib, Agg backend), written atomically: loss per token position, several checkpoints
overlaid (Figure 5), and phonebook accuracy against book length (Figure 6c)."""

from __future__ import annotations

from pathlib import Path

from griffin.evaluation.loss import PerPositionResult
from griffin.evaluation.phonebook import PhonebookResult
from griffin.io import atomic_write


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)


def plot_per_position(results: dict[str, PerPositionResult], path: str | Path,
                      train_lengths: dict[str, int] | None = None, title: str = "") -> None:
    """Mean loss in each log-spaced position bucket (at the bucket's geometric centre), one line per checkpoint,
    a dotted line at each training length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in results.items():
        centres = [((a * (b - 1)) ** 0.5) for a, b in zip(r.bucket_start, r.bucket_end, strict=True)]
        line, = ax.plot(centres, r.bucket_loss, marker="o", ms=3, label=f"{label} ({r.documents} docs)")
        if train_lengths and label in train_lengths:
            ax.axvline(train_lengths[label], color=line.get_color(), ls=":", lw=1)
    if train_lengths:
        ax.plot([], [], color="gray", ls=":", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position")
    ax.set_ylabel("mean loss (nats/token)")
    ax.set_title(title or "Held-out loss by token position")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    _save(fig, Path(path))


def plot_phonebook(results: dict[str, PhonebookResult], path: str | Path, title: str = "") -> None:
    """Accuracy (mean +- std over seeds) against the number of phonebook entries, one line per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in results.items():
        ax.errorbar(r.entries, r.mean, yerr=r.std, marker="o", ms=3, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("phonebook entries")
    ax.set_ylabel("lookup accuracy")
    ax.set_title(title or "Phonebook lookup")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    _save(fig, Path(path))
