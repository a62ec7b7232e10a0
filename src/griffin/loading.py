"""A checkpoint loaded for use: the one place that reads a checkpoint (any format), finds its tokenizer, casts,
quantises and places the model. ``griffin generate``, ``griffin serve`` and evaluation load through
:func:`load_for_use`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from griffin.data.tokenizer import AUTO, Tokenizer, load_tokenizer, tokenizer_file
from griffin.interop import is_adapter, load_pretrained, resolve_dtype
from griffin.interop.adapters import adapter_base
from griffin.model import CausalLM
from griffin.ops.matvec import check_group_size
from griffin.quantize import METHODS, quantization_of, quantize_int8


@dataclass
class Loaded:
    """What :func:`load_for_use` returns: the ``model`` (eval mode, parameters without gradients, on the device),
    its ``tokenizer`` (None when none was asked for), the checkpoint's resolved ``path`` and a display ``name``: the
    name the checkpoint was given by (``best`` for ``runs/x/checkpoints/best``, not the step the link points to), or
    a checkpoint file's stem."""

    model: CausalLM
    tokenizer: Tokenizer | None
    path: Path
    name: str


def load_for_use(path: str | Path, *, tokenizer: str | Path | Tokenizer | None = AUTO,
                 dtype: str | torch.dtype | None = None, quantize: str | None = None, group_size: int = 0,
                 device: str | torch.device = "cpu", adapter: str | Path | None = None) -> Loaded:
    """Load a checkpoint to run it: any format :func:`griffin.load_pretrained` reads (griffin directory, HF
    RecurrentGemma directory, official ``.pt``), with its tokenizer, in ``dtype``, quantised, on ``device``.

    - ``tokenizer``: ``"auto"`` (the default) for the tokenizer stored beside the checkpoint (``tokenizer.json`` or
      ``tokenizer.model`` in its directory, or in the directory holding a checkpoint file; ``griffin train`` copies
      it there), else the byte-level one; ``"bytes"``, a tokenizer file or a directory holding one
      (:func:`griffin.data.tokenizer.load_tokenizer`); a tokenizer object, used as it is; or None for none. A
      tokenizer with more tokens than the model's vocabulary is refused.
    - ``dtype``: a floating dtype or its name (``"bfloat16"``); None or ``"auto"``: as stored. An int8 model keeps
      its int8 weights; what stays in float takes ``dtype``.
    - ``quantize``: None, or ``"int8"`` for weight-only int8 weights quantised on loading
      (:func:`griffin.quantize.quantize_int8`, ``group_size`` inputs per scale, 0: one scale per output channel). A
      checkpoint already in int8 (``griffin quantize``) is used as it is. Int8 weights decode with the CPU kernel
      only, so int8 on another device is refused, before loading where the options alone say so.
    - ``device``: where the model goes.
    - ``adapter``: a LoRA adapter directory (PEFT's format, ``griffin finetune``), merged into the weights before
      they are cast and quantised, so that decoding runs at a plain model's speed. A LoRA adapter directory as
      ``path`` loads the base model it names with it; the tokenizer is then the one beside the adapter if any, else
      the base's.

    Every option is checked before the checkpoint is read; each bad value is one ``ValueError`` (a missing
    checkpoint or tokenizer file: ``FileNotFoundError``) that names it.
    """
    path = Path(path)
    if dtype is None or (isinstance(dtype, str) and dtype.removeprefix("torch.") == "auto"):
        dtype = None
    else:
        dtype = resolve_dtype(dtype)
    if quantize is not None and quantize not in METHODS:
        raise ValueError(f"quantize={quantize!r} is not supported: use one of {list(METHODS)} or None")
    if quantize is None and group_size:
        raise ValueError(f"group_size={group_size!r} applies to quantize='int8' only")
    if quantize is not None:
        check_group_size(group_size)
    device = _device(device)
    if quantize is not None and device.type != "cpu":
        raise ValueError(f"{quantize} weights decode with the CPU kernel only, not on device {str(device)!r}: "
                         "load them on the CPU, or the float model on this device")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if adapter is not None and not Path(adapter).exists():
        raise FileNotFoundError(f"no adapter at {adapter}")
    tok = None
    if tokenizer is not None:
        beside = path
        if is_adapter(path) and tokenizer == AUTO and tokenizer_file(path) is None:
            beside = Path(adapter_base(path) or path)  # a LoRA adapter without a tokenizer: its base's
        tok = load_tokenizer(tokenizer, beside=beside) if isinstance(tokenizer, (str, Path)) else tokenizer
    model = load_pretrained(path, dtype=dtype, adapter=adapter)
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's vocabulary only "
                         f"{model.config.vocab_size}: pass the tokenizer the model was trained with")
    quantized = quantization_of(model)
    if quantized is not None and device.type != "cpu":
        raise ValueError(f"{path} holds {quantized['method']} weights, which decode with the CPU kernel only, not "
                         f"on device {str(device)!r}: load it on the CPU, or the float checkpoint on this device")
    if quantize is not None and quantized is None:
        model = quantize_int8(model, group_size, inplace=True)
    model = model.to(device).eval().requires_grad_(False)
    resolved = path.resolve()
    named = path.absolute()  # keeps the link's name: `.resolve()` would turn `best` into `step_00000300`
    return Loaded(model, tok, resolved, named.name if resolved.is_dir() else named.stem)


def _device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, refused by name when it is none or is not available here."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device: use 'cpu', 'cuda', 'cuda:N', ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: CUDA is not available here")
    return device


__all__ = ["Loaded", "load_for_use"]
