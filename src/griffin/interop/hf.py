"""HuggingFace ``transformers`` RecurrentGemma directories: ``config.json`` with ``model_type: recurrent_gemma`` and
``*.safetensors`` weights, imported with HF's semantics (the Conv1D is not reset at document starts; a query sees
``attention_window_size`` keys, itself included) and exported from griffin models that HF can express."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.config import PRESETS, ModelConfig
from griffin.interop.native import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, build_model
from griffin.io import check_new_output, read_json, read_safetensors, write_json, write_safetensors
from griffin.model import CausalLM
from griffin.quantize import quantization_of


def hf_config_to_griffin(cfg: dict[str, Any], source: str | Path = "HF config") -> ModelConfig:
    """ModelConfig reproducing ``transformers``' RecurrentGemmaForCausalLM for an HF config.json; a missing or
    malformed field is a CheckpointError naming ``source`` and the field."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source} is not a JSON object of config fields")
    try:
        return _hf_config(cfg)
    except KeyError as err:
        raise CheckpointError(f"{source} lacks the field {err.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise CheckpointError(f"{source}: {err}") from None


def _hf_config(cfg: dict[str, Any]) -> ModelConfig:
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


def hf_name_map(config: ModelConfig) -> dict[str, str]:
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


def load_hf(directory: Path, dtype: torch.dtype | None) -> CausalLM:
    config = hf_config_to_griffin(read_json(directory / CONFIG_NAME), directory / CONFIG_NAME)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds an HF config but no *.safetensors weights")
    hf: dict[str, Tensor] = {}
    for f in files:
        hf.update(read_safetensors(f)[0])
    names = hf_name_map(config)
    expected = set(names.values())
    problems = [f"missing: {n}" for n in sorted(expected - set(hf))]
    problems += [f"unexpected: {n}" for n in sorted(set(hf) - expected - {"lm_head.weight"})]
    if problems:
        raise CheckpointError(f"cannot load {directory}:\n  " + "\n  ".join(problems))
    state = {ours: _conv_from_hf(hf[theirs]) if ours.endswith("conv_1d.w") else hf[theirs]
             for ours, theirs in names.items()}
    return build_model(config, state, str(directory), dtype)


def hf_problems(config: ModelConfig) -> list[str]:
    """What HF ``transformers``' RecurrentGemmaForCausalLM cannot express of ``config`` (empty if it can): it has local
    attention only, ties the RG-LRU's gate blocks to the attention heads and head_dim to width / heads (a model
    without attention, Hawk, is written with as many heads as gate blocks: it has no other use for them), always
    scales the embedding by sqrt(width) (rounded to bfloat16) and soft-caps the logits, and fixes the RG-LRU constant
    c at 8."""
    c = config
    if _has_attention(c):
        heads = [
            (c.head_dim * c.num_heads == c.width,
             f"head_dim={c.head_dim} * num_heads={c.num_heads} != width={c.width}"),
            (c.gate_blocks == c.num_heads or "recurrent" not in c.block_types,
             f"gate_blocks={c.gate_blocks} != num_heads={c.num_heads}"),
            (int(c.head_dim * c.rope_fraction) == c.rope_dim,  # HF truncates where griffin rounds
             f"rope_fraction={c.rope_fraction} of head_dim={c.head_dim} (HF would rotate "
             f"{int(c.head_dim * c.rope_fraction)} dims, griffin {c.rope_dim})"),
        ]
    else:
        heads = [(c.width % c.gate_blocks == 0, f"width={c.width} is not divisible by gate_blocks={c.gate_blocks} "
                  "(HF's head count, which sets its gate blocks)")]
    checks = [
        ("attention" not in c.block_types, "global attention blocks (HF RecurrentGemma only has local attention)"),
        *heads,
        (c.embed_scale, "embed_scale=False (HF always scales embeddings by sqrt(width))"),
        (bool(c.logits_soft_cap), "no logits_soft_cap (HF always soft-caps logits)"),
        (c.rg_lru_c == 8.0, f"rg_lru_c={c.rg_lru_c} (HF fixes it at 8)"),
        (c.tie_embeddings, "untied embeddings"),
        (not c.complex_lru, "the complex CG-LRU"),
        (c.attention_document_mask, "attention_document_mask=False"),
    ]
    return [problem for ok, problem in checks if not ok]


def hf_overrides(config: ModelConfig) -> dict[str, Any]:
    """The ModelConfig changes that make ``config`` expressible in HF (RecurrentGemma's settings, :func:`hf_problems`),
    as ``--model KEY=VALUE`` settings of ``griffin train``; empty if it is already, or if no setting can (global
    attention, the CG-LRU, untied embeddings have no HF counterpart)."""
    c = config
    if "attention" in c.block_types or c.complex_lru or not c.tie_embeddings or not c.attention_document_mask:
        return {}
    changes: dict[str, Any] = {}
    if _has_attention(c):
        if c.width % c.num_heads or ("recurrent" in c.block_types and c.lru_width % c.num_heads):
            return {}
        if c.head_dim * c.num_heads != c.width:
            changes["head_dim"] = c.width // c.num_heads
        if c.gate_blocks != c.num_heads and "recurrent" in c.block_types:
            changes["gate_blocks"] = c.num_heads
    elif c.width % c.gate_blocks:
        return {}
    if not c.embed_scale:
        changes["embed_scale"] = True
    if not c.logits_soft_cap:
        changes["logits_soft_cap"] = 30.0
    if c.rg_lru_c != 8.0:
        changes["rg_lru_c"] = 8.0
    return changes


def _has_attention(config: ModelConfig) -> bool:
    return any(kind != "recurrent" for kind in config.block_types)


def export_hf(model: CausalLM, directory: str | Path, *, overwrite: bool = True) -> None:
    """Write ``model`` as a HuggingFace RecurrentGemma directory (config.json + model.safetensors); a model HF cannot
    express (:func:`hf_problems`) is refused, naming what to train instead, and with ``overwrite=False`` so is a
    non-empty ``directory`` (:class:`~griffin.io.OutputExistsError`)."""
    check_new_output(directory, overwrite)
    c = model.config
    problems = hf_problems(c)
    if quantization_of(model) is not None:
        problems.insert(0, "int8 weights (export the float checkpoint it was quantised from)")
    if problems:
        fix = hf_overrides(c)
        hint = ""
        if fix:
            flags = " ".join(f"--model {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fix.items())
            preset = f"--preset {c.name} " if c.name in PRESETS else ""
            hint = (f". To get a model that converts, train it with RecurrentGemma's settings: `griffin train "
                    f"{preset}{flags}` (with the run's other options); trained weights cannot be converted after the "
                    "fact, as these settings change the function the model computes")
        raise CheckpointError("this model cannot be expressed as HF RecurrentGemma: " + "; ".join(problems) + hint)
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
        # Without attention, the heads only set the RG-LRU's gate blocks in HF.
        "num_attention_heads": c.num_heads if _has_attention(c) else c.gate_blocks,
        "num_key_value_heads": c.num_kv_heads if _has_attention(c) else 1,
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
    for ours, theirs in hf_name_map(c).items():
        t = state[ours]
        hf[theirs] = t.T[:, None, :] if ours.endswith("conv_1d.w") else t
    directory = Path(directory)
    write_safetensors(directory / WEIGHTS_NAME, hf, {"format": "pt"})
    write_json(directory / CONFIG_NAME, cfg)
