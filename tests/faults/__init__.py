"""SIGKILL at a named point of training, injected from outside the library (see :mod:`.sitecustomize` for the
points): :func:`child_env` for a Python process the test starts, :func:`install` in the test's own process (or a
worker's)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tests.faults.sitecustomize import ENV, POINTS, install, parse

DIR = Path(__file__).resolve().parent


def child_env(fault: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child Python process that dies by SIGKILL at ``fault`` (``None``: one
    that runs through): this directory first on ``PYTHONPATH``, its ``sitecustomize`` patching griffin there."""
    env = dict(os.environ if env is None else env)
    env.pop(ENV, None)
    if fault is not None:
        parse(fault)  # a typo fails here, not as a child that is never killed
        env["PYTHONPATH"] = os.pathsep.join([str(DIR), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and p != str(DIR)]])
        env[ENV] = fault
    return env


__all__ = ["DIR", "ENV", "POINTS", "child_env", "install"]
