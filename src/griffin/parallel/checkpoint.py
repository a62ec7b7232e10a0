"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards, and they load
back on any other number of devices or layout (DCP reshards by each tensor's global offsets).

A checkpoint directory ``step_00000100`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp`` shards (the model's
and AdamW's state, keyed by parameter name), ``rng-<rank>.safetensors`` (each rank's RNG state),
``config.json`` (the model), ``trainer.json`` (the trainer's state), ``layout.json`` (the layout it was written
on) and ``manifest.json``, written last: the size and SHA-256 of every other file, as in griffin's single-file
checkpoints, so that the same verification applies. The directory is written under a temporary name and renamed
into place by rank 0 only after every rank has written and hashed its shards: a rank killed mid-write leaves the
previous checkpoint the newest, intact. DCP's metadata (a pickle) is read with an unpickler that admits only
DCP's own metadata classes.

:func:`load_sharded_model` rebuilds the whole model in one process (``griffin convert`` writes it as a griffin or
HF checkpoint).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from griffin.config import ModelConfig
from griffin.interop import CheckpointError
from griffin.io import fsync_path, sha256_file, write_json, write_safetensors
from griffin.model import CausalLM

METADATA = ".metadata"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
CONFIG = "config.json"
LAYOUT = "layout.json"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint directory."""
    return (Path(path) / METADATA).is_file()


@contextmanager
def _quiet_single_process():
    """DCP warns that it "assumes the intent" to save or load in one process; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _file_info(path: Path) -> dict[str, Any]:
    fsync_path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {(_DCP_METADATA, name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch's dtypes, layouts and sizes; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's {METADATA}")


class _Reader(FileSystemReader):
    """DCP's file reader, its metadata read through :class:`_MetadataUnpickler` (the shards themselves are read with
    ``torch.load(weights_only=True)`` by DCP)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
            raise CheckpointError(f"{path}: unreadable DCP metadata: {err}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# Saving -----------------------------------------------------------------------------------------------------------
def save_sharded(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any],
                 layout: dict[str, Any] | None = None, extra_files: dict[str, Path] | None = None) -> Path:
    """Write the sharded checkpoint ``path`` (e.g. ``OUT/checkpoints/step_00000100``): a collective, every rank calls
    it with its own model and optimizer. The directory appears only once every rank has finished; an existing
    ``path`` (the same step written again after a resume) is replaced. ``extra_files``: copied in by rank 0 (the
    tokenizer)."""
    final = Path(path)
    tmp = final.parent / f".tmp-{final.name}"
    rank, world = _rank_world()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    with _quiet_single_process():
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=world == 1)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    write_safetensors(tmp / f"rng-{rank:05d}.safetensors", rng, {"library": "griffin"})
    _barrier()  # every rank's files are complete
    mine = {p.name: _file_info(p) for p in sorted(tmp.iterdir())
            if p.name.startswith(f"__{rank}_") or p.name == f"rng-{rank:05d}.safetensors"}
    gathered: list[dict[str, Any] | None] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part or {})
        write_json(tmp / CONFIG, model.config.to_dict())
        write_json(tmp / TRAINER_STATE, trainer_state)
        write_json(tmp / LAYOUT, {"world_size": world, **(layout or {})})
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / name)  # the umask's mode, not the source's (copy2 would keep 0600)
        for p in sorted(tmp.iterdir()):
            if p.name not in files:
                files[p.name] = _file_info(p)
        write_json(tmp / MANIFEST, {"step": trainer_state.get("step"), "format": "dcp", "files": files})
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        if final.exists():
            old = final.parent / f".old-{final.name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync_path(final.parent)
    _barrier()
    return final


# Loading ----------------------------------------------------------------------------------------------------------
def check_config(path: Path, config: ModelConfig) -> None:
    """Refuse a checkpoint written for another model, naming the fields that differ."""
    try:
        saved = ModelConfig.from_dict(json.loads((path / CONFIG).read_text()))
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path / CONFIG}: unreadable model config: {err}") from None
    if saved.replace(name="") != config.replace(name=""):
        mine, theirs = config.to_dict(), saved.to_dict()
        diff = [f"{k}={theirs[k]!r} there, {mine[k]!r} here" for k in mine if k != "name" and mine[k] != theirs[k]]
        raise CheckpointError(f"the sharded checkpoint {path} was written for another model: {'; '.join(diff)}")


def load_sharded(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``) in place, whatever layout either was written or
    is laid out on (a plain single-process model too), and return the trainer state. A collective when the process
    group is up. Each rank's RNG state is restored when the world size is the one it was written with."""
    path = Path(path)
    if not is_sharded(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {METADATA})")
    check_config(path, model.config)
    rank, world = _rank_world()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=_Reader(path), no_dist=world == 1)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: cannot load into this model: {err}") from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    layout = json.loads((path / LAYOUT).read_text())
    rng_file = path / f"rng-{rank:05d}.safetensors"
    if layout.get("world_size") == world and rng_file.is_file():
        from safetensors.torch import load_file

        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / TRAINER_STATE).read_text())


def load_sharded_model(path: str | Path, dtype: torch.dtype | None = None) -> CausalLM:
    """The whole model of a sharded checkpoint, in one process on the CPU (as stored, or cast to ``dtype``)."""
    path = Path(path)
    if not is_sharded(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {METADATA})")
    config = ModelConfig.from_dict(json.loads((path / CONFIG).read_text()))
    model = CausalLM(config)
    state = {"model": model.state_dict()}
    with _quiet_single_process():
        dcp.load(state, storage_reader=_Reader(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model if dtype is None else model.to(dtype)


__all__ = ["is_sharded", "check_config", "load_sharded", "load_sharded_model", "save_sharded"]
