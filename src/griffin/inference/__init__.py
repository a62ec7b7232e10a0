"""Inference (Section 5): prefill, decode steps and sampling over a model's cache; prepacked CPU matmuls."""

from griffin.inference.generate import Decoder, decode_stream, generate, generate_stream, prefill, sample

__all__ = ["Decoder", "decode_stream", "generate", "generate_stream", "prefill", "sample"]
