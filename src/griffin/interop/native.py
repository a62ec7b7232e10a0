"""griffin's own checkpoint format: a directory with ``config.json`` (a :class:`griffin.config.ModelConfig`) and
``model.safetensors``, each written atomically; and loading a state dict into a model with every problem named."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from griffin.config import ModelConfig
from griffin.io import check_new_output, read_json, read_safetensors, write_json, write_safetensors
from griffin.model import CausalLM
from griffin.quantize import (
    float32_scales_,
    int8_gates_of_state,
    int8_structure_,
    quantization_of,
    quantization_of_state,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model it describes."""


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating torch dtype given as itself or by name (``"bfloat16"``, ``"torch.float16"``); None stays None."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")


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


def build_model(config: ModelConfig, state: dict[str, Tensor], source: str, dtype: torch.dtype | None) -> CausalLM:
    """The model of ``config`` holding ``state`` (int8 layers where the state has int8 weights and their scales,
    :mod:`griffin.quantize`), in ``dtype`` (default: the state's floating dtype)."""
    try:
        quantized, gates = quantization_of_state(state), int8_gates_of_state(state)
    except ValueError as err:
        raise CheckpointError(f"cannot load {source}: {err}") from None
    with torch.device("meta"):
        model = CausalLM(config)
    if quantized is not None:
        try:
            int8_structure_(model, quantized["group_size"], gates)
        except ValueError as err:
            raise CheckpointError(f"cannot load {source}: {err}") from None
    model = model.to_empty(device="cpu")
    if dtype is None:
        floats = [t.dtype for name, t in state.items() if t.is_floating_point() and not name.endswith("_scale")]
        dtype = floats[0] if floats else torch.float32
    model = model.to(dtype)
    float32_scales_(model)
    load_state_checked(model, state, source)
    return model.eval()


def save_pretrained(model: CausalLM, directory: str | Path, *, overwrite: bool = True) -> None:
    """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``; with
    ``overwrite=False`` (``griffin convert`` without ``--overwrite``) a non-empty ``directory`` is refused
    (:class:`~griffin.io.OutputExistsError`)."""
    directory = Path(directory)
    check_new_output(directory, overwrite)
    state = dict(model.state_dict())
    metadata = {"format": "pt", "library": "griffin"}
    quantized = quantization_of(model)
    if quantized is not None:  # informative: loading reads the quantisation from the tensors
        metadata.update(quantization=quantized["method"], group_size=str(quantized["group_size"]))
    write_safetensors(directory / WEIGHTS_NAME, state, metadata)
    write_json(directory / CONFIG_NAME, model.config.to_dict())


def load_griffin(directory: Path, dtype: torch.dtype | None) -> CausalLM:
    try:
        config = ModelConfig.from_dict(read_json(directory / CONFIG_NAME))
    except ValueError as err:
        raise CheckpointError(f"{directory / CONFIG_NAME}: {err}") from None
    weights = directory / WEIGHTS_NAME
    if not weights.exists():
        raise CheckpointError(f"{directory} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
    return build_model(config, read_safetensors(weights)[0], str(weights), dtype)
