"""The prefix-state cache (Section 5): Hawk's and Griffin's whole context is a fixed-size state, so the state after a
prompt's prefix (a system prompt, a conversation's earlier turns) is a snapshot of a few megabytes that any later
request extending that prefix can start from, prefilling only the rest.

Entries are one-row :class:`griffin.cache.Cache` copies with the logits of the prefix's last token, keyed by a hash of
the prefix's tokens, evicted least recently used first to stay within a byte budget.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from griffin.cache import Cache


def prefix_key(tokens: Sequence[int]) -> bytes:
    """The key of a token prefix: BLAKE2b of its int64 tokens."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class PrefixEntry:
    """The state after ``length`` tokens of a prefix, and the logits of its last token (V,)."""

    length: int
    cache: Cache
    logits: Tensor
    nbytes: int


class PrefixCache:
    """LRU of states after token prefixes, within ``max_bytes`` (0 disables it). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self.lengths: Counter[int] = Counter()  # how many entries have each prefix length
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = self.evictions = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, tokens: Sequence[int]) -> PrefixEntry | None:
        """The entry of the longest cached prefix of ``tokens`` (the whole of them included), or None. Counts a hit
        or a miss; the entry's cache is shared: copy it before changing it."""
        if not self.max_bytes:
            return None
        tokens = np.asarray(tokens, dtype=np.int64)
        with self.lock:
            found = None
            for length in sorted((n for n in self.lengths if n <= len(tokens)), reverse=True):
                entry = self.entries.get(prefix_key(tokens[:length]))
                if entry is not None and entry.length == length:
                    found = entry
                    break
            if found is None:
                self.misses += 1
                return None
            self.entries.move_to_end(prefix_key(tokens[: found.length]))
            self.hits += 1
            self.hit_tokens += found.length
            return found

    def lookup_reference(self, tokens: Sequence[int]) -> PrefixEntry | None:
        """:meth:`lookup` by trying every prefix length, longest first (no statistics, no LRU update)."""
        with self.lock:
            for length in range(len(tokens), 0, -1):
                entry = self.entries.get(prefix_key(tokens[:length]))
                if entry is not None:
                    return entry
            return None

    def contains(self, tokens: Sequence[int]) -> bool:
        with self.lock:
            return prefix_key(tokens) in self.entries

    def store(self, tokens: Sequence[int], cache: Cache, logits: Tensor) -> bool:
        """Keep a copy of ``cache`` (one row: the state after ``tokens``) and of the last token's ``logits``. Returns
        False if it does not fit the budget at all."""
        if cache.batch_size != 1:
            raise ValueError(f"a prefix state is one row, got a cache of {cache.batch_size}")
        if not self.max_bytes or not len(tokens):
            return False
        key = prefix_key(tokens)
        snapshot, logits = cache.copy(), logits.detach().reshape(-1).clone()
        nbytes = snapshot.nbytes() + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return False
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self._forget(old)
            entry = PrefixEntry(len(tokens), snapshot, logits, nbytes)
            self.entries[key] = entry
            self.lengths[entry.length] += 1
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, evicted = self.entries.popitem(last=False)
                self._forget(evicted)
                self.evictions += 1
        return True

    def _forget(self, entry: PrefixEntry) -> None:
        self.nbytes -= entry.nbytes
        self.lengths[entry.length] -= 1
        if not self.lengths[entry.length]:
            del self.lengths[entry.length]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.lengths.clear()
            self.nbytes = 0
