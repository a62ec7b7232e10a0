"""``griffin synth TASK``: train one family on a synthetic task from scratch (Section 6.2), through the trainer.

The run uses :class:`griffin.training.Trainer` with a :class:`~griffin.synth.source.TaskSource` (AdamW, warm-up and
cosine decay, clipping, exact-resume checkpoints, ``log.jsonl``, TensorBoard, progress bar) and the
``{family}-synthetic`` preset (5 blocks, width 64, about 250K parameters; Griffin's local attention is the third
block) with the task's vocabulary and local-attention window. It ends with the final model in ``DIR``
(``config.json`` + ``model.safetensors``: ``griffin.load_pretrained(DIR)``), the task's spec in ``DIR/task.json``,
the accuracy curve in ``DIR/result.json`` and ``DIR/accuracy.png``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from griffin.config import FAMILIES
from griffin.interop import save_pretrained
from griffin.io import write_json
from griffin.synth.evaluate import TASK_FILE, run_files
from griffin.synth.plots import plot_accuracy
from griffin.synth.source import DRAWS, EPISODES, TaskSource, stream_options
from griffin.synth.tasks import Task
from griffin.training import StopRequest, TrainConfig, Trainer, TrainingStopped
from griffin.training.config import PRECISIONS

RESULT_FILE = "result.json"

# The training budgets of the CPU comparisons recorded in docs/experiments.md, where they ran on smaller instances
# of the tasks than the paper's (selective copying T=64 with 8 data tokens, induction heads T=32, MQAR T=32 with
# vocabulary 64 and 4 pairs: the commands are there), so that one family trains in minutes on 2 shared cores. The
# paper does not state its budget. Every value can be overridden.
BUDGETS: dict[str, dict[str, Any]] = {
    "selective_copying": {"steps": 2000, "batch_size": 16, "lr": 3e-3, "eval_every": 100, "eval_sequences": 64},
    "induction_heads": {"steps": 1500, "batch_size": 32, "lr": 3e-3, "eval_every": 50, "eval_sequences": 128},
    "mqar": {"steps": 400, "batch_size": 32, "lr": 3e-3, "eval_every": 50, "eval_sequences": 64},
}


@dataclass
class SynthResult:
    """What a run reached: the held-out curve, the steps to 90% and 99% accuracy, the final accuracy, the time."""

    task: dict[str, Any]
    family: str
    parameters: int
    steps: int
    history: list[dict[str, float]]  # one record per evaluation: step, accuracy, perfect, val_loss
    accuracy: float
    perfect: float
    steps_to_90: int | None
    steps_to_99: int | None
    wall_s: float
    generate_s: float
    out: str
    stopped_early: bool = False  # ended at options["stop_accuracy"] before options["steps"]
    options: dict[str, Any] = field(default_factory=dict)  # resolve_options()
    config: dict[str, Any] = field(default_factory=dict)  # the TrainConfig

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def steps_to(history: list[dict[str, float]], threshold: float) -> int | None:
    """The first evaluated step whose held-out accuracy is at least ``threshold`` (None if none)."""
    return next((int(r["step"]) for r in history if r["accuracy"] >= threshold), None)


def resolve_options(task: Task, *, steps: int | None = None, batch_size: int | None = None, lr: float | None = None,
                    seed: int = 0, eval_every: int | None = None, eval_sequences: int | None = None,
                    window: int | None = None, warmup_steps: int | None = None, weight_decay: float = 0.1,
                    model: dict[str, Any] | None = None, stop_accuracy: float | None = None,
                    compile: bool = False, precision: str = "auto", compile_fallback: bool = False,
                    init: str | None = None, prefix_stream: bool = False, stream_recall: int = 0,
                    recall_episodes: str = EPISODES[0], recall_draw: str = DRAWS[0],
                    stream_advance: int | None = None) -> dict[str, Any]:
    """The training settings of a run: the given ones, the task's budget (:data:`BUDGETS`) for those left None.
    ``stop_accuracy``: end the run at the first evaluation whose held-out accuracy reaches it (None: train every
    step); ``compile``: the trainer's compiled step (``griffin train --compile``); ``precision``: the trainer's
    (``auto``, ``fp32`` or ``bf16`` autocast; ``griffin train --precision``); ``compile_fallback``: where the compiled
    step cannot run, train the uncompiled one instead of refusing (``griffin train --compile-fallback``); ``init``:
    start from the model of another ``griffin synth`` run of the same task and family (e.g. trained at a shorter
    length) instead of a new one; ``prefix_stream``: each training sequence continues a stream of the task's filler
    (:mod:`griffin.synth.source`; induction heads, Hawk and Griffin); ``stream_recall`` K: half the rows recall an
    answer their stream took in up to K steps before (with ``prefix_stream``), written where ``recall_episodes`` says
    (:data:`griffin.synth.source.EPISODES`), k steps back drawn as ``recall_draw`` says (``DRAWS``);
    ``stream_advance``: the filler tokens the stream takes in each step (None: the sequence length)."""
    budget = BUDGETS[task.name]
    opts: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "lr": lr, "eval_every": eval_every,
                            "eval_sequences": eval_sequences}
    opts = {k: budget[k] if v is None else v for k, v in opts.items()}
    # default: the paper's window for the task, at most half the sequence (the paper's ratio), so that a shorter
    # --seq-len keeps attention local
    opts["window"] = min(task.window, max(1, task.seq_len // 2)) if window is None else window
    for name in ("steps", "batch_size", "eval_every", "eval_sequences", "window"):
        value = opts[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if warmup_steps is None:
        warmup_steps = min(50, opts["steps"] // 10)
    if isinstance(opts["lr"], bool) or not isinstance(opts["lr"], (int, float)) or not opts["lr"] > 0:
        raise ValueError(f"lr={opts['lr']!r} must be a positive number")
    if stop_accuracy is not None and (isinstance(stop_accuracy, bool) or not isinstance(stop_accuracy, (int, float))
                                      or not 0 < stop_accuracy <= 1):
        raise ValueError(f"stop_accuracy={stop_accuracy!r} must be a number in (0, 1]")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    if init is not None and model:
        raise ValueError(f"model overrides {sorted(model)} with init={init!r}: a run started from another keeps its "
                         "model")
    opts.update(stream_options(task, opts["batch_size"], prefix_stream=prefix_stream, stream_recall=stream_recall,
                               recall_episodes=recall_episodes, recall_draw=recall_draw,
                               stream_advance=stream_advance))
    opts.update(seed=seed, warmup_steps=warmup_steps, weight_decay=weight_decay, model=dict(model or {}),
                stop_accuracy=stop_accuracy, compile=bool(compile), precision=precision,
                compile_fallback=bool(compile_fallback), init=None if init is None else str(init))
    return opts


def check_prefix_stream(family: str, opts: dict[str, Any]) -> None:
    """Refuse the prefix stream for MQA: its global attention has no fixed-size state to continue."""
    if opts.get("prefix_stream") and family == "mqa":
        raise ValueError("--prefix-stream: MQA's global attention has no fixed-size state to continue (Hawk and "
                         "Griffin have one); leave MQA out of this run")


def check_init(init: str | Path, task: Task, family: str) -> None:
    """Refuse to start a run of ``family`` on ``task`` from ``init`` unless it is a ``griffin synth`` run of the same
    task (any length) and family, or one of its checkpoints."""
    import json

    try:
        trained, _ = run_files(init)
    except FileNotFoundError as err:
        raise ValueError(f"init={init}: {err}") from None
    if trained.name != task.name or trained.vocab_size != task.vocab_size:
        raise ValueError(f"init={init} was trained on {trained}, this run is {task}: start from a run of the same "
                         "task and vocabulary")
    config = json.loads((Path(init) / "config.json").read_text())
    if config.get("family") != family:
        raise ValueError(f"init={init} holds a {config.get('family')} model, this run trains {family}")


class _RunStop:
    """The trainer's stop request for a run: ``request`` set (SIGTERM), or ``reached()`` (the accuracy target)."""

    def __init__(self, request: StopRequest | None, reached: Callable[[], bool], why: str) -> None:
        self.request, self.reached, self.why = request, reached, why

    def is_set(self) -> bool:
        return (self.request is not None and self.request.is_set()) or self.reached()

    @property
    def reason(self) -> str:
        return self.request.reason if self.request is not None and self.request.reason else self.why


def train_task(task: Task, family: str, out: str | Path, *, resume: bool = False, progress: bool = True,
               tensorboard: bool = True, threads: int = 0, ckpt_every: int | None = None,
               stop: StopRequest | None = None, **options: Any) -> SynthResult:
    """Train ``family`` on ``task`` into ``out``; ``options`` are those of :func:`resolve_options` (steps,
    batch_size, lr, seed, eval_every, eval_sequences, window, warmup_steps, weight_decay, model overrides).
    ``stop`` (SIGTERM in ``griffin synth``): once set, the run writes the checkpoint of its step and raises
    :class:`~griffin.training.TrainingStopped`; ``resume=True`` continues it exactly."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    opts = resolve_options(task, **options)
    check_prefix_stream(family, opts)
    steps, batch_size, eval_every = opts["steps"], opts["batch_size"], opts["eval_every"]
    overrides = {"vocab_size": task.vocab_size, "attention_window": opts["window"], **opts["model"]}
    if opts["init"] is not None:
        check_init(opts["init"], task, family)
        overrides = {"attention_window": opts["window"]}  # the only field a run from another may change
    out = Path(out)
    cfg = TrainConfig(
        preset=f"{family}-synthetic", model=overrides, init=opts["init"] or "",
        seq_len=task.seq_len, batch_size=batch_size, max_steps=steps,
        lr=opts["lr"], warmup_steps=opts["warmup_steps"], weight_decay=opts["weight_decay"], eval_interval=eval_every,
        log_interval=min(10, eval_every), ckpt_interval=ckpt_every or max(eval_every, steps // 4), out=str(out),
        resume="auto" if resume else "", seed=opts["seed"], tensorboard=tensorboard, progress=progress, threads=threads,
        sample_tokens=0, data=f"synthetic:{task.name}", compile=opts["compile"], precision=opts["precision"],
        compile_fallback=opts["compile_fallback"],
    )
    source = TaskSource(task, batch_size, seed=opts["seed"], eval_sequences=opts["eval_sequences"],
                        prefix_stream=opts.get("prefix_stream", False), stream_recall=opts.get("stream_recall", 0),
                        recall_episodes=opts.get("recall_episodes", EPISODES[0]),
                        recall_draw=opts.get("recall_draw", DRAWS[0]), stream_advance=opts.get("stream_advance"))
    start = time.perf_counter()
    trainer = Trainer(cfg, source=source)
    write_json(out / TASK_FILE, task.to_dict())  # from the start: a checkpoint of the run is evaluable (synth eval)
    target = opts["stop_accuracy"]

    def reached() -> bool:  # looked at after every step: only a step just evaluated counts
        evaluated = trainer.step % eval_every == 0
        return target is not None and evaluated and trainer.eval_metrics.get("accuracy", 0.0) >= target

    stopped_early = False
    try:
        records = trainer.run(_RunStop(stop, reached, f"held-out accuracy >= {target}")).history
    except TrainingStopped:
        if stop is not None and stop.is_set():  # asked to stop, not done: the checkpoint is written, nothing else
            raise
        stopped_early = True
        records = trainer.log.records()
    wall = time.perf_counter() - start
    history = [{"step": r["step"], "accuracy": r["accuracy"], "perfect": r["perfect"], "val_loss": r["val_loss"]}
               for r in records if r["kind"] == "eval" and "accuracy" in r]
    final = history[-1] if history else {"accuracy": math.nan, "perfect": math.nan}
    result = SynthResult(
        task=task.to_dict(), family=family, parameters=trainer.model.num_parameters(), steps=trainer.step,
        history=history, accuracy=final["accuracy"], perfect=final["perfect"], steps_to_90=steps_to(history, 0.9),
        steps_to_99=steps_to(history, 0.99), wall_s=wall, generate_s=source.generate_seconds, out=str(out),
        stopped_early=stopped_early, options=opts, config=cfg.to_dict(),
    )
    save_pretrained(trainer.model, out)
    write_json(out / RESULT_FILE, result.to_dict())
    plot_accuracy({family: [(r["step"], r["accuracy"]) for r in history]}, out / "accuracy.png",
                  f"{task.name}: {family}")
    return result
