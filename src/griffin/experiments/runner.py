"""The runner the experiments share: a grid of named training runs, run once each, their results in one JSON.

A :class:`Grid` is a list of :class:`Run`: a name, the ``griffin train`` settings of the run and tags (family, size,
training length, window) that tables and plots group by. :func:`run_grid` prepares the grid's data once, then trains
each run as its own ``griffin train --config OUT/runs/NAME/train.toml`` process (``workers`` at a time, or under a
launcher such as ``torchrun --nproc-per-node 8``), evaluates it in this process when it ends and writes
``OUT/runs/NAME/result.json``. A run with a result is never trained again; an interrupted one resumes from its newest
checkpoint (the trainer's exact resume). One progress bar covers the whole grid, in training FLOPs, with its ETA.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from griffin.io import read_json, write_json
from griffin.training import TrainConfig
from griffin.training.config import RUN_KEYS, same_setting, write_toml
from griffin.training.trainer import TrainingError

RESULT_FILE = "result.json"
GRID_FILE = "results.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Settings every run of a grid must share: the data they train on and are evaluated on.
DATA_KEYS = ("data", "tokenizer", "val_fraction")


class ExperimentError(TrainingError):
    """A run of the grid failed; what is done is kept, and running the command again continues (``griffin
    experiment`` says so in one line, as ``griffin train`` does for a run that cannot go on)."""


@dataclass(frozen=True)
class Run:
    """One training run of a grid: ``settings`` are ``griffin train``'s (a TrainConfig mapping, ``out`` and
    ``data`` left to the runner); ``tags`` describe it for tables and plots."""

    name: str
    settings: dict[str, Any]
    tags: dict[str, Any] = field(default_factory=dict)

    def config(self, out: Path, data: str) -> TrainConfig:
        """The run's full training configuration, trained into ``out/runs/NAME`` on the grid's prepared ``data``."""
        fixed = {"out": str(out / "runs" / self.name), "data": data, "resume": "if-any", "progress": False,
                 "sample_tokens": 0}
        return TrainConfig.from_dict({**self.settings, **fixed}, source=f"run {self.name}")


@dataclass
class Grid:
    """The runs of one experiment; :meth:`check` refuses a grid that cannot give comparable results."""

    experiment: str
    runs: list[Run]
    meta: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Names unique and usable as directories, every run's settings valid, every run on the same data."""
        if not self.runs:
            raise ValueError(f"the {self.experiment} grid has no runs")
        seen: set[str] = set()
        for run in self.runs:
            if not NAME.match(run.name):
                raise ValueError(f"run name {run.name!r} must be letters, digits, '.', '_' or '-'")
            if run.name in seen:
                raise ValueError(f"two runs of the {self.experiment} grid are named {run.name!r}")
            seen.add(run.name)
            TrainConfig.from_dict({**run.settings, "progress": False}, source=f"run {run.name}")
        first = self.runs[0]
        for run in self.runs[1:]:
            for key in DATA_KEYS:
                a, b = first.settings.get(key), run.settings.get(key)
                if a != b:
                    raise ValueError(f"the runs of the {self.experiment} grid disagree on data: {first.name} has "
                                     f"{key}={a!r}, {run.name} has {key}={b!r}; their losses would not be comparable")

    def split_batch(self, ranks: int) -> None:
        """Each run's batch shared by ``ranks`` data-parallel processes (``griffin train``'s ``batch_size`` is per
        process): the global batch, and so the tokens and FLOPs of every run, stay as planned."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"data-parallel ranks={ranks!r} must be a positive integer")
        for run in self.runs:
            batch = run.settings.get("batch_size", TrainConfig.__dataclass_fields__["batch_size"].default)
            if batch % ranks:
                raise ValueError(f"run {run.name}: its batch of {batch} sequences cannot be shared by {ranks} "
                                 "data-parallel ranks")
            run.settings["batch_size"] = batch // ranks

    def data_settings(self) -> dict[str, Any]:
        return {k: self.runs[0].settings[k] for k in DATA_KEYS if k in self.runs[0].settings}


# Evaluation of a finished run, in this process: (run, its directory, the grid's prepared data) -> extra results.
Evaluate = Callable[[Run, Path, Path], dict[str, Any]]


def prepare_grid_data(grid: Grid, out: Path, seed: int = 0) -> Path:
    """The grid's data prepared once into ``out/data`` (or the prepared dataset the runs name), shared by all runs."""
    from griffin.training.trainer import prepare_data

    cfg = TrainConfig.from_dict({**grid.data_settings(), "seed": seed, "progress": False}, source="the grid's data")
    return prepare_data(cfg, out)


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What a finished run's ``log.jsonl`` says: parameters, FLOPs per token, tokens, losses, the wall time."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    start = [r for r in records if r["kind"] == "start"]
    end = [r for r in records if r["kind"] == "end"]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    if not start or not end:
        raise ExperimentError(f"{run_dir / 'log.jsonl'} has no record of a finished run")
    tokens = train[-1]["tokens"] if train else 0
    return {"parameters": start[-1]["parameters"], "flops_per_token": start[-1]["flops_per_token"],
            "tokens": tokens, "flops": tokens * start[-1]["flops_per_token"], "steps": end[-1]["step"],
            "val_loss": end[-1]["val_loss"], "best_val_loss": end[-1]["best_val_loss"],
            "unigram_loss": start[-1]["unigram_loss"],
            "curve": [(r["step"], r["val_loss"]) for r in evals]}


def _tokens_done(run_dir: Path) -> int:
    """Training tokens a running run has logged so far (its ``log.jsonl``), 0 before its first record."""
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("kind") == "train":
            return int(record["tokens"])
    return 0


def _command(launcher: str | None, toml: Path) -> list[str]:
    head = shlex.split(launcher) if launcher else [sys.executable]
    return [*head, "-m", "griffin.cli", "train", "--config", str(toml)]


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


#: The settings whose change makes a finished run another run (the others: threads, device, intervals, logging).
RESULT_KEYS = (*RUN_KEYS, "max_steps", "batch_size", "eval_batches")


def check_done(run: Run, cfg: TrainConfig, result_file: Path) -> dict[str, Any] | None:
    """The result of a run finished earlier with the same settings; an error naming the first setting that differs
    if it was trained with others."""
    if not result_file.is_file():
        return None
    done = read_json(result_file)
    old, new = done.get("config", {}), json.loads(json.dumps(cfg.to_dict()))
    for key in RESULT_KEYS:
        if not same_setting(key, old.get(key), new.get(key)):
            raise ValueError(f"run {run.name} in {result_file.parent} was trained with {key}={old.get(key)!r}, not "
                             f"{new.get(key)!r}: use another --out, or delete that run's directory to train it again")
    return done


def run_grid(grid: Grid, out: str | Path, *, workers: int = 1, threads: int = 0, launcher: str | None = None,
             evaluate: Evaluate | None = None, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """Train every run of ``grid`` not finished yet into ``out/runs/NAME`` and return the grid's results (also
    written to ``out/results.json``): each run's tags, settings, summary (:func:`run_summary`), ``evaluate``'s
    results and wall time. ``workers`` runs train at once, each with ``threads`` CPU threads (0: the cores shared
    out); ``launcher`` replaces ``python`` in each run's command (``torchrun --nproc-per-node 8``)."""
    from tqdm.auto import tqdm

    from griffin.data import load_meta
    from griffin.flops import training_flops_per_token

    grid.check()
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if threads < 0:
        raise ValueError(f"threads={threads} must be >= 0")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_grid_data(grid, out, seed)
    vocab = load_meta(data)["vocab_size"]
    threads = threads or max(1, (os.cpu_count() or 1) // workers)

    results: dict[str, dict[str, Any]] = {}
    pending: list[tuple[Run, TrainConfig, float]] = []
    for run in grid.runs:
        cfg = run.config(out, str(data))
        if launcher is None:
            cfg.threads = cfg.threads or threads
        flops = training_flops_per_token(cfg.model_config(vocab), cfg.seq_len) * cfg.max_steps * cfg.batch_size \
            * cfg.grad_accum * cfg.seq_len
        done = check_done(run, cfg, Path(cfg.out) / RESULT_FILE)
        if done is not None:
            results[run.name] = done
        else:
            pending.append((run, cfg, flops))
    total = sum(r["summary"]["flops"] for r in results.values()) + sum(f for *_, f in pending)
    finished_flops = sum(r["summary"]["flops"] for r in results.values())
    bar = tqdm(total=total, initial=finished_flops, unit="FLOP", unit_scale=True, desc=grid.experiment,
               disable=not progress, dynamic_ncols=True, mininterval=2.0)
    shown = finished_flops
    running: dict[str, tuple[subprocess.Popen, Run, TrainConfig, float, float, Any]] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                run, cfg, flops = pending.pop(0)
                run_dir = Path(cfg.out)
                run_dir.mkdir(parents=True, exist_ok=True)
                toml = run_dir / "train.toml"
                write_toml(toml, cfg.to_dict())
                log = open(run_dir / "train.log", "a")  # noqa: SIM115 - closed when the process ends
                proc = subprocess.Popen(_command(launcher, toml), stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
                running[run.name] = (proc, run, cfg, flops, time.perf_counter(), log)
            time.sleep(0.5)
            live = 0.0
            for name, (proc, run, cfg, flops, started, log) in list(running.items()):
                if proc.poll() is None:
                    tokens = _tokens_done(Path(cfg.out))
                    live += tokens * flops / max(1, cfg.max_steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len)
                    continue
                log.close()
                del running[name]
                run_dir = Path(cfg.out)
                if proc.returncode != 0:
                    status = (f"killed by signal {-proc.returncode}" if proc.returncode < 0 else
                              f"exit status {proc.returncode}")
                    raise ExperimentError(f"run {name} failed ({status}); its log "
                                          f"{run_dir / 'train.log'} ends:\n{_log_tail(run_dir / 'train.log')}\n"
                                          "run the same command again to resume it from its last checkpoint")
                result = {"name": name, "tags": run.tags, "settings": run.settings, "config": cfg.to_dict(),
                          "summary": run_summary(run_dir), "train_wall_s": time.perf_counter() - started}
                if evaluate is not None:
                    t0 = time.perf_counter()
                    result["evaluation"] = evaluate(run, run_dir, data)
                    result["eval_wall_s"] = time.perf_counter() - t0
                result = json.loads(json.dumps(result))  # as read back from the file when skipped next time
                write_json(run_dir / RESULT_FILE, result)
                results[name] = result
                finished_flops += result["summary"]["flops"]
            if finished_flops + live > shown:
                bar.set_postfix_str(f"{len(results)}/{len(grid.runs)} runs", refresh=False)
                bar.update(finished_flops + live - shown)
                shown = finished_flops + live
    except BaseException:
        for proc, *_rest in running.values():  # a stopped grid stops its runs; their checkpoints are kept
            proc.terminate()
        for proc, *_rest, log in running.values():
            proc.wait()
            log.close()
        raise
    finally:
        bar.close()
    ordered = [results[r.name] for r in grid.runs]
    payload = {"experiment": grid.experiment, "meta": grid.meta, "data": str(data), "runs": ordered}
    write_json(out / GRID_FILE, payload)
    return payload


def describe_grid(grid: Grid, vocab_size: int = 256) -> list[dict[str, Any]]:
    """Each run's name, tags, parameters, tokens and training FLOPs, without training anything (``--dry-run``)."""
    from griffin.flops import training_flops_per_token
    from griffin.model import count_parameters

    rows = []
    for run in grid.runs:
        cfg = TrainConfig.from_dict({**run.settings, "progress": False}, source=f"run {run.name}")
        model_cfg = cfg.model_config(vocab_size)
        tokens = cfg.max_steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len
        params = count_parameters(model_cfg)
        rows.append({"name": run.name, **run.tags, "parameters": params, "tokens": tokens,
                     "flops": tokens * training_flops_per_token(model_cfg, cfg.seq_len)})
    return rows


__all__ = ["Run", "Grid", "ExperimentError", "run_grid", "describe_grid", "run_summary"]
