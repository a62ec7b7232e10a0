"""The residual block and the causal language model (Section 2, Figure 2a)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import ModelConfig
from griffin.inference.cache import EMPTY, AttentionCache, Cache, DecodeState, RecurrentCache, init_cache
from griffin.inference.prepack import LinearFn
from griffin.layers import GatedMLP, MultiQueryAttention, RecurrentBlock, RMSNorm
from griffin.layers.attention import DecodeInputs
from griffin.layers.rope import rope_angles
from griffin.ops.cross_entropy import IGNORE_INDEX, chunked_cross_entropy


class ResidualBlock(nn.Module):
    """x + temporal_block(RMSNorm(x)), then + MLP(RMSNorm(.)): pre-norm residual (Section 2.1)."""

    def __init__(self, config: ModelConfig, block_type: str) -> None:
        super().__init__()
        self.block_type = block_type
        final_init_scale = 2.0 / config.depth
        self.temporal_pre_norm = RMSNorm(config.width, config.norm_eps)
        if block_type == "recurrent":
            self.temporal_block: nn.Module = RecurrentBlock(config, final_init_scale)
        else:
            self.temporal_block = MultiQueryAttention(config, block_type == "local_attention", final_init_scale)
        self.channel_pre_norm = RMSNorm(config.width, config.norm_eps)
        self.mlp_block = GatedMLP(config.width, config.mlp_width, config.gelu_approximation, final_init_scale)

    def forward(self, x: Tensor, positions: Tensor, reset: Tensor | None, pad: Tensor | None,
                segments: Tensor | None, cache=None, step: int = 0) -> Tensor:
        h = self.temporal_pre_norm(x)
        if self.block_type == "recurrent":
            h = self.temporal_block(h, reset, pad, cache)
        else:
            h = self.temporal_block(h, positions, segments, cache, step)
        residual = h + x
        return self.mlp_block(self.channel_pre_norm(residual)) + residual

    def decode_step(self, x: Tensor, cache: RecurrentCache | AttentionCache, state: DecodeState,
                    inputs: DecodeInputs | None, linear: LinearFn = F.linear) -> Tensor:
        """:meth:`forward` for one token per row, x (B, D), through the blocks' decode steps."""
        h = self.temporal_pre_norm(x)
        if self.block_type == "recurrent":
            h = self.temporal_block.decode_step(h, cache, linear)
        else:
            h = self.temporal_block.decode_step(h, cache, state, inputs, linear)
        residual = h + x
        return self.mlp_block.decode_step(self.channel_pre_norm(residual), linear) + residual


class CausalLM(nn.Module):
    """Embedding, N residual blocks in the family's pattern, final RMSNorm, tied output layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(ResidualBlock(config, kind) for kind in config.block_types)
        self.final_norm = RMSNorm(config.width, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.width, config.vocab_size, bias=False)
        # sqrt(D) rounded to bfloat16, as in the released RecurrentGemma checkpoints.
        self.embed_multiplier = float(torch.tensor(math.sqrt(config.width), dtype=torch.bfloat16, device="cpu"))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std or math.sqrt(1.0 / self.config.width)
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight, std=std)
            if self.lm_head is not None:
                nn.init.normal_(self.lm_head.weight, std=std)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # Input checks -------------------------------------------------------------------------------
    def check_inputs(self, input_ids: Tensor, positions: Tensor | None) -> None:
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, time), got {tuple(input_ids.shape)}")
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if positions is not None:
            if not isinstance(positions, Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex:
                raise TypeError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)}")
            if positions.shape != input_ids.shape:
                raise ValueError(
                    f"positions must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(positions.shape)}"
                )
            if positions.numel() and int(positions.min()) < -1:
                raise ValueError(f"positions must be >= 0 (or -1 for padding), got {int(positions.min())}")

    # Forward --------------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        return x * self.embed_multiplier if self.config.embed_scale else x

    @property
    def output_weight(self) -> Tensor:
        """The output layer's (vocab, D) matrix: the embedding's if tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: Tensor, linear: LinearFn = F.linear) -> Tensor:
        h = self.final_norm(h)
        logits = linear(h, self.output_weight)
        cap = self.config.logits_soft_cap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, cache: Cache | None = None,
                logits_to_keep: int | None = None, targets: Tensor | None = None, loss_chunk: int = 0) -> Tensor:
        """Logits (B, T, vocab), or (B, logits_to_keep, vocab) of the last positions only (a prefill needs the last).

        With ``targets`` (B, T) (token ids; -100 = no target), the summed cross-entropy of the logits over the
        targets instead (a scalar, float32 or wider): all logits at once if ``loss_chunk`` is 0, else
        ``loss_chunk`` rows at a time (:func:`griffin.ops.cross_entropy.chunked_cross_entropy`: the (B·T, vocab)
        logits are never held whole, for large vocabularies).

        ``positions`` (B, T) is each token's position in its document: a 0 starts a new document, which sees
        nothing of the previous one, and -1 marks a padding token that nothing sees. Default: the sequence
        continues (from the cache, if any) as one document per row. With ``cache`` (see :meth:`init_cache`), the
        tokens continue the cached sequence and the cache is updated in place.
        """
        self.check_inputs(input_ids, positions)
        B, T = input_ids.shape
        if logits_to_keep is not None and (isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int)
                                           or not 1 <= logits_to_keep <= T):
            raise ValueError(f"logits_to_keep={logits_to_keep!r} must be None or an int in [1, {T}] (the tokens)")
        if targets is not None and (targets.shape != input_ids.shape or logits_to_keep is not None):
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)} and come without "
                             f"logits_to_keep, got {tuple(targets.shape)} and logits_to_keep={logits_to_keep}")
        if cache is not None:
            self.check_cache(cache, B)
        if positions is None:
            start = cache.position[:, None] if cache is not None else 0
            positions = torch.arange(T, device=input_ids.device) + start
            positions = positions.expand(B, T)
        positions = positions.to(input_ids.device)
        reset, pad = positions <= 0, positions < 0
        has_pad = cache is not None or bool(pad.any())
        pad = pad if has_pad else None
        first = 0 if cache is None else cache.segment[:, None]
        segments = torch.cumsum(reset, dim=1) + first
        if cache is None and pad is None and not bool(reset[:, 1:].any()):
            segments = None  # one document per row: plain causal masks
        elif not self.config.attention_document_mask:
            segments = torch.zeros_like(segments)
        if segments is not None and pad is not None:
            segments = segments.masked_fill(pad, EMPTY)
        x = self.embed_tokens(input_ids)
        step = 0 if cache is None else cache.step
        for i, block in enumerate(self.blocks):
            x = block(x, positions.clamp(min=0), reset, pad, segments, None if cache is None else cache.blocks[i],
                      step)
        if cache is not None:
            cache.step += T
            cache.segment.add_(reset.sum(1))
            cache.position.copy_(positions[:, -1].clamp(min=-1) + 1)
        if targets is None:
            return self.logits(x if logits_to_keep is None else x[:, T - logits_to_keep :])
        if loss_chunk:
            return chunked_cross_entropy(self.final_norm(x), self.output_weight, targets,
                                         self.config.logits_soft_cap, loss_chunk)
        return F.cross_entropy(self.logits(x).float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def decode_step(self, tokens: Tensor, cache: Cache, state: DecodeState, kv_len: int | None = None,
                    linear: LinearFn = F.linear) -> Tensor:
        """Logits (B, vocab) of one new token per row, ``tokens`` (B,), continuing the documents in ``cache``
        (Section 5): the decode step alone, with no input checks and no host syncs.

        Updates ``cache`` (all but the host counter ``cache.step``, which the caller advances) and ``state``
        (:meth:`DecodeState.from_cache`) in place. With ``kv_len=None`` every shape is static and
        nothing depends on a Python value that changes between steps, so the step can be compiled or captured
        in a CUDA graph; eager callers pass ``kv_len = cache.step + 1`` to attend only over the slots in use.
        ``linear`` does every weight matmul (e.g. :class:`griffin.inference.prepack.PrepackedLinear`).
        :class:`griffin.inference.generate.Decoder` does all of this and checks the inputs once.
        """
        x = self.embed_tokens(tokens)
        inputs = None
        if state.local_bias is not None or state.global_bias is not None:
            cfg = self.config
            cos, sin = rope_angles(cache.position[:, None], cfg.rope_dim, cfg.rope_base, state.inv_freq)
            local_slot = state.step % cfg.attention_window
            inputs = DecodeInputs(cos.to(x.dtype), sin.to(x.dtype), local_slot, state.step, kv_len)
            if state.local_bias is not None:  # the slot written now becomes visible (nothing becomes hidden)
                state.local_bias.index_fill_(1, local_slot, 0.0)
            if state.global_bias is not None:
                state.global_bias.index_fill_(1, state.step, 0.0)
        for block, block_cache in zip(self.blocks, cache.blocks, strict=True):
            x = block.decode_step(x, block_cache, state, inputs, linear)
        cache.position.add_(1)
        state.step.add_(1)
        return self.logits(x, linear)

    def init_cache(self, batch_size: int, max_length: int | None = None) -> Cache:
        """An empty inference cache; ``max_length`` sizes the KV cache of global attention (MQA models)."""
        return init_cache(self.config, batch_size, max_length, self.dtype, self.device)

    def generate(self, input_ids, max_new_tokens: int = 64, **kwargs) -> list[list[int]]:
        """Sample continuations of prompts; see :func:`griffin.inference.generate.generate_stream` for the options
        (temperature, top_k, top_p, seed, stop_tokens, cache, max_length, chunk_size, compile)."""
        from griffin.inference.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def generate_stream(self, input_ids, max_new_tokens: int = 64, **kwargs):
        """Like :meth:`generate`, yielding each step's tokens as they are produced."""
        from griffin.inference.generate import generate_stream

        return generate_stream(self, input_ids, max_new_tokens, **kwargs)

    def check_cache(self, cache: Cache, batch_size: int) -> None:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a griffin.inference.cache.Cache, got {type(cache).__name__}")
        if cache.config.replace(name="") != self.config.replace(name=""):
            raise ValueError("the cache was made for a different model config")
        if cache.batch_size != batch_size:
            raise ValueError(f"the cache holds {cache.batch_size} rows but input_ids has {batch_size}")

    # Checkpoints ----------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        from griffin.interop import save_pretrained

        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> CausalLM:
        from griffin.interop import load_pretrained

        return load_pretrained(path, **kwargs)
