"""Helpers shared by the scripts in ``benchmarks/``: machine description, timing, Markdown tables, JSON results,
progress bars. Nothing here is specific to one benchmark.

The scripts import it as a sibling module (``from common import ...``): each puts its own folder first on
``sys.path``, so that both ``python benchmarks/X.py`` and loading the file by path (the tests) find it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TypeVar

import torch

import griffin.threads
from griffin.flops import cpu_name

# The benchmarks run griffin's kernels as the griffin command does: idle OpenMP threads sleep (numba's runtime reads
# this when its first parallel kernel runs; torch's read it when torch was imported, before this).
griffin.threads.prefer_passive_openmp_wait()


# Versions ----------------------------------------------------------------------------------------------------
def keep_freed_memory() -> None:
    """The C heap setting of griffin's training commands (:func:`griffin.heap.keep_freed_memory`), where the griffin
    measured has it; an older revision on ``PYTHONPATH`` keeps glibc's defaults, as its own commands did."""
    try:
        from griffin.heap import keep_freed_memory as keep
    except ImportError:
        return
    keep()


def git_source(rev: str, where: Path, root: Path | None = None) -> Path:
    """The ``src`` tree of git revision ``rev`` of the repository at ``root`` (default: this one), extracted into
    ``where`` (created): a worker process imports that version of griffin with ``PYTHONPATH`` set to the returned
    path."""
    root = root or Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=root, check=True, capture_output=True)
    where.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where / "src"


def short_rev(rev: str, root: Path | None = None) -> str:
    """``git rev-parse --short rev`` (an error naming ``rev`` if the repository has no such revision)."""
    root = root or Path(__file__).resolve().parents[1]
    out = subprocess.run(["git", "rev-parse", "--verify", "--short", f"{rev}^{{commit}}"], cwd=root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"no git revision {rev!r} in {root}: {out.stderr.strip()}")
    return out.stdout.strip()


# Machine -----------------------------------------------------------------------------------------------------
def machine_info(device: torch.device) -> dict[str, Any]:
    """CPU, cores, torch threads and version, device (and GPU name), load average, and the OpenMP settings that decide
    how idle worker threads wait (the griffin command sets ``OMP_WAIT_POLICY=passive``; ``GOMP_SPINCOUNT`` makes them
    spin first): what a result was measured on."""
    info: dict[str, Any] = dict(cpu=cpu_name(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                                torch=torch.__version__, device=str(device), load_average=os.getloadavg(),
                                openmp={k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["last_level_cache_mib"] = last_level_cache_bytes() / 2**20
    return info


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size (Linux sysfs, CPU 0's view; ``default`` where it cannot be read): what a
    benchmark's working set must exceed for its reads to come from memory."""
    sizes, units = [], {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=default)


@contextmanager
def module_setting(module: ModuleType, name: str, value: object) -> Iterator[None]:
    """``module.name`` set to ``value`` meanwhile (a kernel's switch, e.g.
    ``griffin.inference.cpu.matvec.PREFETCH_BYTES``), restored after."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes/s of one large ``dst.copy_(src)``, counting the read and the write (2 x nbytes), median of repeats."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):  # the first copy (page faults) is a warm-up
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


# Timing ------------------------------------------------------------------------------------------------------
class Timed(Protocol):
    """A timed run: anything with its total seconds."""

    total_s: float


T = TypeVar("T", bound=Timed)


def median_time(step: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``step()`` over ``repeats`` calls after one warm-up call (compilation, allocator)."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_SWEEP: list[torch.Tensor] = []


def evict_caches(mib: int = 256) -> None:
    """Write ``mib`` MiB (several times any L3 cache), so that what runs next finds its inputs in memory, as an
    operator inside a training step does (the step's other operators moved megabytes since it last touched them)."""
    if not _SWEEP or _SWEEP[0].numel() != mib << 18:
        _SWEEP[:] = [torch.zeros(mib << 18)]
    _SWEEP[0].add_(1.0)


def interleaved_forward_backward(paths: Sequence[str], run: Callable[[str, bool], None],
                                 rounds: int) -> dict[str, tuple[float, float]]:
    """Per path, the median seconds of ``run(path, False)`` (forward) and ``run(path, True)`` (forward+backward)
    over ``rounds`` rounds that time every path in turn, so that a change of load on a shared host falls on all."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name in paths:
            times[name].append((median_time(lambda name=name: run(name, False), 1),
                                median_time(lambda name=name: run(name, True), 1)))
    return {name: (statistics.median_high(t[0] for t in ts), statistics.median_high(t[1] for t in ts))
            for name, ts in times.items()}


def median_run(fn: Callable[[], T], repeats: int) -> T:
    """The run of median total time (``total_s``) among ``repeats`` runs."""
    runs = sorted((fn() for _ in range(repeats)), key=lambda r: r.total_s)
    return runs[(len(runs) - 1) // 2]


# Reporting ---------------------------------------------------------------------------------------------------
def progress(total: int, desc: str):
    """A tqdm progress bar of ``total`` runs, cleared when done."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False, dynamic_ncols=True)


def table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table: columns are (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---:|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) for _, k, f in columns) + " |")
    return "\n".join(lines)


def label(family: str) -> str:
    """A model family as the paper writes it: MQA, Hawk, Griffin."""
    return "MQA" if family == "mqa" else family.title()


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write a benchmark's results as JSON, creating the folder, and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
