"""griffin: Hawk, Griffin and the MQA Transformer baseline (De et al., 2024) in PyTorch.

The names below are imported on first use, so that ``import griffin`` (and ``import griffin.threads``) loads
neither torch nor anything else: a program can make process-wide settings before torch starts
(:func:`griffin.threads.prefer_passive_openmp_wait`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from griffin.cache import Cache
    from griffin.config import PRESETS, ModelConfig
    from griffin.inference import Decoder, generate, generate_stream, prefill
    from griffin.interop import load_pretrained, save_pretrained
    from griffin.loading import Loaded, load_for_use
    from griffin.model import CausalLM, count_parameters

__version__ = "0.1.0"

_HOMES = {
    "Cache": "griffin.cache",
    "CausalLM": "griffin.model",
    "Decoder": "griffin.inference",
    "Loaded": "griffin.loading",
    "ModelConfig": "griffin.config",
    "PRESETS": "griffin.config",
    "count_parameters": "griffin.model",
    "generate": "griffin.inference",
    "generate_stream": "griffin.inference",
    "load_for_use": "griffin.loading",
    "load_pretrained": "griffin.interop",
    "prefill": "griffin.inference",
    "save_pretrained": "griffin.interop",
}
__all__ = ["Cache", "CausalLM", "Decoder", "Loaded", "ModelConfig", "PRESETS", "count_parameters", "generate",
           "generate_stream", "load_for_use", "load_pretrained", "prefill", "save_pretrained"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'griffin' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
