"""A decode step with its element-wise work fused on CPU (Section 5), applied from outside the model as a module swap.

A decode step of a 1-3B model reads its weights once, through the matvec kernels or oneDNN; what the model computes
around those matmuls, one token per row, costs more in eager operators (some 150 per layer) than in arithmetic.
:func:`fused_step_swapped` replaces each residual block of a decode copy of the model
(:func:`griffin.inference.generate.decode_model`) by a :class:`FusedResidualBlock`, and their list by a
:class:`FusedResidualBlocks`. A one-token step with no document start or padding then takes one of two routes:

- where every block's four projections are matvec swaps (any model at one row, int8 models at up to 8), the whole
  stack of blocks is one call from Python (:func:`griffin.inference.cpu.block_step.stack_step`): per block, one
  parallel region with the kernels and the matmuls;
- otherwise (oneDNN's prepacked or PyTorch's int8 matmuls, at several rows) each block runs the kernels of
  :mod:`griffin.inference.cpu.block_step` one by one around its own (swapped) projections: the two RMSNorms and the
  residual add, the MLP's GeLU product, the recurrent block between its projections in one parallel region, and for
  attention RoPE, the cache write and the attention.

Anything else (a prompt, a document start or padding, a compiled step, gradients) goes through the block as it is, so
the copy computes what the model computes, up to float32 rounding inside the kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from griffin.inference.cpu.block_step import (
    STEP_DTYPES,
    BlockStep,
    RecurrentWeights,
    Stack,
    attention_step,
    gelu_product_step,
    recurrent_step,
    rms_norm_step,
    stack_blocks,
    stack_step,
)
from griffin.inference.cpu.linear import MatvecLinear
from griffin.inference.cpu.matvec import GATE_DTYPES
from griffin.layers import MultiQueryAttention, RecurrentBlock
from griffin.layers.attention import KVCache
from griffin.layers.context import Context
from griffin.layers.recurrent_block import RecurrentState
from griffin.layers.rg_lru import RGLRU
from griffin.model import ResidualBlock, ResidualBlocks


def _gate(gate: nn.Module) -> tuple[Tensor, ...] | None:
    """A block-diagonal gate's (w (H, Din, Dout), b (H, Dout)), or (w, b, scale (H, Dout)) for int8 w, if the kernel
    reads them (float32 or bfloat16, or int8 with float32 scales; CPU, contiguous), whether the layer or its matvec
    swap (:class:`griffin.inference.cpu.linear.MatvecBlockDiagonal`)."""
    w, b = getattr(gate, "w", None), getattr(gate, "b", getattr(gate, "bias", None))
    scale = getattr(gate, "w_scale", None)
    if not isinstance(w, Tensor) or not isinstance(b, Tensor) or w.dim() != 3 or w.shape[1] != w.shape[2]:
        return None
    if (b.dtype not in STEP_DTYPES or w.dtype not in GATE_DTYPES
            or (w.dtype == torch.int8) != isinstance(scale, Tensor)
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in (w, b))):
        return None
    return (w, b) if scale is None else (w, b, scale.float())


def _side_by_side(group: nn.Module, x: Tensor) -> Tensor:
    """The outputs of a group of projections (:class:`griffin.layers.LinearGroup`, or its matvec swap) for rows x
    (B, D), side by side: (B, sum of their widths), from the matvec kernel in float32 (the kernels round them as the
    model would), else in the layers' dtype."""
    if isinstance(group, MatvecLinear):
        return group.side_by_side(x, torch.float32)
    return torch.cat(group(x), -1)


class FusedResidualBlock(nn.Module):
    """A :class:`griffin.model.ResidualBlock` (its modules shared, under the same names) whose decode steps run
    through :mod:`griffin.inference.cpu.block_step` (see the module docstring)."""

    def __init__(self, block: ResidualBlock) -> None:
        super().__init__()
        self.block_type = block.block_type
        self.temporal_pre_norm, self.temporal_block = block.temporal_pre_norm, block.temporal_block
        self.channel_pre_norm, self.mlp_block = block.channel_pre_norm, block.mlp_block
        self.reference = [block]  # a list, so that its modules are not registered twice
        self.weights: RecurrentWeights | None = None
        temporal = block.temporal_block
        if isinstance(temporal, RecurrentBlock) and isinstance(temporal.rg_lru, RGLRU):
            gates = _gate(temporal.rg_lru.input_gate), _gate(temporal.rg_lru.a_gate)
            conv = temporal.conv_1d
            if None not in gates and conv.w.dtype in STEP_DTYPES and conv.w.device.type == "cpu":
                lru = temporal.rg_lru
                self.weights = RecurrentWeights.prepare(conv.w, conv.b, *gates, lru.a_param, lru.c)
        scales = (block.temporal_pre_norm.scale, block.channel_pre_norm.scale)
        self.dtype = scales[0].dtype
        self.fusable = self.dtype in STEP_DTYPES and all(t.dtype == self.dtype and t.device.type == "cpu"
                                                         for t in scales)
        self.one_call = self._block_step() if self.fusable else None

    def _block_step(self) -> BlockStep | None:
        """The block's weights for the stack's one call (:class:`FusedResidualBlocks`), if its four projections are
        matvec swaps and its temporal block has a kernel (a recurrent block with its weights prepared, or multi-query
        attention)."""
        temporal, mlp = self.temporal_block, self.mlp_block
        if self.weights is not None:
            mixer = (temporal.in_proj, temporal.linear_out)
        elif isinstance(temporal, MultiQueryAttention):
            mixer = (temporal.qkv, temporal.proj_final)
        else:
            return None
        layers = (*mixer, mlp.gate_up, mlp.down_proj)
        if not all(isinstance(m, MatvecLinear) for m in layers) or not all(
                t.is_contiguous() for t in (self.temporal_pre_norm.scale, self.channel_pre_norm.scale)):
            return None
        return BlockStep.prepare((self.temporal_pre_norm.scale, self.channel_pre_norm.scale),
                                 (self.temporal_pre_norm.eps, self.channel_pre_norm.eps),
                                 *(m.prepared for m in layers), mlp.gelu_approximation)

    def forward(self, x: Tensor, ctx: Context, cache=None) -> Tensor:
        if not (self.fusable and cache is not None and x.shape[1] == 1 and ctx.reset is None and ctx.pad is None
                and x.dtype == self.dtype and x.device.type == "cpu" and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            return self.reference[0](x, ctx, cache)
        B, _, D = x.shape
        rows = x.reshape(B, D)
        _, normed = rms_norm_step(rows, self.temporal_pre_norm.scale, self.temporal_pre_norm.eps)
        if self.weights is not None:
            mixed = self._recurrent(normed, cache)
        elif (isinstance(self.temporal_block, MultiQueryAttention) and isinstance(cache, KVCache)
              and cache.k.dtype == x.dtype and ctx.segments is not None):
            mixed = self._attention(normed, ctx, cache)
        else:
            mixed = self.temporal_block(normed[:, None], ctx, cache)[:, 0]
        residual, normed = rms_norm_step(rows, self.channel_pre_norm.scale, self.channel_pre_norm.eps, delta=mixed)
        mlp = self.mlp_block
        hidden = gelu_product_step(_side_by_side(mlp.gate_up, normed), mlp.gelu_approximation, x.dtype)
        return (residual + mlp.down_proj(hidden)).view(B, 1, D)

    def _slots(self, ctx: Context, cache: KVCache) -> int:
        """How many of the cache's slots a step reads: a local ring all of them, a global cache those written."""
        S = cache.k.shape[1]
        return S if self.temporal_block.local or ctx.cache_len is None else min(ctx.cache_len, S)

    def _recurrent(self, x: Tensor, cache: RecurrentState) -> Tensor:
        """The recurrent block (Figure 2c) for rows x (B, D), its state updated in place."""
        block = self.temporal_block
        hidden = recurrent_step(_side_by_side(block.in_proj, x), cache.conv, cache.h, self.weights,
                                block.config.gelu_approximation, x.dtype)
        return block.linear_out(hidden)

    def _attention(self, x: Tensor, ctx: Context, cache: KVCache) -> Tensor:
        """Multi-query attention (Section 2.3) for rows x (B, D), its cache updated in place."""
        block = self.temporal_block
        hidden = attention_step(_side_by_side(block.qkv, x), ctx.rope, cache.k, cache.v, cache.segment, cache.count,
                                ctx.segments, block.local, self._slots(ctx, cache), block.head_dim**-0.5, x.dtype)
        return block.proj_final(hidden)


class FusedResidualBlocks(ResidualBlocks):
    """:class:`griffin.model.ResidualBlocks` of :class:`FusedResidualBlock` whose decode steps, where every block
    makes one call (its projections matvec swaps), run the whole stack in one call from Python
    (:func:`griffin.inference.cpu.block_step.stack_step`), its weights and caches prepared once per cache. Anything else
    goes through the blocks one by one."""

    def __init__(self, blocks: ResidualBlocks) -> None:
        super().__init__(blocks)
        # (where the cache's tensors it was prepared on lie, the stack). The stack views that memory, so a cache whose
        # tensors lie there again (a new view of the same cache, as griffin serve makes at every step) reuses it, and
        # the memory of the last cache stepped stays alive as long as this copy or until another cache is stepped.
        self._stack: tuple[tuple, Stack] | None = None

    def _caches(self, cache) -> list[tuple] | None:
        """Each block's cache tensors, as :func:`griffin.inference.cpu.block_step.stack_blocks` takes them, or None if a
        block's cache is not one the stack's kernels read."""
        caches = []
        for block, state in zip(self, cache.blocks, strict=True):
            if block.weights is not None and isinstance(state, RecurrentState):
                caches.append((state.conv, state.h))
            elif block.weights is None and isinstance(state, KVCache) and state.k.dtype == block.dtype:
                temporal = block.temporal_block
                caches.append((state.k, state.v, state.segment, state.count, temporal.local,
                               temporal.head_dim**-0.5))
            else:
                return None
        return caches

    def _stack_for(self, cache, batch_size: int) -> Stack | None:
        """The stack prepared on ``cache`` (again if its tensors lie elsewhere than the last cache's), or None if a
        block's cache does not allow it (then the blocks run one by one)."""
        caches = self._caches(cache)
        if caches is None:
            return None
        where = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for c in caches for t in c if isinstance(t, Tensor))
        if self._stack is None or self._stack[0] != where:
            blocks = [(block.one_call, block.weights, parts) for block, parts in zip(self, caches, strict=True)]
            self._stack = (where, stack_blocks(blocks, batch_size))
        return self._stack[1]

    def forward(self, x: Tensor, ctx: Context, cache=None) -> Tensor:
        first = self[0] if len(self) else None
        if not (first is not None and cache is not None and x.shape[1] == 1 and ctx.reset is None
                and ctx.pad is None
                and all(isinstance(b, FusedResidualBlock) and b.one_call is not None for b in self)
                and x.dtype == first.dtype and x.device.type == "cpu" and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and (ctx.segments is not None or ctx.rope is None)):
            return super().forward(x, ctx, cache)
        stack = self._stack_for(cache, x.shape[0])
        if stack is None or (stack.attention is not None and ctx.segments is None):
            return super().forward(x, ctx, cache)
        B, _, D = x.shape
        return stack_step(x.reshape(B, D).contiguous(), stack, ctx.rope, ctx.segments, ctx.cache_len).view(B, 1, D)


def fused_step_swapped(model: nn.Module) -> nn.Module:
    """``model`` (a decode copy, changed in place) with each residual block a :class:`FusedResidualBlock`, and their
    list a :class:`FusedResidualBlocks`."""
    for i, block in enumerate(model.blocks):
        if isinstance(block, ResidualBlock):
            model.blocks[i] = FusedResidualBlock(block)
    if isinstance(model.blocks, ResidualBlocks):
        model.blocks = FusedResidualBlocks(model.blocks)
    return model
