"""The residual block and the causal language model (Section 2, Figure 2a)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.cache import Cache
from griffin.config import ModelConfig
from griffin.layers import EMPTY, Context, GatedMLP, MultiQueryAttention, RecurrentBlock, RMSNorm
from griffin.layers.rope import rope_angles
from griffin.ops.cross_entropy import IGNORE_INDEX, chunked_cross_entropy
from griffin.ops.embedding import embed


class ResidualBlock(nn.Module):
    """x + temporal_block(RMSNorm(x)), then + MLP(RMSNorm(.)): pre-norm residual (Section 2.1)."""

    def __init__(self, config: ModelConfig, block_type: str) -> None:
        super().__init__()
        self.block_type = block_type
        final_init_scale = 2.0 / config.depth
        self.temporal_pre_norm = RMSNorm(config.width, config.norm_eps)
        if block_type == "recurrent":
            self.temporal_block: RecurrentBlock | MultiQueryAttention = RecurrentBlock(config, final_init_scale)
        else:
            self.temporal_block = MultiQueryAttention(config, block_type == "local_attention", final_init_scale)
        self.channel_pre_norm = RMSNorm(config.width, config.norm_eps)
        self.mlp_block = GatedMLP(config.width, config.mlp_width, config.gelu_approximation, final_init_scale)

    def forward(self, x: Tensor, ctx: Context, cache=None) -> Tensor:
        residual = self.temporal_block(self.temporal_pre_norm(x), ctx, cache) + x
        return self.mlp_block(self.channel_pre_norm(residual)) + residual


class TiedOutput(nn.Module):
    """The output layer when it shares the embedding's matrix (the paper ties them): no parameter of its own."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # a list, so that the embedding is not registered (and saved) twice

    @property
    def weight(self) -> Tensor:
        return self.embed[0].weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class LanguageModelLoss(nn.Module):
    """The training loss (Section 3): the summed cross-entropy over ``targets`` (IGNORE_INDEX: not counted) of the
    soft-capped logits h W^T, all at once (``chunk`` 0) or ``chunk`` rows at a time
    (:func:`griffin.ops.cross_entropy.chunked_cross_entropy`). A module of its own, so that the output layer's loss
    can be swapped from outside (the vocabulary-parallel loss of :mod:`griffin.parallel`, Section 4.1).

    ``float32_logits``: under autocast, compute the logits from float32 h and W instead of in autocast's dtype (the
    trainer's ``logits_precision``); bf16 keeps 8 bits of a logit, and its rounding shows in the loss."""

    def __init__(self, logits_soft_cap: float | None, float32_logits: bool = False) -> None:
        super().__init__()
        self.cap = logits_soft_cap
        self.float32_logits = float32_logits

    def forward(self, h: Tensor, weight: Tensor, targets: Tensor, chunk: int = 0) -> Tensor:
        if self.float32_logits and torch.is_autocast_enabled(h.device.type):
            with torch.autocast(h.device.type, enabled=False):
                return self.forward(h.float(), weight.float(), targets, chunk)
        if chunk:
            return chunked_cross_entropy(h, weight, targets, self.cap, chunk)
        logits = F.linear(h, weight)
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class ResidualBlocks(nn.ModuleList):
    """The residual blocks in order, each reading the one before's output (Figure 2a). A module of its own, so that a
    decode copy can run them all at once by a module swap (:mod:`griffin.inference.cpu.fused`)."""

    def forward(self, x: Tensor, ctx: Context, cache: Cache | None = None) -> Tensor:
        for i, block in enumerate(self):
            x = block(x, ctx, None if cache is None else cache.blocks[i])
        return x


class CausalLM(nn.Module):
    """Embedding, N residual blocks in the family's pattern, final RMSNorm, output layer (tied to the embedding by
    default), optional logit soft-cap."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = ResidualBlocks(ResidualBlock(config, kind) for kind in config.block_types)
        self.final_norm = RMSNorm(config.width, config.norm_eps)
        self.lm_head: nn.Module = (TiedOutput(self.embed) if config.tie_embeddings
                                   else nn.Linear(config.width, config.vocab_size, bias=False))
        self.loss = LanguageModelLoss(config.logits_soft_cap)
        # sqrt(D) rounded to bfloat16, as in the released RecurrentGemma checkpoints.
        self.embed_multiplier = float(torch.tensor(math.sqrt(config.width), dtype=torch.bfloat16, device="cpu"))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std or math.sqrt(1.0 / self.config.width)
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight, std=std)
            if not self.config.tie_embeddings:
                nn.init.normal_(self.lm_head.weight, std=std)

    @property
    def device(self) -> torch.device:
        return self.final_norm.scale.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and caches' dtype: the floating parameters' (int8 weights aside, griffin.quantize)."""
        return self.final_norm.scale.dtype

    @property
    def output_weight(self) -> Tensor:
        """The output layer's (vocab, D) matrix: the embedding's if tied; dequantised (a new tensor) if int8."""
        head = self.lm_head
        return head.dequantize(self.dtype) if hasattr(head, "dequantize") else head.weight

    def num_parameters(self) -> int:
        """Parameters, int8 weights included (griffin.quantize: stored as buffers)."""
        int8 = sum(b.numel() for b in self.buffers() if b.dtype == torch.int8)
        return sum(p.numel() for p in self.parameters()) + int8

    def init_cache(self, batch_size: int, max_length: int | None = None) -> Cache:
        """An empty inference cache, each block's own; ``max_length`` sizes global attention's KV cache (MQA)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
        blocks = [b.temporal_block.init_cache(batch_size, max_length, self.dtype, self.device) for b in self.blocks]
        zeros = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        return Cache(self.config, blocks, zeros, zeros.clone())

    # Input checks at the boundary -------------------------------------------------------------------------------
    def check_inputs(self, input_ids: Tensor, positions: Tensor | None) -> None:
        """Types and shapes always; values (token ids in the vocabulary, positions >= -1) where checking them costs
        no device synchronisation: on CPU tensors, outside compilation."""
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2 or not input_ids.numel():
            raise ValueError(f"input_ids must have shape (batch, time) with at least one token, got "
                             f"{tuple(input_ids.shape)}")
        if positions is not None:
            if not isinstance(positions, Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex:
                raise TypeError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)}")
            if positions.shape != input_ids.shape:
                raise ValueError(
                    f"positions must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(positions.shape)}"
                )
        if torch.compiler.is_compiling() or input_ids.device.type != "cpu":
            return
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if positions is not None and positions.device.type == "cpu" and int(positions.min()) < -1:
            raise ValueError(f"positions must be >= 0 (or -1 for padding), got {int(positions.min())}")

    def check_cache(self, cache: Cache, batch_size: int, tokens: int = 0) -> None:
        """The cache belongs to this model, holds ``batch_size`` rows and has room for ``tokens`` more."""
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a griffin.Cache, got {type(cache).__name__}")
        if cache.config is not self.config and cache.config.replace(name="") != self.config.replace(name=""):
            raise ValueError("the cache was made for a different model config")
        if cache.batch_size != batch_size:
            raise ValueError(f"the cache holds {cache.batch_size} rows but input_ids has {batch_size}")
        slots = cache.max_length
        if slots is not None and cache.length + tokens > slots:
            raise ValueError(f"the global-attention KV cache holds {slots} tokens; cannot process tokens "
                             f"{cache.length}..{cache.length + tokens - 1}: size it with a larger max_length")

    # Forward --------------------------------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        x = embed(self.embed, input_ids).to(self.dtype)  # a no-op, but for int8 embeddings' float32 rows
        return x * self.embed_multiplier if self.config.embed_scale else x

    def logits(self, h: Tensor) -> Tensor:
        """The soft-capped logits of final hidden states h (..., D)."""
        logits = self.lm_head(self.final_norm(h))
        cap = self.config.logits_soft_cap
        return torch.tanh(logits / cap) * cap if cap else logits

    def context(self, input_ids: Tensor, positions: Tensor | None, cache: Cache | None) -> Context:
        """The tokens' positions, document starts, padding, document ids and RoPE angles (see
        :class:`griffin.layers.Context`); tensor operations only, no host synchronisation."""
        B, T = input_ids.shape
        steps = torch.arange(T, device=input_ids.device)
        cfg = self.config
        reset = pad = segments = None
        packed = positions is not None
        if not packed:  # each row one document, continued from the cache if any
            positions = steps.expand(B, T) if cache is None else cache.position[:, None] + steps
            if cache is None or not cache.started:  # a first token starts its document (Section 2.4)
                reset = positions == 0
        else:
            positions = positions.to(input_ids.device)
            reset, pad = positions <= 0, positions < 0
            positions = positions.clamp(min=0)
        if cache is not None or packed:  # document ids: for attention masks, and for the cache's slots
            first = cache.segment[:, None].expand(B, T) if cache is not None else torch.zeros_like(positions)
            segments = first if reset is None else first + torch.cumsum(reset, dim=1)
            if not cfg.attention_document_mask:
                segments = torch.zeros_like(segments)
            if pad is not None:
                segments = segments.masked_fill(pad, EMPTY)
        rope = None
        if any(kind != "recurrent" for kind in cfg.block_types):
            cos, sin = rope_angles(positions, cfg.rope_dim, cfg.rope_base)
            rope = (cos.to(self.dtype), sin.to(self.dtype))
        cache_len = None if cache is None or torch.compiler.is_compiling() else cache.length + T
        return Context(positions, reset, pad, segments, rope, cache_len)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, cache: Cache | None = None,
                logits_to_keep: int | None = None, targets: Tensor | None = None, loss_chunk: int = 0) -> Tensor:
        """Logits (B, T, vocab), or (B, logits_to_keep, vocab) of the last positions only (a prefill needs the last).

        With ``targets`` (B, T) (token ids; -100 = no target), the summed cross-entropy of the logits over the
        targets instead (a scalar, float32 or wider): all logits at once if ``loss_chunk`` is 0, else
        ``loss_chunk`` rows at a time (:func:`griffin.ops.cross_entropy.chunked_cross_entropy`: the (B·T, vocab)
        logits are never held whole, for large vocabularies).

        ``positions`` (B, T) is each token's position in its document: a 0 starts a new document, which sees
        nothing of the previous one, and -1 marks a padding token that nothing sees. Default: each row is one document
        (continued from the cache, if any). With ``cache`` (:meth:`init_cache`), the tokens continue each row's cached
        documents and the cache is updated in place; one token per row is a decode step (Section 5).
        """
        self.check_inputs(input_ids, positions)
        B, T = input_ids.shape
        if logits_to_keep is not None and (isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int)
                                           or not 1 <= logits_to_keep <= T):
            raise ValueError(f"logits_to_keep={logits_to_keep!r} must be None or an int in [1, {T}] (the tokens)")
        if targets is not None and (targets.shape != input_ids.shape or logits_to_keep is not None):
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)} and come without "
                             f"logits_to_keep, got {tuple(targets.shape)} and logits_to_keep={logits_to_keep}")
        if cache is not None and not torch.compiler.is_compiling():
            self.check_cache(cache, B, T)
        ctx = self.context(input_ids, positions, cache)
        x = self.embed_tokens(input_ids)
        x = self.blocks(x, ctx, cache)
        if cache is not None:
            if ctx.reset is not None:
                cache.segment.add_(ctx.reset.sum(1))
            if positions is None:
                cache.position.add_(T)
            else:
                cache.position.copy_(positions[:, -1].to(cache.position.device).clamp(min=-1) + 1)
            if not torch.compiler.is_compiling():  # a compiled step's caller keeps the host-side counters
                cache.length += T
                cache.started = positions is None  # every row advanced by T >= 1 from a position >= 0
        if targets is None:
            return self.logits(x if logits_to_keep is None else x[:, T - logits_to_keep :])
        return self.loss(self.final_norm(x), self.output_weight, targets, loss_chunk)


@functools.lru_cache(maxsize=256)
def count_parameters(config: ModelConfig) -> int:
    """Number of parameters of the model built from ``config`` (built on the meta device; remembered per config)."""
    with torch.device("meta"):
        model = CausalLM(config)
    return model.num_parameters()
