"""Fault injection for the resume tests, from outside the library: SIGKILL at a named point of training.

A Python process started with this directory on its ``PYTHONPATH`` imports this file at start-up (as
``sitecustomize``); when ``GRIFFIN_TEST_FAULT`` names a fault, the griffin module holding that point is patched as
it is imported (nothing is imported early: the process starts as it would without the fault). The faults:

- ``step:N``: ``Trainer.train_step`` returns having made update N (before its log record, evaluation or
  checkpoint);
- ``checkpoint:N``: the checkpoint of step N has its model written under its temporary name
  (``.tmp-step_0000000N-<pid>``), not yet its optimizer state, trainer state or manifest: half-written debris;
- ``sharded_checkpoint:N:R``: rank R has written its DCP shards of step N (into ``.tmp-step_0000000N``), before
  DCP's metadata, its RNG state, the manifest and the rename: the checkpoint is never completed.

:func:`install` applies the same patches in a running process (``tests.faults`` re-exports it), with another
action than SIGKILL if asked (an exception, for a test in one process).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "GRIFFIN_TEST_FAULT"

#: Each fault point: the module it patches and the number of integers after its name.
POINTS = {"step": ("griffin.training.trainer", 1), "checkpoint": ("griffin.training.checkpoint", 1),
          "sharded_checkpoint": ("griffin.parallel.checkpoint", 2)}


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def parse(fault: str) -> tuple[str, tuple[int, ...]]:
    """``"checkpoint:6"`` -> ``("checkpoint", (6,))``; a fault that names no point is refused."""
    point, *numbers = fault.split(":")
    if point not in POINTS or len(numbers) != POINTS[point][1] or not all(n.isdigit() for n in numbers):
        raise ValueError(f"{ENV}={fault!r}: expected one of step:STEP, checkpoint:STEP, sharded_checkpoint:STEP:RANK")
    return point, tuple(int(n) for n in numbers)


def _tmp_name(step: int) -> str:
    """The temporary directory a checkpoint of ``step`` is written into (both formats; one process adds -<pid>)."""
    return f".tmp-step_{step:08d}"


def _after_step(module: ModuleType, args: tuple[int, ...], action: Callable[[], None], set_attr: Callable) -> None:
    (step,) = args
    trainer = module.Trainer
    train_step = trainer.train_step

    @functools.wraps(train_step)
    def wrapped(self: Any) -> Any:
        metrics = train_step(self)
        if self.step == step:
            action()
        return metrics

    set_attr(trainer, "train_step", wrapped)


def _in_checkpoint(module: ModuleType, args: tuple[int, ...], action: Callable[[], None], set_attr: Callable) -> None:
    (step,) = args
    save_pretrained = module.save_pretrained  # save_checkpoint's first write, the model into the temporary directory

    @functools.wraps(save_pretrained)
    def wrapped(model: Any, path: Any, *rest: Any, **kwargs: Any) -> Any:
        out = save_pretrained(model, path, *rest, **kwargs)
        if Path(path).name.startswith(_tmp_name(step) + "-"):
            action()
        return out

    set_attr(module, "save_pretrained", wrapped)


def _in_sharded_checkpoint(module: ModuleType, args: tuple[int, ...], action: Callable[[], None],
                           set_attr: Callable) -> None:
    step, rank = args
    import torch.distributed as dist

    class Writer(module.FileSystemWriter):  # type: ignore[name-defined,misc]
        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)  # this rank's shards, written and synced
            mine = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if Path(self.path).name == _tmp_name(step) and mine == rank:
                action()
            return future

    set_attr(module, "FileSystemWriter", Writer)


PATCHES = {"step": _after_step, "checkpoint": _in_checkpoint, "sharded_checkpoint": _in_sharded_checkpoint}


def install(fault: str, action: Callable[[], None] = sigkill, set_attr: Callable = setattr) -> None:
    """Patch the module of ``fault`` (imported if need be) so that ``action`` runs at that point; ``set_attr``:
    e.g. ``monkeypatch.setattr`` to have the patch undone after the test."""
    point, args = parse(fault)
    PATCHES[point](importlib.import_module(POINTS[point][0]), args, action, set_attr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it hands the import of one module to the other finders and patches the module once it
    has run."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_on_import(fault: str) -> None:
    """:func:`install` with SIGKILL, applied when the fault's module is imported (now if it already is)."""
    point, args = parse(fault)
    name = POINTS[point][0]
    patch = functools.partial(PATCHES[point], args=args, action=sigkill, set_attr=setattr)
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


if __name__ == "sitecustomize" and os.environ.get(ENV):
    install_on_import(os.environ[ENV])
