"""Checkpoints: griffin's own format, HuggingFace RecurrentGemma directories and official `recurrentgemma` files.

griffin format: a directory with ``config.json`` (a :class:`ModelConfig`) and ``model.safetensors``.
HF format: ``config.json`` with ``model_type: recurrent_gemma`` and one or more ``*.safetensors`` files.
LoRA adapters (:mod:`griffin.interop.adapters`): a directory with PEFT's ``adapter_config.json`` and
``adapter_model.safetensors`` loads as its base model (the checkpoint it names) with the adapter merged in.
Official format: a PyTorch state dict of ``recurrentgemma.torch.Griffin`` saved with ``torch.save``; it is read
with ``torch.load(weights_only=True)`` (never unpickling arbitrary objects) and its config is inferred from shapes.

The two reference implementations differ in semantics, and each import reproduces its own:
- window: HF's query sees ``attention_window_size`` keys (itself included), the official one sees
  ``attention_window_size + 1``; ``ModelConfig.attention_window`` counts keys seen, itself included.
- packed documents: both reset the RG-LRU and isolate attention at a document start; only the official one
  also masks the Conv1D (``ModelConfig.conv1d_document_reset``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from griffin.interop.adapters import AdapterError, adapter_base, is_adapter, merge_adapter
from griffin.interop.hf import export_hf, hf_config_to_griffin, load_hf
from griffin.interop.native import (
    CONFIG_NAME,
    DTYPES,
    WEIGHTS_NAME,
    CheckpointError,
    load_griffin,
    load_state_checked,
    resolve_dtype,
    save_pretrained,
)
from griffin.interop.official import load_official, official_config_from_state, save_official, to_official_state
from griffin.io import check_new_output, read_json
from griffin.model import CausalLM
from griffin.quantize import quantization_of, quantize_int8


def detect_format(path: str | Path) -> str:
    """``griffin``, ``hf``, ``official`` or ``adapter`` for a checkpoint path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if is_adapter(path):
        return "adapter"
    if path.is_file():
        if path.suffix in (".pt", ".pth", ".ckpt", ".bin"):
            return "official"
        raise CheckpointError(f"{path}: expected a directory or a .pt/.pth/.ckpt official state dict")
    config = path / CONFIG_NAME
    if config.exists():
        cfg = read_json(config)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{config} is not a JSON object of config fields")
        if cfg.get("model_type") == "recurrent_gemma":
            return "hf"
        if "family" in cfg and "width" in cfg:
            return "griffin"
        raise CheckpointError(f"{config} is neither a griffin nor an HF RecurrentGemma config")
    candidates = [p for p in path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt")]
    if len(candidates) == 1:
        return "official"
    raise CheckpointError(f"{path} has no {CONFIG_NAME} and not exactly one .pt/.pth/.ckpt file")


def load_pretrained(path: str | Path, dtype: torch.dtype | str | None = None, *, adapter: str | Path | None = None,
                    **overrides: Any) -> CausalLM:
    """Load a griffin, HF RecurrentGemma or official recurrentgemma checkpoint (format detected); with ``adapter``
    (a LoRA adapter directory, :mod:`griffin.interop.adapters`) merged into its weights. A LoRA adapter directory as
    ``path`` loads the base model it names (``base_model_name_or_path``) with the adapter merged.

    ``overrides`` apply to official checkpoints only (``attention_window_size``, ``logits_soft_cap``,
    ``embed_scale``), whose config is not stored with the weights.
    """
    path = Path(path)
    dtype = resolve_dtype(dtype)
    fmt = detect_format(path)
    if overrides and fmt != "official":
        raise TypeError(f"options {sorted(overrides)} only apply to official checkpoints, not {fmt}")
    if adapter is not None:  # merged into the weights as stored (what the adapter's base fingerprint saw), then cast
        if fmt == "adapter":
            raise ValueError(f"{path} is itself a LoRA adapter: give its base model, then the adapter")
        model = load_pretrained(path, None, **overrides)
        merge_adapter(model, adapter)
        return model if dtype is None or quantization_of(model) is not None else model.to(dtype)
    if fmt == "adapter":
        base = adapter_base(path)
        if not base or not Path(base).exists():
            raise CheckpointError(f"{path} is a LoRA adapter whose base model {base or '(not named)'} is not here: "
                                  "name the base checkpoint and pass this directory as its adapter (--adapter)")
        return load_pretrained(base, dtype, adapter=path)
    if fmt == "griffin":
        return load_griffin(path, dtype)
    if fmt == "hf":
        return load_hf(path, dtype)
    if path.is_dir():
        path = next(p for p in path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt"))
    return load_official(path, dtype, **overrides)


def quantize_checkpoint(src: str | Path, dst: str | Path, group_size: int = 0,
                        dtype: torch.dtype | str | None = None, gates: bool = True, *,
                        overwrite: bool = False) -> CausalLM:
    """Load a checkpoint (any format), quantise its weights to int8 (:func:`griffin.quantize.quantize_int8`; ``gates``:
    the RG-LRU's gates too) and write it to ``dst`` in griffin's format: int8 matrices and their float32 scales in
    ``model.safetensors``, loadable by :func:`load_pretrained` without quantising again. Returns the quantised
    model. An existing, non-empty ``dst`` is refused (:class:`~griffin.io.OutputExistsError`) unless ``overwrite``."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"the quantised checkpoint would overwrite its source {src}: give another directory")
    check_new_output(dst, overwrite)
    model = load_pretrained(src, dtype=dtype)
    done = quantization_of(model)
    if done is not None:
        raise ValueError(f"{src} is already quantised ({done['method']}, group_size={done['group_size']}): quantise "
                         "the float checkpoint it came from")
    model = quantize_int8(model, group_size, inplace=True, gates=gates)
    save_pretrained(model, dst)
    return model


__all__ = ["CONFIG_NAME", "DTYPES", "WEIGHTS_NAME", "AdapterError", "CheckpointError", "adapter_base",
           "detect_format", "export_hf", "hf_config_to_griffin", "is_adapter", "load_pretrained",
           "load_state_checked", "merge_adapter", "official_config_from_state", "quantize_checkpoint", "resolve_dtype",
           "save_official", "save_pretrained", "to_official_state"]
