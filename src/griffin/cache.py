"""The inference state of a model (Section 5, Appendix G.3): one cache per block, owned and updated by its block, and
each row's place in its documents.

- recurrent block: the RG-LRU state and the last K-1 Conv1D inputs (:class:`griffin.layers.RecurrentState`): fixed;
- local attention: a ring buffer of the window's keys and values (:class:`griffin.layers.KVCache`): bounded;
- global attention: keys and values preallocated to ``max_length`` tokens: linear in the length.

Rows are independent: each has its own next position, document id and, in every attention cache, its own count of
tokens written, so a row can be replaced (:meth:`Cache.insert`) while the others go on. Every tensor is updated in
place, so a cache keeps its storage (and a compiled decode step its inputs) from one step to the next; snapshots are
copies (:meth:`Cache.copy`, :meth:`Cache.fork`) or safetensors files (:meth:`Cache.save`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from griffin.config import ModelConfig
from griffin.io import atomic_write, read_safetensors
from griffin.layers import KVCache, RecurrentState

SNAPSHOT_FORMAT = "griffin-cache-2"

BlockCache = RecurrentState | KVCache


@dataclass
class Cache:
    """The caches of a :class:`griffin.CausalLM`'s blocks, plus each row's counters (made by ``model.init_cache``)."""

    config: ModelConfig
    blocks: list[BlockCache]
    position: Tensor  # (B,) long: the next token's position in its document
    segment: Tensor  # (B,) long: the id of each row's current document
    length: int = 0  # host-side bound on the tokens any row holds (padding included): sizes eager attention
    started: bool = False  # host-side: every row is inside a document (next position >= 1), so tokens continuing
    # them start none (a decode step then skips the document-start bookkeeping)

    @property
    def batch_size(self) -> int:
        return int(self.position.shape[0])

    @property
    def max_length(self) -> int | None:
        """Tokens a global-attention cache can hold per row (None if the model has no global attention)."""
        sizes = [b.k.shape[1] for b, kind in zip(self.blocks, self.config.block_types, strict=True)
                 if kind == "attention"]
        return min(sizes) if sizes else None

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor by a flat name (``position``, ``blocks.3.k``, ...): all have the batch as first dimension."""
        out = {"position": self.position, "segment": self.segment}
        for i, block in enumerate(self.blocks):
            for f in dataclasses.fields(block):
                out[f"blocks.{i}.{f.name}"] = getattr(block, f.name)
        return out

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # Copies and rows --------------------------------------------------------------------------------------------
    def map(self, fn: Callable[[Tensor], Tensor]) -> Cache:
        """A cache whose every tensor is ``fn`` of this one's."""
        blocks = [type(b)(**{f.name: fn(getattr(b, f.name)) for f in dataclasses.fields(b)}) for b in self.blocks]
        return Cache(self.config, blocks, fn(self.position), fn(self.segment), self.length, self.started)

    def copy(self) -> Cache:
        """A deep copy that evolves independently."""
        return self.map(lambda t: t.clone())

    def to(self, device: torch.device | str) -> Cache:
        """The cache on ``device``; like ``Tensor.to``, it shares the tensors (updated in place) if already there."""
        return self.map(lambda t: t.to(device))

    def select(self, rows: Sequence[int] | Tensor) -> Cache:
        """A new cache of some rows, in that order (a row may repeat): ``cache.select([0] * 8)`` forks row 0."""
        index = self._rows(rows)
        return self.map(lambda t: t[index.to(t.device)])

    def fork(self, batch_size: int, row: int = 0) -> Cache:
        """``batch_size`` independent copies of one row's state, e.g. to sample several continuations."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        return self.select([row] * batch_size)

    def insert(self, rows: Sequence[int] | Tensor, other: Cache) -> None:
        """Overwrite ``rows`` of this cache, in place, with the rows of ``other`` (as many, same model and slots): a
        new sequence joins a running batch, at its own position."""
        index = self._rows(rows)
        self._check_rows_fit(other, "insert rows of")
        if other.batch_size != len(index):
            raise ValueError(f"{len(index)} rows to overwrite but the other cache holds {other.batch_size}")
        mine, theirs = self.tensors(), other.tensors()
        for name, t in mine.items():
            t[index.to(t.device)] = theirs[name].to(t.device, t.dtype)
        self.length = max(self.length, other.length)
        self.started = self.started and other.started

    @classmethod
    def cat(cls, caches: Sequence[Cache]) -> Cache:
        """The rows of several caches of one model side by side, in order, as a new cache (copies): e.g. to run one
        chunk of several prompts, each with its own state, in one forward pass (:meth:`select` splits them again)."""
        if not caches:
            raise ValueError("no caches to concatenate")
        first = caches[0]
        for other in caches[1:]:
            first._check_rows_fit(other, "concatenate")
        blocks = [type(b)(**{f.name: torch.cat([getattr(c.blocks[i], f.name) for c in caches])
                             for f in dataclasses.fields(b)}) for i, b in enumerate(first.blocks)]
        return Cache(first.config, blocks, torch.cat([c.position for c in caches]),
                     torch.cat([c.segment for c in caches]), max(c.length for c in caches),
                     all(c.started for c in caches))

    def _check_rows_fit(self, other: Cache, verb: str) -> None:
        """Raise a ValueError unless ``other``'s rows are laid out as this cache's: the same model config and the same
        tensor shapes per row (a global-attention cache's ``max_length`` included)."""
        if other.config.replace(name="") != self.config.replace(name=""):
            raise ValueError(f"cannot {verb} a cache made for a different model config")
        mine, theirs = self.tensors(), other.tensors()
        for name, t in mine.items():
            if theirs[name].shape[1:] != t.shape[1:]:
                raise ValueError(f"cannot {verb} a cache whose {name} is {tuple(theirs[name].shape[1:])} per row, "
                                 f"{tuple(t.shape[1:])} here (another max_length?)")

    def _rows(self, rows: Sequence[int] | Tensor) -> Tensor:
        index = torch.as_tensor(rows, dtype=torch.long).flatten().cpu()
        bad = [int(r) for r in index if not 0 <= int(r) < self.batch_size]
        if bad:
            raise ValueError(f"row {bad[0]} is outside the cache's batch of {self.batch_size}")
        return index

    # Snapshots --------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the cache to a safetensors file (atomically), with the model config it belongs to."""
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors().items()}
        meta = {"format": SNAPSHOT_FORMAT, "config": json.dumps(self.config.to_dict()), "length": str(self.length),
                "started": json.dumps(self.started)}
        atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig | None = None, device: torch.device | str = "cpu") -> Cache:
        """Read a cache written by :meth:`save`; with ``config``, refuse a cache made by another model."""
        tensors, meta = read_safetensors(Path(path))
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"{path} is not a griffin cache snapshot ({SNAPSHOT_FORMAT}); format "
                             f"{meta.get('format', 'unknown')!r}")
        try:
            saved = ModelConfig.from_dict(json.loads(meta["config"]))
            length, started = int(meta["length"]), bool(json.loads(meta.get("started", "false")))
        except (KeyError, ValueError) as err:
            raise ValueError(f"cache snapshot {path} has broken metadata: {err}") from None
        if config is not None and saved.replace(name="") != config.replace(name=""):
            diff = {k: (v, getattr(config, k)) for k, v in vars(saved).items()
                    if k != "name" and getattr(config, k) != v}
            raise ValueError(f"cache snapshot {path} was made by a different model config: {diff} (saved, model)")
        blocks: list[BlockCache] = []
        for i, kind in enumerate(saved.block_types):
            kind_cls = RecurrentState if kind == "recurrent" else KVCache
            names = [f.name for f in dataclasses.fields(kind_cls)]
            missing = [n for n in names if f"blocks.{i}.{n}" not in tensors]
            if missing:
                raise ValueError(f"cache snapshot {path} lacks blocks.{i}.{missing[0]}")
            blocks.append(kind_cls(**{n: tensors[f"blocks.{i}.{n}"] for n in names}))
        missing = [n for n in ("position", "segment") if n not in tensors]
        if missing:
            raise ValueError(f"cache snapshot {path} lacks {missing[0]}")
        cache = cls(saved, blocks, tensors["position"], tensors["segment"], length, started)
        return cache.to(device)


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
