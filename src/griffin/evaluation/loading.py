"""A checkpoint and the tokenizer it was trained with, checked against each other before any evaluation runs."""

from __future__ import annotations

from pathlib import Path

import torch

from griffin.data.tokenizer import Tokenizer, load_tokenizer
from griffin.interop import load_pretrained, resolve_dtype
from griffin.model import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def tokenizer_spec(checkpoint: str | Path, spec: str = "auto") -> str:
    """``auto``: the tokenizer file stored beside the checkpoint (``griffin train`` copies it there), else ``bytes``."""
    if spec != "auto":
        return spec
    directory = Path(checkpoint)
    found = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    return str(found[0]) if found else "bytes"


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from its name (:data:`griffin.interop.DTYPES`) or itself; ``auto``/None: as stored."""
    if isinstance(dtype, str) and dtype.removeprefix("torch.") == "auto":
        return None
    return resolve_dtype(dtype)


def load_for_eval(checkpoint: str | Path, tokenizer: str = "auto", dtype: str | torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> tuple[CausalLM, Tokenizer]:
    """The model (eval mode, on ``device``) and its tokenizer; a missing checkpoint or a tokenizer with more tokens
    than the model's vocabulary is refused here, before anything is computed or written."""
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    tok = load_tokenizer(tokenizer_spec(path, tokenizer))
    model = load_pretrained(path, dtype=parse_dtype(dtype)).to(device).eval()
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's vocabulary only "
                         f"{model.config.vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return model, tok
