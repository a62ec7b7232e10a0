"""Files written atomically: a temporary file in the same directory, renamed over the target, so that a crash leaves
either the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same directory, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as indented JSON, atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


def write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Tensors (moved to the CPU, made contiguous) as a safetensors file, atomically."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
