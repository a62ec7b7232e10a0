"""The server's metrics in the Prometheus text format (version 0.0.4): counters, gauges and histograms, updated by
the engine thread and read by ``/metrics``. No dependency: the format is a few lines per metric."""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class Metrics:
    """Everything ``/metrics`` reports. ``counter``/``observe`` are called by the engine, ``render`` by the app; gauges
    are read at render time from callables."""

    def __init__(self, rate_window_s: float = 10.0) -> None:
        self.lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.help: dict[str, tuple[str, str]] = {}
        self.histograms: dict[str, Histogram] = {}
        self.gauges: dict[str, Callable[[], float]] = {}
        self.window = rate_window_s
        self.token_times: deque[tuple[float, int]] = deque()  # (time, tokens) of recent decode steps

    def describe(self, name: str, kind: str, text: str) -> None:
        self.help[name] = (kind, text)
        if kind == "counter":
            self.counters.setdefault(name, 0.0)
        elif kind == "histogram":
            self.histograms.setdefault(name, Histogram())

    def gauge(self, name: str, text: str, fn: Callable[[], float], kind: str = "gauge") -> None:
        """A value read from ``fn`` at render time (``kind`` counter for a count kept elsewhere)."""
        self.help[name] = (kind, text)
        self.gauges[name] = fn

    def inc(self, name: str, value: float = 1.0) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.histograms.setdefault(name, Histogram()).observe(value)

    def tokens_generated(self, n: int, now: float | None = None) -> None:
        """Count ``n`` output tokens for the recent-rate gauge."""
        now = time.monotonic() if now is None else now
        with self.lock:
            self.token_times.append((now, n))
            while self.token_times and self.token_times[0][0] < now - self.window:
                self.token_times.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            recent = [(t, n) for t, n in self.token_times if t >= now - self.window]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def value(self, name: str) -> float:
        with self.lock:
            return self.counters.get(name, 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self.lock:
            counters = dict(self.counters)
            histograms = {k: h for k, h in self.histograms.items()}
            hist_lines = {k: h.lines(k) for k, h in histograms.items()}
        for name in sorted(set(counters) | set(hist_lines) | set(self.gauges)):
            kind, text = self.help.get(name, ("untyped", name))
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if name in counters:
                lines.append(f"{name} {counters[name]!r}")
            elif name in hist_lines:
                lines += hist_lines[name]
            else:
                lines.append(f"{name} {float(self.gauges[name]())!r}")
        return "\n".join(lines) + "\n"
