"""LoRA adapters in HF PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``, with the modules
named as in griffin's HF export (:func:`griffin.interop.export_hf`), so that ``peft.PeftModel.from_pretrained`` loads
them onto the exported model; read back here to merge into a griffin model (W + (alpha / r) B A) without the
``peft`` package.

Every projection of a griffin block is an ``nn.Linear`` of its own, as in HF's RecurrentGemma (the decoder's fused
matmuls are a module swap applied after merging), so each LoRA pair maps onto one module:

============  =================================  =========================================
group         HF / PEFT name                     griffin module
============  =================================  =========================================
attention     q_proj, k_proj, v_proj, o_proj     proj_q, proj_k, proj_v, proj_final
mlp           gate_proj, up_proj, down_proj      the same names
recurrent     linear_x, linear_y, linear_out     the same names
============  =================================  =========================================

The RG-LRU's gates get no adapter: they are block-diagonal (one small matrix per head, Section 2.4), stored as raw
parameters of HF's RG-LRU module, which PEFT's LoRA cannot wrap, and a low-rank update would fill the blocks' zeros.
Full fine-tuning trains them.

An adapter written by griffin records a fingerprint of the base weights it was trained on (a sample of each adapted
weight, in the safetensors metadata); merging it into another base model is refused. Adapters from elsewhere carry
none: their modules and shapes are checked.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.config import ModelConfig
from griffin.interop.hf import hf_name_map
from griffin.interop.native import CheckpointError
from griffin.io import FileFormatError, read_json, read_safetensors, write_json, write_safetensors
from griffin.model import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the PeftModel, then the wrapped model's own module names
FINGERPRINT_KEY = "griffin_base_fingerprint"

#: The LoRA targets by their HF (PEFT) names, each with its griffin name, in groups.
GROUPS = {
    "attention": {"q_proj": "proj_q", "k_proj": "proj_k", "v_proj": "proj_v", "o_proj": "proj_final"},
    "mlp": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "recurrent": {"linear_x": "linear_x", "linear_y": "linear_y", "linear_out": "linear_out"},
}
TARGETS = {hf: ours for group in GROUPS.values() for hf, ours in group.items()}
GRIFFIN_TO_HF_LEAF = {ours: hf for hf, ours in TARGETS.items()}


class AdapterError(CheckpointError):
    """An adapter that does not fit the model it is applied to, or a file that is no LoRA adapter."""


def linear_modules(config: ModelConfig) -> dict[str, str]:
    """Every projection LoRA can adapt: griffin module name -> HF module name (``blocks.3.mlp_block.up_proj`` ->
    ``model.layers.3.mlp_block.up_proj``)."""
    out = {}
    for ours, theirs in hf_name_map(config).items():
        if ours.endswith(".weight"):
            module, hf_module = ours.removesuffix(".weight"), theirs.removesuffix(".weight")
            if module.rsplit(".", 1)[-1] in GRIFFIN_TO_HF_LEAF:
                out[module] = hf_module
    return out


def resolve_targets(config: ModelConfig, targets: str | Sequence[str]) -> list[str]:
    """The griffin module names LoRA adapts, from target names: HF names (``q_proj``, ``linear_x``), griffin names
    (``proj_q``), groups (``attention``, ``mlp``, ``recurrent``) or ``all``, comma-separated or a list. A name that is
    none of these is a ValueError suggesting the closest; names that match no layer of this model (``q_proj`` in
    Hawk, which has no attention) are refused only when none of them matches."""
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if not names:
        raise ValueError("no LoRA target modules given: name some of " + _target_help())
    leaves: set[str] = set()
    for name in names:
        if name == "all":
            leaves |= set(TARGETS.values())
        elif name in GROUPS:
            leaves |= set(GROUPS[name].values())
        elif name in TARGETS:
            leaves.add(TARGETS[name])
        elif name in GRIFFIN_TO_HF_LEAF:
            leaves.add(name)
        else:
            known = ["all", *GROUPS, *TARGETS, *GRIFFIN_TO_HF_LEAF]
            close = difflib.get_close_matches(name, known, n=3)
            raise ValueError(f"unknown LoRA target module {name!r}" + (f"; did you mean {close}?" if close else "")
                             + "; targets: " + _target_help())
    modules = [m for m in linear_modules(config) if m.rsplit(".", 1)[-1] in leaves]
    if not modules:
        kinds = sorted(set(config.block_types))
        raise ValueError(f"LoRA targets {names} match no layer of this {config.family} model (blocks: "
                         f"{', '.join(kinds)}); targets: " + _target_help())
    return modules


def _target_help() -> str:
    return "all, " + "; ".join(f"{group} ({', '.join(names)})" for group, names in GROUPS.items())


def base_fingerprint(weights: Mapping[str, Tensor]) -> str:
    """A fingerprint of base weights (griffin module name -> weight): the shapes and 257 evenly spaced values of each,
    rounded to bfloat16, so that the same weights give the same fingerprint in any float dtype and format."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        w = weights[name].detach().reshape(-1)
        index = torch.linspace(0, w.numel() - 1, min(w.numel(), 257), device=w.device).round().long()
        digest.update(f"{name}:{tuple(weights[name].shape)}".encode())
        digest.update(w[index].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass
class LoraSettings:
    """An adapter's hyper-parameters: rank ``r``, ``alpha`` (the update is scaled by alpha / r; by alpha / sqrt(r)
    with ``rslora``), ``dropout`` on the adapter's input in training."""

    r: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


@dataclass
class Adapter:
    """An adapter read from disk: its settings, its pairs (griffin module name -> (A (r, in), B (out, r))), the base
    fingerprint it records (None: written elsewhere) and the base model it names."""

    settings: LoraSettings
    pairs: dict[str, tuple[Tensor, Tensor]]
    fingerprint: str | None
    base: str
    path: Path


def save_adapter(directory: str | Path, config: ModelConfig, settings: LoraSettings,
                 pairs: Mapping[str, tuple[Tensor, Tensor]], fingerprint: str, base: str) -> None:
    """Write ``pairs`` (griffin module name -> (A, B)) in PEFT's format into ``directory``: ``adapter_config.json``
    naming ``base`` and the HF leaf names adapted, ``adapter_model.safetensors`` with the HF module names, in float32,
    and the base ``fingerprint`` in its metadata."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = linear_modules(config)
    unknown = sorted(set(pairs) - set(names))
    if unknown:
        raise ValueError(f"not a LoRA target of this model: {unknown}")
    tensors = {}
    for module, (a, b) in pairs.items():
        key = PREFIX + names[module]
        tensors[key + ".lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[key + ".lora_B.weight"] = b.detach().float().contiguous().cpu()
    targets = sorted({GRIFFIN_TO_HF_LEAF[m.rsplit(".", 1)[-1]] for m in pairs})
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "r": settings.r, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "use_rslora": settings.rslora,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "use_dora": False, "inference_mode": True,
    }
    write_safetensors(directory / ADAPTER_WEIGHTS, tensors, {"format": "pt", FINGERPRINT_KEY: fingerprint})
    write_json(directory / ADAPTER_CONFIG, peft_config)


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a LoRA adapter (``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(directory: str | Path, config: ModelConfig) -> Adapter:
    """The adapter in ``directory``, for a model of ``config``: a file that is missing or malformed, an adapter kind
    griffin cannot merge (DoRA, biases, modules saved whole, per-layer ranks, aLoRA, ...), or a module or shape this
    model does not have is an :class:`AdapterError` naming it."""
    directory = Path(directory)
    if not is_adapter(directory):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {directory}: not a LoRA adapter directory")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{directory} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    try:
        cfg = read_json(directory / ADAPTER_CONFIG)
    except FileFormatError as err:
        raise AdapterError(str(err)) from None
    source = directory / ADAPTER_CONFIG
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else cfg
        raise AdapterError(f"{source}: not a LoRA adapter (peft_type {kind!r})")
    # (PEFT's variants that a plain W + scale B A does not express: lora_bias adds a bias to B, aLoRA adapts only the
    # tokens after its invocation tokens, QALoRA pools A's input, trainable tokens change embedding rows, ...)
    unsupported = [(key, cfg.get(key)) for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                                                     "fan_in_fan_out", "lora_bias", "alora_invocation_tokens",
                                                     "use_qalora", "trainable_token_indices", "layer_replication",
                                                     "target_parameters") if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(("bias", cfg["bias"]))
    if unsupported:
        raise AdapterError(f"{source}: griffin merges plain LoRA only; this adapter has "
                           + ", ".join(f"{k}={v!r}" for k, v in unsupported))
    try:
        settings = LoraSettings(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout") or 0.0),
                                bool(cfg.get("use_rslora", False)))
    except (KeyError, TypeError, ValueError) as err:
        raise AdapterError(f"{source}: lacks a valid r or lora_alpha ({err})") from None
    if settings.r < 1:
        raise AdapterError(f"{source}: r={settings.r} must be positive")
    tensors, metadata = read_safetensors(directory / ADAPTER_WEIGHTS)
    modules = {hf: ours for ours, hf in linear_modules(config).items()}
    shapes = _shapes(config)
    pairs, problems = {}, []
    keys = {}
    for key in tensors:
        name = key.removeprefix(PREFIX)
        for part in (".lora_A.weight", ".lora_B.weight"):
            if name.endswith(part):
                keys.setdefault(name.removesuffix(part), {})[part[6]] = tensors[key]
                break
        else:
            problems.append(f"unexpected tensor {key}")
    for hf, ab in sorted(keys.items()):
        ours = modules.get(hf)
        if ours is None:
            problems.append(f"{hf}: no such layer in this model (a {config.family} of depth {config.depth})")
            continue
        if set(ab) != {"A", "B"}:
            problems.append(f"{hf}: lora_A and lora_B must come together")
            continue
        a, b = ab["A"], ab["B"]
        out_features, in_features = shapes[ours]
        if tuple(a.shape) != (settings.r, in_features) or tuple(b.shape) != (out_features, settings.r):
            problems.append(f"{hf}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a {in_features} -> "
                            f"{out_features} layer at rank {settings.r}")
            continue
        pairs[ours] = (a, b)
    if problems:
        raise AdapterError(f"the adapter {directory} does not fit this model (it was made for another base model):\n  "
                           + "\n  ".join(problems))
    if not pairs:
        raise AdapterError(f"{directory / ADAPTER_WEIGHTS} holds no LoRA weights")
    return Adapter(settings, pairs, metadata.get(FINGERPRINT_KEY), str(cfg.get("base_model_name_or_path") or ""),
                   directory)


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    with torch.device("meta"):
        model = CausalLM(config)
    return {name: tuple(model.get_submodule(name).weight.shape) for name in linear_modules(config)}


def check_base(adapter: Adapter, weights: Mapping[str, Tensor]) -> None:
    """Refuse ``adapter`` (an :class:`AdapterError`) if it records a fingerprint and ``weights`` (its modules' base
    weights) give another one: it was trained on another base model."""
    if adapter.fingerprint is None:
        return
    found = base_fingerprint({name: weights[name] for name in adapter.pairs})
    if found != adapter.fingerprint:
        named = f" ({adapter.base})" if adapter.base else ""
        raise AdapterError(f"the adapter {adapter.path} was trained on another base model{named}: its base weights' "
                           f"fingerprint is {adapter.fingerprint}, this model's {found} (the same weights stored in "
                           "another precision differ too: merge into the checkpoint it was trained on)")


@torch.no_grad()
def merge_adapter(model: CausalLM, directory: str | Path) -> Adapter:
    """Add the LoRA adapter in ``directory`` to ``model``'s weights in place: W += scale B A, computed in float32
    (at least) and rounded once to W's dtype. An int8 model is refused (merge into the float weights, then quantise);
    an adapter for another model, by shapes or by base fingerprint, is an :class:`AdapterError`."""
    from griffin.quantize import quantization_of

    if quantization_of(model) is not None:
        raise AdapterError("the model holds int8 weights: merge the adapter into the float checkpoint, then quantise "
                           "(griffin merge, griffin quantize), or load it with --quantize int8")
    adapter = read_adapter(directory, model.config)
    weights = {name: model.get_submodule(name).weight for name in adapter.pairs}
    check_base(adapter, weights)
    for name, (a, b) in adapter.pairs.items():
        w = weights[name]
        dtype = torch.promote_types(w.dtype, torch.float32)
        delta = (b.to(w.device, dtype) @ a.to(w.device, dtype)) * adapter.settings.scale
        w.copy_((w.to(dtype) + delta).to(w.dtype))
    return adapter


def adapter_base(directory: str | Path) -> str:
    """The base model an adapter names (``base_model_name_or_path``), '' if none."""
    cfg = read_json(Path(directory) / ADAPTER_CONFIG)
    return str(cfg.get("base_model_name_or_path") or "") if isinstance(cfg, dict) else ""


def adapter_summary(directory: str | Path) -> dict[str, Any]:
    """What ``griffin info`` shows of an adapter: its PEFT config's main fields."""
    cfg = read_json(Path(directory) / ADAPTER_CONFIG)
    return {k: cfg.get(k) for k in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                    "base_model_name_or_path")}
