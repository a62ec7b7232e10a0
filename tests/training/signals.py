"""Send a signal to a ``griffin train`` subprocess once it is in its training loop (SIGINT, SIGTERM tests)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence


def signal_once_ready(command: Sequence[str], ready: Callable[[], bool], signum: signal.Signals,
                      timeout: float = 240, poll: float = 0.05) -> tuple[int, str, str]:
    """Start ``command``, wait until ``ready()`` (at most ``timeout`` seconds; it must still be running), send
    ``signum`` once, and return its exit status, stdout and stderr (it is killed if it does not end in 120 s).

    The command starts with ``signum``'s default disposition, as from an interactive shell: a test suite started in
    the background (``pytest &``) ignores SIGINT, the child would inherit that and rightly never see the signal."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stdout, stderr
