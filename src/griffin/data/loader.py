"""Streaming a prepared dataset: packed, shuffled, resumable training batches and fixed evaluation batches.

``PackedLoader`` cuts a split's token stream into windows of ``seq_len + 1`` tokens and yields ``Batch`` es with each
token's position in its document (0 at every document start) and targets masked (-100) where the next token starts a
new document.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from griffin.data.dataset import DTYPES, load_meta
from griffin.ops.cross_entropy import IGNORE_INDEX


class _SplitTokens:
    """A split's shards as one memory-mapped token stream, with the global document starts."""

    def __init__(self, data_dir: str | Path, meta: dict, split: str) -> None:
        data_dir = Path(data_dir)
        if split not in meta["splits"]:
            raise ValueError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
        info = meta["splits"][split]
        dtype = DTYPES[meta["dtype"]]
        self.shards = [np.memmap(data_dir / s, dtype=dtype, mode="r") for s in info["shards"]]
        self.shard_idx = [np.load(data_dir / s.replace(".bin", ".idx.npy"), allow_pickle=False) for s in info["shards"]]
        sizes = np.array([len(s) for s in self.shards], np.int64)
        self.shard_starts = np.cumsum(sizes) - sizes
        self.num_tokens = int(sizes.sum())
        self.doc_starts = np.concatenate([np.zeros(0, np.int64)]
                                         + [i + s for i, s in zip(self.shard_idx, self.shard_starts, strict=True)])
        if self.num_tokens != info["tokens"] or len(self.doc_starts) != info["documents"]:
            raise ValueError(f"split {split!r} of {data_dir}: {self.num_tokens} tokens and {len(self.doc_starts)} "
                             f"documents on disk, meta.json says {info['tokens']} and {info['documents']}")

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        out = np.empty(length, np.int64)
        i = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.shard_starts[i])
            n = min(length - filled, len(self.shards[i]) - offset)
            out[filled:filled + n] = self.shards[i][offset:offset + n]
            filled += n
            i += 1
        return out

    def positions(self, index: np.ndarray) -> np.ndarray:
        """Each token's position in its document, for an array of token indices."""
        doc = np.searchsorted(self.doc_starts, index, side="right") - 1
        return index - self.doc_starts[doc]


class Batch(NamedTuple):
    """Token ids, positions in their documents and next-token targets (-100: not scored), each (batch, seq_len)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor


class PackedLoader:
    """Endless batches of packed windows from a prepared split.

    The split is one token stream cut into ``num_windows = (tokens - 1) // seq_len`` windows of ``seq_len + 1``
    tokens at stride ``seq_len``. Every epoch visits each window once, in an order shuffled by
    ``np.random.default_rng([seed, epoch])`` (in order when ``shuffle=False``); rank ``r`` of ``world_size`` takes
    windows ``r, r + world_size, ...`` of that order, all ranks the same number (``num_windows // world_size``; the
    few windows left over differ each epoch when shuffling). Batches run on across epoch boundaries.

    The state (``state_dict``) is the same on every rank, so one rank's state resumes all of them."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.data_dir, self.split = Path(data_dir), split
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.meta = load_meta(data_dir)
        self.data = _SplitTokens(data_dir, self.meta, split)
        n = self.data.num_tokens
        if n < seq_len + 1:
            raise ValueError(f"split {split!r} of {data_dir} has {n} tokens; seq_len {seq_len} needs at least "
                             f"{seq_len + 1} (seq_len + 1)")
        self.num_windows = (n - 1) // seq_len
        if self.num_windows < world_size:
            raise ValueError(f"split {split!r} of {data_dir} has {n} tokens, {self.num_windows} windows of "
                             f"seq_len {seq_len}; world_size {world_size} needs at least {world_size * seq_len + 1} "
                             "tokens")
        self.windows_per_rank = self.num_windows // world_size
        self._epoch = 0
        self._index = 0  # next window of this epoch's order
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens of one epoch, summed over all ranks."""
        return self.windows_per_rank * self.world_size * self.seq_len

    @property
    def epoch(self) -> float:
        """Progress in epochs: the epoch number plus the fraction of it already done."""
        return self._epoch + self._index / self.windows_per_rank

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                order = np.arange(self.num_windows)
            self._order = order[: self.windows_per_rank * self.world_size][self.rank :: self.world_size]
            self._order_epoch = epoch
        return self._order

    def next_windows(self) -> np.ndarray:
        """The indices of the next ``batch_size`` windows (advancing the loader)."""
        out = []
        need = self.batch_size
        while need:
            take = min(need, self.windows_per_rank - self._index)
            out.append(self._epoch_order(self._epoch)[self._index : self._index + take])
            self._index += take
            need -= take
            if self._index == self.windows_per_rank:
                self._epoch, self._index = self._epoch + 1, 0
        return np.concatenate(out)

    def gather(self, windows: np.ndarray) -> Batch:
        """The batch of the given windows."""
        starts = np.asarray(windows, np.int64) * self.seq_len
        tokens = np.stack([self.data.read(int(s), self.seq_len + 1) for s in starts])
        positions = self.data.positions(starts[:, None] + np.arange(self.seq_len + 1))
        targets = np.where(positions[:, 1:] == 0, IGNORE_INDEX, tokens[:, 1:])
        return Batch(torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                     torch.from_numpy(np.ascontiguousarray(positions[:, :-1])),
                     torch.from_numpy(np.ascontiguousarray(targets)))

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        return self.gather(self.next_windows())

    def _fingerprint(self) -> dict:
        return {"tokens": self.data.num_tokens, "documents": len(self.data.doc_starts),
                "vocab_size": self.meta["vocab_size"]}

    def state_dict(self) -> dict:
        """Where the loader is, as plain JSON-serialisable values."""
        return {"split": self.split, "epoch": self._epoch, "index": self._index, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "world_size": self.world_size, "dataset": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next batches are those the saved loader would have produced."""
        mine = self.state_dict()
        keys = ("split", "seed", "seq_len", "batch_size", "shuffle", "world_size", "dataset")
        diff = [f"{k}: {state.get(k)!r} in the state, {mine[k]!r} here" for k in keys if state.get(k) != mine[k]]
        if diff:
            raise ValueError("loader state does not match this loader: " + "; ".join(diff))
        if not 0 <= state["index"] < self.windows_per_rank or state["epoch"] < 0:
            raise ValueError(f"loader state at epoch {state['epoch']}, window {state['index']} is out of range "
                             f"({self.windows_per_rank} windows per epoch)")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])


def eval_batches(data_dir: str | Path, split: str, seq_len: int, batch_size: int,
                 max_batches: int | None = None) -> list[Batch]:
    """Fixed batches of the split's windows in order (the last one may be smaller), at most ``max_batches``."""
    loader = PackedLoader(data_dir, split, seq_len, batch_size, shuffle=False)
    n_batches = math.ceil(loader.num_windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    windows = np.arange(loader.num_windows)
    return [loader.gather(windows[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)]


def _target_counts(data: _SplitTokens, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """Counts of each token id over the split's targets: every token that does not start a document."""
    counts = np.zeros(vocab_size, np.int64)
    for shard, idx in zip(data.shards, data.shard_idx, strict=True):
        for i in range(0, len(shard), chunk):
            counts += np.bincount(shard[i : i + chunk], minlength=vocab_size)[:vocab_size]
        counts -= np.bincount(shard[idx], minlength=vocab_size)[:vocab_size]
    return counts


def unigram_loss(data_dir: str | Path) -> float:
    """The unigram baseline in nats/token: cross-entropy of the val targets under the train targets' frequencies,
    add-one smoothed over the vocabulary. Targets are the tokens the loader scores: all but document starts."""
    meta = load_meta(data_dir)
    vocab_size = meta["vocab_size"]
    train = _target_counts(_SplitTokens(data_dir, meta, "train"), vocab_size)
    val = _target_counts(_SplitTokens(data_dir, meta, "val"), vocab_size)
    if val.sum() == 0:
        raise ValueError(f"the val split of {data_dir} has no targets (prepare with val_fraction > 0)")
    log_p = np.log(train + 1.0) - np.log(train.sum() + vocab_size)
    return float(-(val * log_p).sum() / val.sum())
