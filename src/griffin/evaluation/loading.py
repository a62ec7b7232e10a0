"""A checkpoint and the tokenizer it was trained with, checked against each other before any evaluation runs."""

from __future__ import annotations

from pathlib import Path

import torch

from griffin.data.tokenizer import Tokenizer
from griffin.loading import load_for_use
from griffin.model import CausalLM


def load_for_eval(checkpoint: str | Path, tokenizer: str | Tokenizer = "auto", dtype: str | torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> tuple[CausalLM, Tokenizer]:
    """The model (eval mode, on ``device``) and its tokenizer (``auto``: the one stored beside the checkpoint, else
    bytes), loaded by :func:`griffin.load_for_use`: a missing checkpoint or a tokenizer with more tokens than the
    model's vocabulary is refused here, before anything is computed or written."""
    loaded = load_for_use(checkpoint, tokenizer=tokenizer, dtype=dtype, device=device)
    assert loaded.tokenizer is not None  # a tokenizer was asked for
    return loaded.model, loaded.tokenizer
