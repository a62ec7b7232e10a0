"""LoRA on a griffin model for training (Hu et al., 2021), with the ``peft`` package: each adapted projection
becomes ``W x + (alpha / r) B A dropout(x)``, with A (r, in) drawn as PEFT draws it and B (out, r) zero, so that the
model starts as the base model exactly. The base weights are frozen (and may stay in bfloat16); the adapters are
float32. The targets and their names: :mod:`griffin.interop.adapters`, which also writes and merges the files."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from griffin.interop.adapters import (
    LoraSettings,
    base_fingerprint,
    check_base,
    read_adapter,
    resolve_targets,
    save_adapter,
)
from griffin.interop.native import CONFIG_NAME
from griffin.io import write_json
from griffin.model import CausalLM


def _peft():
    try:
        import peft
    except ImportError:  # pragma: no cover - peft is in the finetune and test extras
        raise ValueError("LoRA training needs the peft package: pip install 'griffin[finetune]' (or train all "
                         "weights with --lora-rank 0)") from None
    return peft


def apply_lora(model: CausalLM, settings: LoraSettings, targets: str | list[str]) -> list[str]:
    """Freeze ``model`` and wrap the target projections (:func:`~griffin.interop.adapters.resolve_targets`) with
    trainable float32 LoRA adapters of ``settings``, in place; returns the adapted modules' names. A rank that is not
    positive or exceeds a target layer's smaller side is a ValueError naming the layer."""
    if isinstance(settings.r, bool) or not isinstance(settings.r, int) or settings.r < 1:
        raise ValueError(f"LoRA rank {settings.r!r} must be a positive integer (0 means no LoRA: full fine-tuning)")
    if not 0.0 <= settings.dropout < 1.0:
        raise ValueError(f"LoRA dropout {settings.dropout} must lie in [0, 1)")
    if not settings.alpha > 0:
        raise ValueError(f"LoRA alpha {settings.alpha} must be positive")
    modules = resolve_targets(model.config, targets)
    for name in modules:
        layer = model.get_submodule(name)
        if settings.r > min(layer.in_features, layer.out_features):
            raise ValueError(f"LoRA rank {settings.r} exceeds the layer {name} ({layer.in_features} -> "
                             f"{layer.out_features}): a rank above {min(layer.in_features, layer.out_features)} "
                             "adds nothing; lower --lora-rank")
    peft = _peft()
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             use_rslora=settings.rslora, target_modules=modules, bias="none")
    model.requires_grad_(False)
    peft.inject_adapter_in_model(config, model)
    for layer in lora_layers(model).values():
        for part in (layer.lora_A["default"], layer.lora_B["default"]):
            part.to(torch.float32).requires_grad_(True)
    return modules


WRAPPED = "_checkpoint_wrapped_module."  # torch's activation checkpointing wrapper, inside a block's name


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA-wrapped projections of ``model``, by name (empty if it has none); names as in a state dict, without
    activation checkpointing's wrapper module."""
    return {name.replace(WRAPPED, ""): m for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def lora_pairs(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """Each adapted module's (A, B) weights, by the module's name."""
    return {name: (m.lora_A["default"].weight, m.lora_B["default"].weight) for name, m in lora_layers(model).items()}


def lora_settings(model: nn.Module) -> LoraSettings:
    layer = next(iter(lora_layers(model).values()))
    dropout = layer.lora_dropout["default"]
    return LoraSettings(layer.r["default"], float(layer.lora_alpha["default"]),
                        float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0,
                        bool(layer.use_rslora.get("default", False)))


def base_weights(model: nn.Module) -> dict[str, Tensor]:
    """The frozen base weight under each adapter, by the module's name."""
    return {name: m.base_layer.weight for name, m in lora_layers(model).items()}


def save_lora(model: CausalLM, directory: str | Path, base: str) -> None:
    """Write ``model``'s adapters in PEFT's format (:func:`griffin.interop.adapters.save_adapter`), naming ``base``
    and fingerprinting its weights."""
    fingerprint = base_fingerprint(base_weights(model))
    save_adapter(directory, model.config, lora_settings(model), lora_pairs(model), fingerprint, base)


@torch.no_grad()
def load_lora_pairs(model: nn.Module, pairs: dict[str, tuple[Tensor, Tensor]], source: str) -> None:
    """Copy saved (A, B) pairs into ``model``'s adapters; every adapter must be given, with its shape."""
    layers = lora_layers(model)
    if set(pairs) != set(layers):
        missing, extra = sorted(set(layers) - set(pairs)), sorted(set(pairs) - set(layers))
        raise ValueError(f"{source}: the adapters do not match this run's (missing {missing}, unexpected {extra})")
    for name, (a, b) in pairs.items():
        layer = layers[name]
        for saved, param in ((a, layer.lora_A["default"].weight), (b, layer.lora_B["default"].weight)):
            if saved.shape != param.shape:
                raise ValueError(f"{source}: {name} has shape {tuple(saved.shape)}, this run's {tuple(param.shape)}")
            param.copy_(saved)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain projection back, in place: the model then computes
    what it computed with the adapters (in the base weights' precision) at a plain model's cost."""
    wrapped = [(name, m) for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    for name, layer in wrapped:
        layer.merge()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer.base_layer)
    return model


def write_lora(model: CausalLM, directory: Path, base: str) -> None:
    """A LoRA run's checkpoint model files: the adapters (:func:`save_lora`) and the model config (``config.json``,
    which resuming compares)."""
    save_lora(model, directory, base)
    write_json(Path(directory) / CONFIG_NAME, model.config.to_dict())


def read_lora(directory: Path, model: CausalLM) -> None:
    """Load a LoRA run's checkpointed adapters into ``model``'s, refusing adapters trained on another base model."""
    adapter = read_adapter(directory, model.config)
    check_base(adapter, base_weights(model))
    load_lora_pairs(model, adapter.pairs, str(directory))
