"""Files: written atomically (a temporary file in the same directory, renamed over the target, so that a crash leaves
either the old file or the new one, never half of one), with the permissions an ordinary ``open`` gives (the
user's umask, so that colleagues and jobs of other users can read them where the umask allows), and read with
errors that name the file."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor


def create_temp(parent: Path, prefix: str, suffix: str = "", *, directory: bool = False) -> Path:
    """A new, uniquely named empty file (or directory, with ``directory``) in ``parent``, to be renamed into place.

    Unlike ``tempfile.mkstemp``/``mkdtemp`` (modes 0600/0700, which the rename would carry to the final output, so that
    no one else could read a checkpoint or dataset on a shared machine), it is created with mode 0o666 (0o777) and
    the kernel applies the umask, or the parent's default ACL and setgid group, exactly as for an ordinary file. So
    the umask is never read: ``os.umask`` can only be read by setting it, which races with other threads' files."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            if directory:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {parent}")


class OutputExistsError(FileExistsError, ValueError):
    """An output that is already there and is replaced only when asked to (``overwrite``); the message names it."""


def check_new_output(path: str | Path, overwrite: bool) -> None:
    """Refuse, with :class:`OutputExistsError`, to replace an existing file or non-empty directory at ``path``
    unless ``overwrite``."""
    path = Path(path)
    if overwrite or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            return
        raise OutputExistsError(f"{path} already exists and is not empty: pass --overwrite to replace it")
    raise OutputExistsError(f"{path} already exists: pass --overwrite to replace it")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same directory, then rename over ``path``. The file gets the mode
    :func:`create_temp` gave the temporary file even if ``write`` replaced it (safetensors >= 0.8 writes through its
    own 0600 temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(create_temp(path.parent, f".{path.name}.", ".tmp"))
    try:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        write(tmp)
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:
            os.chmod(tmp, mode)
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
