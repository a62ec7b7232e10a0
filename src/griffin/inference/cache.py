"""Inference caches, one kind per temporal-mixing block (Section 5, Appendix G.3).

- recurrent block: the RG-LRU state (B, D_RNN) in float32 and the last K-1 Conv1D inputs; fixed size;
- local attention: a ring buffer of the last ``attention_window`` keys and values; bounded by the window;
- global attention: keys and values preallocated to the requested length, so a step has static shapes.

All rows of a batch advance together (prompts of different lengths are left-padded); ``step`` counts the tokens
processed, padding included. Each attention slot remembers the step it was written at and the document
(segment) of its token, so that masks need no other bookkeeping. Every tensor is updated in place, so a cache
keeps its storage (and a compiled or graph-captured decode step its inputs) from one step to the next.

:class:`DecodeState` is what a one-token decode step needs on top of a cache, kept on the device: the step
counter as a tensor and, per attention kind, an additive mask over the slots a decode query may see. It is
derived from a cache (never saved) and updated in place by :meth:`griffin.CausalLM.decode_step`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from griffin.config import ModelConfig

EMPTY = -1  # slot index / segment of a slot that holds nothing


@dataclass
class RecurrentCache:
    conv: Tensor  # (B, K-1, D_RNN) Conv1D inputs before the next token, zeroed before a document start
    h: Tensor  # (B, D_RNN) RG-LRU state, float32 (float64 for a float64 model; complex, D_RNN/2 wide, for the CG-LRU)


@dataclass
class AttentionCache:
    k: Tensor  # (B, S, H_kv, head_dim)
    v: Tensor  # (B, S, H_kv, head_dim)
    index: Tensor  # (S,) step at which each slot was written, EMPTY if never
    segment: Tensor  # (B, S) document id of each slot's token, EMPTY if padding or never written
    local: bool  # ring buffer of the window (True) or the whole sequence (False)


@dataclass
class Cache:
    """Per-block caches of a :class:`griffin.CausalLM` plus the running counters of each row."""

    config: ModelConfig
    blocks: list[RecurrentCache | AttentionCache]
    step: int = 0  # tokens processed so far (same for every row)
    segment: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (B,) current document id
    position: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (B,) next position

    @property
    def batch_size(self) -> int:
        return int(self.segment.shape[0])

    @property
    def max_length(self) -> int | None:
        """Tokens a global-attention cache can hold (None if the model has no global attention)."""
        sizes = [b.k.shape[1] for b in self.blocks if isinstance(b, AttentionCache) and not b.local]
        return min(sizes) if sizes else None

    def tensors(self) -> dict[str, Tensor]:
        out = {"segment": self.segment, "position": self.position}
        for i, block in enumerate(self.blocks):
            for name, value in vars(block).items():
                if isinstance(value, Tensor):
                    out[f"blocks.{i}.{name}"] = value
        return out

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # Snapshots --------------------------------------------------------------------------------------------
    def copy(self) -> Cache:
        """A deep copy that evolves independently."""
        return self.map(lambda t: t.clone())

    def map(self, fn, batched=None) -> Cache:
        """Apply ``fn`` to every tensor (``batched`` instead, if given, to those with a batch dimension)."""
        batched = batched or fn
        blocks = []
        for block in self.blocks:
            kwargs = {k: (fn if k == "index" else batched)(v) if isinstance(v, Tensor) else v
                      for k, v in vars(block).items()}
            blocks.append(type(block)(**kwargs))
        return Cache(self.config, blocks, self.step, batched(self.segment), batched(self.position))

    def select(self, rows: Tensor | list[int]) -> Cache:
        """The cache of some rows (a row may repeat): ``cache.select([0] * 8)`` forks row 0 into 8 rows."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return self.map(lambda t: t.clone(), lambda t: t[rows.to(t.device)])

    def fork(self, batch_size: int, row: int = 0) -> Cache:
        """``batch_size`` independent copies of one row's state, e.g. to sample several continuations."""
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row={row} is outside the cache's batch of {self.batch_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        return self.select([row] * batch_size)

    def to(self, device: torch.device | str) -> Cache:
        """The cache on ``device``; like ``Tensor.to``, it shares the tensors (updated in place) if already there."""
        return self.map(lambda t: t.to(device))

    def save(self, path: str | Path) -> None:
        """Write the cache to a safetensors file (atomically), with the model config it belongs to."""
        from safetensors.torch import save_file

        from griffin.io import atomic_write

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors().items()}
        meta = {"config": json.dumps(self.config.to_dict()), "step": str(self.step),
                "local": json.dumps([isinstance(b, AttentionCache) and b.local for b in self.blocks])}
        atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig | None = None, device: torch.device | str = "cpu") -> Cache:
        """Read a cache written by :meth:`save`; with ``config``, refuse a cache made by another model."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "config" not in meta:
            raise ValueError(f"{path} is not a griffin cache snapshot (no config in its metadata)")
        saved = ModelConfig.from_dict(json.loads(meta["config"]))
        if config is not None and saved.replace(name="") != config.replace(name=""):
            diff = {k: (v, getattr(config, k)) for k, v in vars(saved).items()
                    if k != "name" and getattr(config, k) != v}
            raise ValueError(f"cache snapshot {path} was made by a different model config: {diff} (saved, model)")
        local = json.loads(meta["local"])
        blocks: list[RecurrentCache | AttentionCache] = []
        for i, kind in enumerate(saved.block_types):
            p = f"blocks.{i}."
            if kind == "recurrent":
                blocks.append(RecurrentCache(tensors[p + "conv"], tensors[p + "h"]))
            else:
                blocks.append(AttentionCache(tensors[p + "k"], tensors[p + "v"], tensors[p + "index"],
                                             tensors[p + "segment"], local[i]))
        cache = cls(saved, blocks, int(meta["step"]), tensors["segment"], tensors["position"])
        return cache.to(device)


@dataclass
class DecodeState:
    """Device-side counters of a decode loop (Section 5), derived from a :class:`Cache` by :meth:`from_cache`.

    During decoding no document starts and no padding is read, so a slot, once written, stays visible: the masks
    change only at the slot each step writes, and the whole state can be updated in place without host syncs.
    """

    step: Tensor  # (1,) long: the cache's step (tokens processed) on the device, i.e. the next token's step
    segment: Tensor  # (B,) long: the document id written to attention slots for decoded tokens
    local_bias: Tensor | None  # (B, window): 0 at slots a local-attention decode query sees, -inf elsewhere
    global_bias: Tensor | None  # (B, max_length): the same for global attention
    inv_freq: Tensor  # (rope_dim // 2,) float32 RoPE frequencies

    @classmethod
    def from_cache(cls, cache: Cache, dtype: torch.dtype) -> DecodeState:
        """The state that continues ``cache``; ``dtype`` is the model's (that of the attention scores)."""
        from griffin.layers.rope import rope_inv_freq

        device = cache.position.device
        segment = cache.segment.clone() if cache.config.attention_document_mask else torch.zeros_like(cache.segment)
        biases: dict[bool, Tensor] = {}
        for block in cache.blocks:
            if isinstance(block, AttentionCache) and block.local not in biases:
                # Every block of one kind is written at the same slots with the same bookkeeping: one mask each.
                # A ring buffer holds exactly the window, so each slot it holds is within the next query's reach.
                visible = (block.index >= 0) & (block.segment == segment[:, None])
                bias = torch.zeros(visible.shape, dtype=dtype, device=device)
                biases[block.local] = bias.masked_fill_(~visible, float("-inf"))
        step = torch.tensor([cache.step], dtype=torch.long, device=device)
        inv_freq = rope_inv_freq(cache.config.rope_dim, cache.config.rope_base, device)
        return cls(step, segment, biases.get(True), biases.get(False), inv_freq)


def init_cache(config: ModelConfig, batch_size: int, max_length: int | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Cache:
    """An empty cache. ``max_length`` sizes global-attention caches (required if the model has any)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    blocks: list[RecurrentCache | AttentionCache] = []
    for kind in config.block_types:
        if kind == "recurrent":
            state_dtype = torch.promote_types(dtype, torch.float32)  # the recurrence's accumulation dtype
            state_dtype = state_dtype.to_complex() if config.complex_lru else state_dtype
            blocks.append(RecurrentCache(
                conv=torch.zeros(batch_size, config.conv1d_width - 1, config.rnn_width, dtype=dtype, device=device),
                h=torch.zeros(batch_size, config.lru_width, dtype=state_dtype, device=device),
            ))
            continue
        local = kind == "local_attention"
        if local:
            slots = config.attention_window
        else:
            if max_length is None or max_length < 1:
                raise ValueError(f"a model with global attention needs max_length >= 1 to size its KV cache, "
                                 f"got {max_length}")
            slots = max_length
        shape = (batch_size, slots, config.num_kv_heads, config.head_dim)
        blocks.append(AttentionCache(
            k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
            index=torch.full((slots,), EMPTY, dtype=torch.long, device=device),
            segment=torch.full((batch_size, slots), EMPTY, dtype=torch.long, device=device), local=local,
        ))
    zeros = torch.zeros(batch_size, dtype=torch.long, device=device)
    return Cache(config, blocks, 0, zeros.clone(), zeros.clone())


def cache_bytes(config: ModelConfig, batch_size: int, length: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the cache after ``length`` tokens (Appendix G.3): 2 N_glob T H_kv d for global MQA, bounded by the
    window for local MQA, and (K-1) D_RNN + D_RNN (fp32 state) per recurrent block, all times the batch."""
    item = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for kind in config.block_types:
        if kind == "recurrent":
            state = 8 * config.lru_width if config.complex_lru else 4 * config.lru_width
            total += (config.conv1d_width - 1) * config.rnn_width * item + state
        else:
            slots = min(length, config.attention_window) if kind == "local_attention" else length
            total += 2 * slots * config.num_kv_heads * config.head_dim * item
    return batch_size * total
