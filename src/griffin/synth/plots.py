"""The plots of Figure 6a/6b: held-out accuracy against training steps, and against evaluation length (log axis)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from griffin.io import atomic_write
from griffin.synth.evaluate import run_root
from griffin.training.checkpoint import TRAINER_STATE

COLORS = {"mqa": "tab:blue", "hawk": "tab:orange", "griffin": "tab:green"}
LABELS = {"mqa": "MQA Transformer", "hawk": "Hawk", "griffin": "Griffin"}


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    return plt, fig, ax


def _legend(fig, ax, curves: int) -> None:
    """Inside the axes for a few curves; to the right of them for more, where it would hide some."""
    if curves <= 4:
        ax.legend()
        return
    fig.set_size_inches(9.0, 4.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def _style(i: int, name: str) -> tuple[str, str]:
    """The i-th curve's format and colour: a family's own colour, else the colour cycle's i-th; past its ten colours
    the line and marker change, so that no two of up to thirty curves look alike."""
    return ("o-", "s--", "^:")[i // 10 % 3], COLORS.get(name, f"C{i % 10}")


def _finish(plt, fig, ax, path: Path, xlabel: str, title: str, curves: int, log2: bool = False) -> None:
    """The axes every plot here shares (held-out accuracy in [0, 1]), the legend, the file."""
    if log2:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(fig, ax, curves)
    _save(plt, fig, path)


def plot_accuracy(curves: dict[str, Sequence[tuple[int, float]]], path: str | Path, title: str) -> None:
    """Accuracy on the held-out set against the training step, one line per family (Figure 6a)."""
    plt, fig, ax = _figure()
    for i, (name, points) in enumerate(curves.items()):
        if points:
            steps, acc = zip(*points, strict=True)
            fmt, color = _style(i, name)
            ax.plot(steps, acc, fmt, ms=3, lw=1.5, label=LABELS.get(name, name), color=color)
    _finish(plt, fig, ax, path, "training step", title, len(curves))


def run_curve(directory: str | Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every evaluation in a run's ``log.jsonl``, finished or not (a resumed run's
    repeated steps: the last record of each). For one of a run's checkpoints (``DIR/checkpoints/NAME``): the run's
    evaluations up to the checkpoint's step."""
    import json

    directory, last = Path(directory), None
    if run_root(directory) != directory and (directory / TRAINER_STATE).is_file():  # a checkpoint: to its step
        last = int(json.loads((directory / TRAINER_STATE).read_text())["step"])
        directory = run_root(directory)
    log = directory / "log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{directory} holds no log.jsonl: not a `griffin synth` run directory or one of its "
                                "checkpoints")
    points: dict[int, float] = {}
    for line in log.read_text().splitlines():
        if line.endswith("}"):  # a line cut short by a killed run is skipped
            record = json.loads(line)
            if record.get("kind") == "eval" and "accuracy" in record and (last is None or record["step"] <= last):
                points[int(record["step"])] = float(record["accuracy"])
    if not points:
        raise ValueError(f"{log} has no evaluation yet")
    return sorted(points.items())


def plot_lengths(curves: dict[str, Sequence[tuple[int, float]]], path: str | Path, title: str,
                 train_length: int | None = None) -> None:
    """Accuracy against the evaluation sequence length on a log axis, one line per family (Figure 6b)."""
    plt, fig, ax = _figure()
    for i, (name, points) in enumerate(curves.items()):
        if points:
            lengths, acc = zip(*points, strict=True)
            fmt, color = _style(i, name)
            ax.plot(lengths, acc, fmt, ms=4, lw=1.5, label=LABELS.get(name, name), color=color)
    if train_length:
        ax.axvline(train_length, ls="--", color="gray", lw=1, label=f"training length ({train_length})")
    _finish(plt, fig, ax, path, "evaluation sequence length", title, len(curves), log2=True)


def plot_silenced_prefix(record: dict, path: str | Path, title: str) -> None:
    """Accuracy against the recall distance (the middle of each distance bin, log axis) at each evaluated length, as
    trained (solid) and with the RG-LRU writes before the trigger silenced (dashed): ``griffin synth eval
    --silence-prefix --distance-bins K``'s ``lengths.json`` record."""
    plt, fig, ax = _figure()
    pairs = zip(record["lengths"], record["silenced_prefix"], strict=True)
    for i, (plain, silenced) in enumerate(pairs):
        for r, style, what in ((plain, "o-", "as trained"), (silenced, "s--", "prefix silenced")):
            points = [((b["from"] + b["to"] - 1) / 2, b["accuracy"]) for b in r["by_distance"] if b["answers"]]
            if points:
                ax.plot(*zip(*points, strict=True), style, ms=4, lw=1.5, color=f"C{i}",
                        label=f"length {r['length']:,}, {what}")
    _finish(plt, fig, ax, path, "recall distance (tokens from the answer to the final trigger)", title,
            2 * len(record["lengths"]), log2=True)


def plot_answer_channels(record: dict, path: str | Path, title: str) -> None:
    """Each recurrent block's answer-to-interference ratio in its answer channel against the evaluation length (both
    log axes; 1 dashed: where the answer no longer stands out), with the accuracy at each length on a second axis:
    ``griffin synth eval --answer-channels``'s ``lengths.json`` record."""
    plt, fig, ax = _figure()
    rows = record["answer_channels"]
    lengths = [r["length"] for r in rows]
    for i, block in enumerate(b["block"] for b in rows[0]["blocks"]):
        ratios = [max(next(b["ratio"] for b in r["blocks"] if b["block"] == block), 1e-12) for r in rows]
        ax.plot(lengths, ratios, "o-", ms=4, lw=1.5, color=f"C{i}", label=f"block {block}")
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(1e-3, None)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("answer / rest of the state, answer channel")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    acc = {r["length"]: r["accuracy"] for r in record["lengths"]}
    if all(n in acc for n in lengths):
        right = ax.twinx()
        right.plot(lengths, [acc[n] for n in lengths], "k:", marker="x", lw=1.5, label="accuracy")
        right.set_ylim(-0.02, 1.02)
        right.set_ylabel("held-out accuracy (dotted)")
    ax.legend(loc="lower left", fontsize="small")  # inside: the accuracy's axis takes the right
    _save(plt, fig, path)


def run_lengths(directory: str | Path) -> list[tuple[int, float]]:
    """(evaluation length, accuracy) from a run's ``lengths.json`` (``griffin synth eval``); [] for a run not
    evaluated at other lengths."""
    import json

    path = Path(directory) / "lengths.json"
    if not path.is_file():
        return []
    return sorted((int(r["length"]), float(r["accuracy"])) for r in json.loads(path.read_text())["lengths"])
