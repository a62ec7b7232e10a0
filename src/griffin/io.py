"""Files: written atomically (a temporary file in the same directory, renamed over the target, so that a crash leaves
either the old file or the new one, never half of one), and read with errors that name the file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
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


class FileFormatError(ValueError):
    """A file that exists but cannot be read as what it should be; the message names it."""


def read_json(path: Path) -> Any:
    """The JSON content of ``path``; a FileFormatError naming the file if it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{path} is not valid JSON: {err}") from None


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; a FileFormatError naming the file if it is truncated or not
    a safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise FileFormatError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from None


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks (checkpoint manifests)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (so that a rename after it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
