"""Checkpoints: griffin's own format, HuggingFace RecurrentGemma directories and official `recurrentgemma` files.

griffin format: a directory with ``config.json`` (a :class:`ModelConfig`) and ``model.safetensors``.
HF format: ``config.json`` with ``model_type: recurrent_gemma`` and one or more ``*.safetensors`` files.
Official format: a PyTorch state dict of ``recurrentgemma.torch.Griffin`` saved with ``torch.save``; it is read
with ``torch.load(weights_only=True)`` (never unpickling arbitrary objects) and its config is inferred from shapes.

The two reference implementations differ in semantics, and each import reproduces its own:
- window: HF's query sees ``attention_window_size`` keys (itself included), the official one sees
  ``attention_window_size + 1``; ``ModelConfig.attention_window`` counts keys seen, itself included.
- packed documents: both reset the RG-LRU and isolate attention at a document start; only the official one
  also masks the Conv1D (``ModelConfig.conv1d_document_reset``).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from griffin.config import ModelConfig
from griffin.model import CausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model it describes."""


# Atomic writes ----------------------------------------------------------------------------------------
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


def _write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# Loading with full reporting ------------------------------------------------------------------------
def load_state_checked(model: CausalLM, state: dict[str, Tensor], source: str) -> None:
    """Load ``state`` into ``model``; raise one error that names every missing, unexpected or misshapen tensor."""
    expected = model.state_dict()
    problems = []
    for name in sorted(set(expected) - set(state)):
        problems.append(f"missing: {name} {tuple(expected[name].shape)}")
    for name in sorted(set(state) - set(expected)):
        problems.append(f"unexpected: {name} {tuple(state[name].shape)}")
    for name in sorted(set(state) & set(expected)):
        if tuple(state[name].shape) != tuple(expected[name].shape):
            problems.append(
                f"shape mismatch: {name} is {tuple(state[name].shape)} in {source}, "
                f"model expects {tuple(expected[name].shape)}"
            )
    if problems:
        raise CheckpointError(f"cannot load {source}:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.dtype))


def _build(config: ModelConfig, state: dict[str, Tensor], source: str, dtype: torch.dtype | None) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device="cpu")
    if dtype is None:
        dtype = next(iter(state.values())).dtype if state else torch.float32
        dtype = dtype if dtype.is_floating_point else torch.float32
    model = model.to(dtype)
    load_state_checked(model, state, source)
    return model.eval()


# griffin format ---------------------------------------------------------------------------------------
def save_pretrained(model: CausalLM, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``."""
    directory = Path(directory)
    state = dict(model.state_dict())
    _write_safetensors(directory / WEIGHTS_NAME, state, {"format": "pt", "library": "griffin"})
    _write_json(directory / CONFIG_NAME, model.config.to_dict())


def _load_griffin(directory: Path, dtype: torch.dtype | None) -> CausalLM:
    config = ModelConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    weights = directory / WEIGHTS_NAME
    if not weights.exists():
        raise CheckpointError(f"{directory} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
    return _build(config, load_file(str(weights)), str(weights), dtype)


# HuggingFace RecurrentGemma ---------------------------------------------------------------------------
def hf_config_to_griffin(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig reproducing ``transformers``' RecurrentGemmaForCausalLM for an HF config.json."""
    depth = int(cfg["num_hidden_layers"])
    pattern = list(cfg.get("block_types") or ["recurrent", "recurrent", "attention"])
    block_types = tuple("recurrent" if pattern[i % len(pattern)] == "recurrent" else "local_attention"
                        for i in range(depth))
    width, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(f"unsupported hidden_activation {activation!r} in HF config")
    families = {"recurrent": "hawk", "local_attention": "griffin"}
    return ModelConfig(
        family="griffin" if "local_attention" in block_types else families["recurrent"],
        vocab_size=int(cfg["vocab_size"]),
        width=width,
        depth=depth,
        rnn_width=int(cfg.get("lru_width") or width),
        mlp_width=int(cfg["intermediate_size"]) // 2,
        num_heads=heads,
        head_dim=width // heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        block_types=block_types,
        attention_window=int(cfg.get("attention_window_size", 2048)),
        conv1d_width=int(cfg.get("conv1d_width", 4)),
        gate_blocks=heads,
        rope_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
        rope_fraction=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))),
        tie_embeddings=True,
        embed_scale=True,
        logits_soft_cap=float(cfg.get("logits_soft_cap", 30.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        gelu_approximation="tanh" if activation == "gelu_pytorch_tanh" else "none",
        conv1d_document_reset=False,
        attention_document_mask=True,
    )


def _hf_name_map(config: ModelConfig) -> dict[str, str]:
    """griffin name -> HF name, for tensors whose layout is the same up to the transforms below."""
    names = {"embed.weight": "model.embed_tokens.weight", "final_norm.scale": "model.final_norm.weight"}
    for i, kind in enumerate(config.block_types):
        g, h = f"blocks.{i}.", f"model.layers.{i}."
        names[g + "temporal_pre_norm.scale"] = h + "temporal_pre_norm.weight"
        names[g + "channel_pre_norm.scale"] = h + "channel_pre_norm.weight"
        for lin in ("gate_proj", "up_proj", "down_proj"):
            for p in ("weight", "bias"):
                names[f"{g}mlp_block.{lin}.{p}"] = f"{h}mlp_block.{lin}.{p}"
        gt, ht = g + "temporal_block.", h + "temporal_block."
        if kind == "recurrent":
            for lin in ("linear_x", "linear_y", "linear_out"):
                for p in ("weight", "bias"):
                    names[f"{gt}{lin}.{p}"] = f"{ht}{lin}.{p}"
            names[gt + "conv_1d.w"] = ht + "conv_1d.weight"
            names[gt + "conv_1d.b"] = ht + "conv_1d.bias"
            names[gt + "rg_lru.a_param"] = ht + "rg_lru.recurrent_param"
            names[gt + "rg_lru.input_gate.w"] = ht + "rg_lru.input_gate_weight"
            names[gt + "rg_lru.input_gate.b"] = ht + "rg_lru.input_gate_bias"
            names[gt + "rg_lru.a_gate.w"] = ht + "rg_lru.recurrent_gate_weight"
            names[gt + "rg_lru.a_gate.b"] = ht + "rg_lru.recurrent_gate_bias"
        else:
            for ours, theirs in (("proj_q", "q_proj"), ("proj_k", "k_proj"), ("proj_v", "v_proj")):
                names[f"{gt}{ours}.weight"] = f"{ht}{theirs}.weight"
            names[gt + "proj_final.weight"] = ht + "o_proj.weight"
            names[gt + "proj_final.bias"] = ht + "o_proj.bias"
    return names


def _conv_from_hf(w: Tensor) -> Tensor:  # (R, 1, K) -> (K, R)
    return w[:, 0, :].T.contiguous() if w.dim() == 3 else w


def _load_hf(directory: Path, dtype: torch.dtype | None) -> CausalLM:
    config = hf_config_to_griffin(json.loads((directory / CONFIG_NAME).read_text()))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds an HF config but no *.safetensors weights")
    hf: dict[str, Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    names = _hf_name_map(config)
    expected = set(names.values())
    problems = [f"missing: {n}" for n in sorted(expected - set(hf))]
    problems += [f"unexpected: {n}" for n in sorted(set(hf) - expected - {"lm_head.weight"})]
    if problems:
        raise CheckpointError(f"cannot load {directory}:\n  " + "\n  ".join(problems))
    state = {ours: _conv_from_hf(hf[theirs]) if ours.endswith("conv_1d.w") else hf[theirs]
             for ours, theirs in names.items()}
    return _build(config, state, str(directory), dtype)


def export_hf(model: CausalLM, directory: str | Path) -> None:
    """Write ``model`` as a HuggingFace RecurrentGemma directory (config.json + model.safetensors)."""
    c = model.config
    problems = []
    if "attention" in c.block_types:
        problems.append("global attention blocks (HF RecurrentGemma only has local attention)")
    if c.head_dim * c.num_heads != c.width:
        problems.append(f"head_dim={c.head_dim} * num_heads={c.num_heads} != width={c.width}")
    if c.gate_blocks != c.num_heads:
        problems.append(f"gate_blocks={c.gate_blocks} != num_heads={c.num_heads}")
    if not c.embed_scale:
        problems.append("embed_scale=False (HF always scales embeddings by sqrt(width))")
    if not c.logits_soft_cap:
        problems.append("no logits_soft_cap (HF always soft-caps logits)")
    if not c.tie_embeddings:
        problems.append("untied embeddings")
    if c.complex_lru:
        problems.append("the complex CG-LRU")
    if not c.attention_document_mask:
        problems.append("attention_document_mask=False")
    if problems:
        raise CheckpointError("this model cannot be expressed as HF RecurrentGemma: " + "; ".join(problems))
    if c.conv1d_document_reset:
        warnings.warn("HF RecurrentGemma does not reset the Conv1D at document starts: logits on packed "
                      "documents will differ from griffin's (single documents are unaffected)", stacklevel=2)
    pattern = ["recurrent" if k == "recurrent" else "attention" for k in c.block_types]
    cfg = {
        "architectures": ["RecurrentGemmaForCausalLM"],
        "model_type": "recurrent_gemma",
        "vocab_size": c.vocab_size,
        "hidden_size": c.width,
        "intermediate_size": 2 * c.mlp_width,
        "num_hidden_layers": c.depth,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "lru_width": c.rnn_width,
        "attention_window_size": c.attention_window,
        "conv1d_width": c.conv1d_width,
        "logits_soft_cap": c.logits_soft_cap,
        "rms_norm_eps": c.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh" if c.gelu_approximation == "tanh" else "gelu",
        "rope_theta": c.rope_base,
        "partial_rotary_factor": c.rope_fraction,
        "block_types": pattern,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": str(model.dtype).removeprefix("torch."),
    }
    state = model.state_dict()
    hf = {}
    for ours, theirs in _hf_name_map(c).items():
        t = state[ours]
        hf[theirs] = t.T[:, None, :] if ours.endswith("conv_1d.w") else t
    directory = Path(directory)
    _write_safetensors(directory / WEIGHTS_NAME, hf, {"format": "pt"})
    _write_json(directory / CONFIG_NAME, cfg)


# Official recurrentgemma (PyTorch) --------------------------------------------------------------------
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


def _from_official(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
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


def save_official(model: CausalLM, path: str | Path) -> None:
    """Write the official ``recurrentgemma.torch.Griffin`` state dict of ``model`` (atomically)."""
    state = to_official_state(model)
    atomic_write(Path(path), lambda tmp: torch.save(state, tmp))


def _load_official(path: Path, dtype: torch.dtype | None, **overrides: Any) -> CausalLM:
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors")
    config = official_config_from_state(state, **overrides)
    return _build(config, _from_official(state, config), str(path), dtype)


# Entry point ------------------------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """``griffin``, ``hf`` or ``official`` for a checkpoint path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file():
        if path.suffix in (".pt", ".pth", ".ckpt", ".bin"):
            return "official"
        raise CheckpointError(f"{path}: expected a directory or a .pt/.pth/.ckpt official state dict")
    config = path / CONFIG_NAME
    if config.exists():
        cfg = json.loads(config.read_text())
        if cfg.get("model_type") == "recurrent_gemma":
            return "hf"
        if "family" in cfg and "width" in cfg:
            return "griffin"
        raise CheckpointError(f"{config} is neither a griffin nor an HF RecurrentGemma config")
    candidates = [p for p in path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt")]
    if len(candidates) == 1:
        return "official"
    raise CheckpointError(f"{path} has no {CONFIG_NAME} and not exactly one .pt/.pth/.ckpt file")


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None, **overrides: Any) -> CausalLM:
    """Load a griffin, HF RecurrentGemma or official recurrentgemma checkpoint (format detected).

    ``overrides`` apply to official checkpoints only (``attention_window_size``, ``logits_soft_cap``,
    ``embed_scale``), whose config is not stored with the weights.
    """
    path = Path(path)
    fmt = detect_format(path)
    if overrides and fmt != "official":
        raise TypeError(f"options {sorted(overrides)} only apply to official checkpoints, not {fmt}")
    if fmt == "griffin":
        return _load_griffin(path, dtype)
    if fmt == "hf":
        return _load_hf(path, dtype)
    if path.is_dir():
        path = next(p for p in path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt"))
    return _load_official(path, dtype, **overrides)
