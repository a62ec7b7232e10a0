"""Training checkpoints that resume exactly and survive being killed at any moment.

A checkpoint is a directory ``OUT/checkpoints/step_00000100`` holding

- ``config.json`` + ``model.safetensors``: the model, loadable on its own with ``CausalLM.from_pretrained``; a LoRA
  fine-tune writes ``adapter_config.json`` + ``adapter_model.safetensors`` instead (PEFT's format, on the base model
  named in them: :mod:`griffin.interop.adapters`) beside the base's ``config.json``;
- ``optimizer.safetensors``: AdamW's moments and step counts, and the RNG states (no pickle anywhere);
- ``trainer.json``: step, data-loader position, best validation loss, optimizer hyper-parameters, config;
- ``tokenizer.json`` or ``tokenizer.model`` when the data has one, so that ``griffin generate CKPT`` finds it;
- ``manifest.json``, written last: the size and SHA-256 of every other file.

The directory is assembled under a temporary name and renamed into place, so a crash leaves either the old
state or the new one, never half of one; a checkpoint whose manifest does not match its files (truncated,
corrupted, or missing a file) is refused with the file named. ``latest`` and ``best`` are symbolic links.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from griffin.interop import CheckpointError, save_pretrained
from griffin.io import fsync_path, sha256_file, write_safetensors
from griffin.model import CausalLM

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
OPTIMIZER_STATE = "optimizer.safetensors"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


# Optimizer and RNG state as flat tensors -------------------------------------------------------------
def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    state = optimizer.state_dict()
    tensors = {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, groups


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                       groups: list[dict[str, Any]], source: str) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{source}: optimizer state does not fit this model: {err}") from None


# Writing ------------------------------------------------------------------------------------------------
def save_checkpoint(root: str | Path, step: int, model: CausalLM, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], extra_files: dict[str, Path] | None = None,
                    write_model: Callable[[CausalLM, Path], None] | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and point ``root/latest`` at it; ``extra_files`` maps
    names in the checkpoint to files copied in (the tokenizer); ``write_model`` writes the model into the directory
    (default: :func:`~griffin.interop.save_pretrained`; a LoRA run writes its adapters only, :mod:`griffin.finetune`).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        (save_pretrained if write_model is None else write_model)(model, tmp)
        tensors, groups = _optimizer_tensors(optimizer)
        write_safetensors(tmp / OPTIMIZER_STATE, {**tensors, **_rng_tensors()}, {"library": "griffin"})
        state = {**trainer_state, "step": step, "optimizer_param_groups": groups}
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1) + "\n")
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / name)  # the umask's mode, not the source's (copy2 would keep 0600)
        files = {}
        for path in sorted(tmp.iterdir()):
            fsync_path(path)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        if final.exists():  # the same step written again after a resume: swap, then drop the old one
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    set_link(root, "latest", final)
    return final


def set_link(root: Path, name: str, target: Path) -> None:
    """Point ``root/name`` at ``target`` (a sibling) through an atomically renamed symbolic link."""
    tmp = root / f".{name}-{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, root / name)


def prune(root: Path, keep_last: int, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints and those in ``keep``; return what was removed."""
    steps = list_checkpoints(root)
    protected = {p.resolve() for p in keep}
    if keep_last:
        protected |= {p.resolve() for p in steps[-keep_last:]}
    removed = []
    for path in steps:
        if path.resolve() not in protected:
            shutil.rmtree(path)
            removed.append(path)
    for leftover in root.glob(".tmp-step_*"):  # debris of a run killed while writing
        shutil.rmtree(leftover, ignore_errors=True)
    return removed


# Reading ------------------------------------------------------------------------------------------------
def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (temporary and partial directories excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=lambda p: p.name)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; raise :class:`CheckpointError` naming the first problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: it was not completely written")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupted: {err}") from None
    for name, info in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: {name} is {size} bytes, the manifest says {info['bytes']} (truncated?)")
        if sha256_file(file) != info["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest (corrupted)")
    return manifest


def find_resumable(root: str | Path) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; broken newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            warnings.warn(f"skipping checkpoint {path.name}: {err}", stacklevel=2)
    return None


def _read_weights(path: Path, model: CausalLM) -> None:
    from griffin.interop import WEIGHTS_NAME, load_state_checked

    try:
        weights = load_file(str(path / WEIGHTS_NAME))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: unreadable: {err}") from None
    with torch.no_grad():
        load_state_checked(model, weights, str(path / WEIGHTS_NAME))


def load_checkpoint(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer,
                    read_model: Callable[[Path, CausalLM], None] = _read_weights) -> dict[str, Any]:
    """Verify ``path``, load model (``read_model``: from the checkpoint directory), optimizer and RNG states in
    place, and return the trainer state."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        opt = load_file(str(path / OPTIMIZER_STATE))
        state = json.loads((path / TRAINER_STATE).read_text())
    except (SafetensorError, json.JSONDecodeError, OSError) as err:
        raise CheckpointError(f"{path}: unreadable: {err}") from None
    read_model(path, model)
    _restore_optimizer(optimizer, opt, state.pop("optimizer_param_groups"), str(path))
    torch.set_rng_state(opt["rng.torch"])
    cuda = [opt[k] for k in sorted(k for k in opt if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return state
