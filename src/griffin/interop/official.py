"""The official ``recurrentgemma`` package's PyTorch checkpoints: a state dict of ``recurrentgemma.torch.Griffin``
saved with ``torch.save``, read with ``torch.load(weights_only=True)`` (never unpickling arbitrary objects), its
config inferred from the shapes; the official semantics (the Conv1D reset at document starts; a query sees
``attention_window_size + 1`` keys). The settings the weights do not hold (window, embedding scale, soft-cap) are
written beside the state dict as the official ``GriffinConfig``'s fields (``model.pt`` -> ``model.json``) and read
back from there, so that a conversion round-trips exactly."""

from __future__ import annotations

import importlib.util
import pickle
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.config import ModelConfig
from griffin.interop.native import CheckpointError, build_model
from griffin.io import atomic_write, check_new_output, read_json, write_json
from griffin.model import CausalLM
from griffin.quantize import quantization_of


def official_config_from_state(
    state: dict[str, Tensor], attention_window_size: int = 2048, logits_soft_cap: float | None = 30.0,
    embed_scale: bool = True,
) -> ModelConfig:
    """Infer the ModelConfig of an official ``recurrentgemma.torch.Griffin`` state dict from its shapes.

    Window, soft-cap and embedding scale are not stored in the weights; the defaults are RecurrentGemma's.
    """
    if "embedder.input_embedding" not in state:
        raise CheckpointError("not an official recurrentgemma state dict: no 'embedder.input_embedding'")
    vocab, width = state["embedder.input_embedding"].shape
    block_types, rnn_width, gate_blocks, head_dim = [], width, None, None
    i = 0
    while f"blocks.{i}.channel_pre_norm.scale" in state:
        if f"blocks.{i}.recurrent_block.rg_lru.a_gate.w" in state:
            block_types.append("recurrent")
            blocks, bw, _ = state[f"blocks.{i}.recurrent_block.rg_lru.a_gate.w"].shape
            rnn_width, gate_blocks = blocks * bw, blocks
        elif f"blocks.{i}.attention_block.proj_k.weight" in state:
            block_types.append("local_attention")
            head_dim = state[f"blocks.{i}.attention_block.proj_k.weight"].shape[0]
        else:
            raise CheckpointError(f"cannot recognise the temporal block of blocks.{i}")
        i += 1
    if not block_types:
        raise CheckpointError("official state dict has no blocks")
    num_heads = width // head_dim if head_dim else gate_blocks
    head_dim = head_dim or width // num_heads
    return ModelConfig(
        family="griffin" if "local_attention" in block_types else "hawk",
        vocab_size=vocab, width=width, depth=len(block_types), rnn_width=rnn_width,
        mlp_width=state["blocks.0.mlp_block.ffw_up.w"].shape[-1],
        num_heads=num_heads, head_dim=head_dim, num_kv_heads=1, block_types=tuple(block_types),
        attention_window=attention_window_size + 1,  # the official mask admits window_size + 1 keys
        gate_blocks=gate_blocks or num_heads, embed_scale=embed_scale, logits_soft_cap=logits_soft_cap,
        rope_fraction=0.5, rope_base=10_000.0, gelu_approximation="tanh",
        conv1d_document_reset=True, attention_document_mask=True,
    )


def from_official_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name == "embedder.input_embedding":
            out["embed.weight"] = t
            continue
        if name.startswith("blocks.") and ".mlp_block.ffw_up." in name:
            prefix = name.split("ffw_up.")[0]
            if name.endswith(".w"):
                out[prefix + "gate_proj.weight"] = t[0].T.contiguous()
                out[prefix + "up_proj.weight"] = t[1].T.contiguous()
            else:
                out[prefix + "gate_proj.bias"] = t[0].reshape(-1)
                out[prefix + "up_proj.bias"] = t[1].reshape(-1)
            continue
        name = name.replace(".recurrent_block.", ".temporal_block.").replace(".attention_block.", ".temporal_block.")
        name = name.replace(".mlp_block.ffw_down.", ".mlp_block.down_proj.")
        out[name] = t
    return out


def to_official_state(model: CausalLM) -> dict[str, Tensor]:
    """The state dict of the equivalent official ``recurrentgemma.torch.Griffin``."""
    if quantization_of(model) is not None:
        raise CheckpointError("an official recurrentgemma model has no int8 weights: convert the float checkpoint "
                              "this one was quantised from")
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "embed.weight":
            out["embedder.input_embedding"] = t
            continue
        if name.startswith("blocks."):
            i = int(name.split(".")[1])
            kind = model.config.block_types[i]
            block = "recurrent_block" if kind == "recurrent" else "attention_block"
            if ".mlp_block.gate_proj." in name or ".mlp_block.up_proj." in name:
                continue
            name = name.replace(".temporal_block.", f".{block}.")
            name = name.replace(".mlp_block.down_proj.", ".mlp_block.ffw_down.")
        out[name] = t
    for i in range(model.config.depth):
        mlp = model.blocks[i].mlp_block
        out[f"blocks.{i}.mlp_block.ffw_up.w"] = torch.stack([mlp.gate_proj.weight.T, mlp.up_proj.weight.T])
        out[f"blocks.{i}.mlp_block.ffw_up.b"] = torch.stack([mlp.gate_proj.bias, mlp.up_proj.bias])[:, None, None]
    return {k: v.detach().clone() for k, v in out.items()}


def official_problems(config: ModelConfig) -> list[str]:
    """What the official ``recurrentgemma.torch.Griffin`` cannot express of ``config`` (empty if it can)."""
    c = config
    checks = [
        ("attention" not in c.block_types, "global attention blocks (the official model has local attention only)"),
        (c.head_dim * c.num_heads == c.width, f"head_dim={c.head_dim} * num_heads={c.num_heads} != width={c.width}"),
        (c.gate_blocks == c.num_heads, f"gate_blocks={c.gate_blocks} != num_heads={c.num_heads}"),
        (c.num_kv_heads == 1, f"num_kv_heads={c.num_kv_heads} (the official attention has one key/value head)"),
        (c.tie_embeddings, "untied embeddings"),
        (not c.complex_lru, "the complex CG-LRU"),
        (c.gelu_approximation == "tanh", f"gelu_approximation={c.gelu_approximation!r}"),
        ((c.rope_fraction, c.rope_base) == (0.5, 10_000.0),
         f"rope_fraction={c.rope_fraction}, rope_base={c.rope_base}"),
        ((c.conv1d_width, c.rg_lru_c, c.norm_eps) == (4, 8.0, 1e-6),
         f"conv1d_width={c.conv1d_width}, rg_lru_c={c.rg_lru_c}, norm_eps={c.norm_eps}"),
        (c.conv1d_document_reset and c.attention_document_mask, "no Conv1D reset or attention mask at document starts"),
        (c.attention_window >= 2 or "local_attention" not in c.block_types, f"attention_window={c.attention_window}"),
    ]
    return [problem for ok, problem in checks if not ok]


def sidecar_path(path: Path) -> Path:
    """Where the official ``GriffinConfig`` fields of a state dict file are kept: ``model.pt`` -> ``model.json``."""
    return Path(path).with_suffix(".json")


def save_official(model: CausalLM, path: str | Path, lossy: bool = False, *, overwrite: bool = True) -> None:
    """Write the official ``recurrentgemma.torch.Griffin`` state dict of ``model`` and, beside it, the official
    ``GriffinConfig`` fields (both atomically). A model the official one cannot express is refused, unless
    ``lossy`` (then with a warning: the file holds a different model); with ``overwrite=False`` so is an existing
    file or sidecar (:class:`~griffin.io.OutputExistsError`)."""
    for output in (Path(path), sidecar_path(Path(path))):
        check_new_output(output, overwrite)
    problems = official_problems(model.config)
    if problems and not lossy:
        raise CheckpointError("this model cannot be expressed as an official recurrentgemma model: "
                              + "; ".join(problems) + " (pass lossy=True / --lossy to write it anyway)")
    if problems:
        warnings.warn("writing a lossy official checkpoint: " + "; ".join(problems), stacklevel=2)
    c, path = model.config, Path(path)
    fields = {
        "vocab_size": c.vocab_size, "width": c.width, "mlp_expanded_width": c.mlp_width, "num_heads": c.num_heads,
        "block_types": ["recurrent" if k == "recurrent" else "attention" for k in c.block_types],
        "embeddings_scale_by_sqrt_dim": c.embed_scale,
        "attention_window_size": c.attention_window - 1,  # the official mask admits window_size + 1 keys
        "logits_soft_cap": c.logits_soft_cap or 0.0, "lru_width": c.rnn_width,
    }
    state = to_official_state(model)
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    write_json(sidecar_path(path), fields)


def load_official(path: Path, dtype: torch.dtype | None, **overrides: Any) -> CausalLM:
    """The model of an official state dict; window, embedding scale and soft-cap from ``overrides``, else from the
    ``GriffinConfig`` fields beside the file, else RecurrentGemma's defaults."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} is not a PyTorch state dict of tensors: {err}") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors")
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        fields = read_json(sidecar)
        try:
            saved = {"attention_window_size": int(fields["attention_window_size"]),
                     "embed_scale": bool(fields["embeddings_scale_by_sqrt_dim"]),
                     "logits_soft_cap": float(fields["logits_soft_cap"]) or None}
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{sidecar}: not the official GriffinConfig fields ({err})") from None
        overrides = {**saved, **overrides}
    try:
        config = official_config_from_state(state, **overrides)
    except (KeyError, ValueError, IndexError) as err:
        raise CheckpointError(f"{path}: {err}") from None
    return build_model(config, from_official_state(state, config), str(path), dtype)




def import_official_torch() -> Any:
    """The official package's ``recurrentgemma.torch`` without running ``recurrentgemma/__init__`` (which imports
    JAX), for comparisons in tests and benchmarks. Raises ImportError if the package is not installed."""
    if "recurrentgemma.torch" in sys.modules:
        return sys.modules["recurrentgemma.torch"]
    spec = importlib.util.find_spec("recurrentgemma")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("the recurrentgemma package is not installed")
    if "recurrentgemma" not in sys.modules:
        package = types.ModuleType("recurrentgemma")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec  # so that importlib.util.find_spec("recurrentgemma") still answers
        sys.modules["recurrentgemma"] = package
    import recurrentgemma.torch as rg

    return rg
