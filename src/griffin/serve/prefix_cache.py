"""The prefix-state cache (Section 5): Hawk's and Griffin's whole context is a fixed-size state, so the state after a
prompt's prefix (a few-shot preamble, a system prompt, a conversation's earlier turns) is a snapshot of a few
megabytes that any later request extending that prefix can start from, prefilling only the rest.

**A radix tree of token blocks.** The tree is keyed by blocks of ``block`` (B) tokens: a node is one block (a tuple of
B token ids) under its parent, so the node at depth d stands for the prefix of d * B tokens spelt by its path. A node
may hold the state after its prefix (:attr:`_Node.entry`). States after a prefix whose length is not a multiple of B
(a chat message's end, a prompt's end) hang on the node of their last whole block as *tails*: ``_Node.tails`` maps
the r < B tokens that follow (a tuple) to the state after d * B + r tokens. Each state is a :class:`PrefixEntry`: a
one-row :class:`griffin.cache.Cache` copy and the logits of the prefix's last token.

**Lookup** walks the prompt block by block from the namespace's root (one dict look-up per block), then, from the
deepest node reached back up, takes the first state it finds: that node's longest matching tail, else its own state.
That is the longest cached prefix of the prompt, in O(prompt blocks) dict look-ups (plus the few tails of the nodes
where it stops). :meth:`PrefixCache.lookup_reference` finds the same by comparing the prompt with every stored
prefix.

**Namespaces.** Every ``lookup``/``store`` takes a hashable ``namespace`` (default None) that selects its own root:
states made by different weights (LoRA adapters) never meet.

**Eviction.** The states' bytes are bounded by ``max_bytes``. The states form one least-recently-used order in which
a state always comes after every state that extends it: a lookup or a store touches the state it finds or stores,
then every cached state on its path, from the deepest to the root. So the least recently used state is always a
leaf (no cached state extends it), and leaves go first: a branch point of the tree (a shared preamble's state) is
evicted only after every state below it. A node whose subtree holds no state is pruned.

**The local-attention window travels with the state.** A local-attention block's cache is a ring buffer of the last
``attention_window`` keys and values (:class:`griffin.layers.KVCache`, slot t mod window), whatever the block
boundaries: a snapshot at a block boundary holds every key and value the next token's query may see, including
those of tokens before the block, however the window compares with B. Together with the RG-LRU state and the last
K - 1 Conv1D inputs of each recurrent block (and, for MQA's global attention, the whole KV cache so far), the
snapshot is the exact state a cold prefill reaches after those tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from griffin.cache import Cache


@dataclass(eq=False)
class _Node:
    """One block of tokens under its parent: the state after its prefix, and the states after prefixes that end
    within the next block (``tails``: the r < B tokens after this node's prefix -> state)."""

    key: tuple[int, ...]
    parent: _Node | None
    depth: int  # blocks from the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    entry: PrefixEntry | None = None
    tails: dict[tuple[int, ...], PrefixEntry] = field(default_factory=dict)

    def empty(self) -> bool:
        return self.entry is None and not self.tails and not self.children


@dataclass(eq=False)
class PrefixEntry:
    """The state after ``length`` tokens of a prefix, and the logits of its last token (V,). ``node`` and ``tail``
    place it in the tree (``tail`` None: the node's own state)."""

    length: int
    cache: Cache
    logits: Tensor
    nbytes: int
    node: _Node | None = None
    tail: tuple[int, ...] | None = None


class PrefixCache:
    """States after token prefixes in a radix tree of ``block``-token blocks, within ``max_bytes`` (0 disables it),
    leaves evicted first, least recently used first (see the module docstring). Thread-safe."""

    def __init__(self, max_bytes: int, block: int = 64) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r} must be a positive integer (tokens per tree node)")
        self.max_bytes, self.block = max_bytes, block
        self.roots: dict[Hashable, _Node] = {}
        self.lru: OrderedDict[PrefixEntry, None] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = self.evictions = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.lru)

    # The tree ---------------------------------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], namespace: Hashable) -> list[_Node]:
        """The nodes of ``tokens``' whole blocks that are in the tree, root first (just the root if none)."""
        node = self.roots.get(namespace)
        if node is None:
            return []
        path, B = [node], self.block
        for d in range(len(tokens) // B):
            node = node.children.get(tuple(tokens[d * B : (d + 1) * B]))
            if node is None:
                break
            path.append(node)
        return path

    def _on_path(self, tokens: Sequence[int], path: list[_Node]) -> Iterator[PrefixEntry]:
        """Every cached state whose prefix is a prefix of ``tokens`` (on ``path``), longest first."""
        B = self.block
        for node in reversed(path):
            start = node.depth * B
            if node.tails:
                rest = tuple(tokens[start : start + B - 1])
                for r in sorted({len(t) for t in node.tails if len(t) <= len(rest)}, reverse=True):
                    entry = node.tails.get(rest[:r])
                    if entry is not None:
                        yield entry
            if node.entry is not None:
                yield node.entry

    def _touch(self, tokens: Sequence[int], path: list[_Node]) -> None:
        """Make the states on ``tokens``' path the most recently used, the shortest last (so the LRU's first state
        is always a leaf)."""
        for entry in self._on_path(tokens, path):
            self.lru.move_to_end(entry)

    # Public API -------------------------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], namespace: Hashable = None) -> PrefixEntry | None:
        """The entry of the longest cached prefix of ``tokens`` (the whole of them included), or None. Counts a hit
        or a miss; the entry's cache is shared: copy it before changing it."""
        if not self.max_bytes:
            return None
        tokens = [int(t) for t in tokens]
        with self.lock:
            path = self._walk(tokens, namespace)
            found = next(self._on_path(tokens, path), None)
            if found is None:
                self.misses += 1
                return None
            self._touch(tokens[: found.length], path[: found.length // self.block + 1])
            self.hits += 1
            self.hit_tokens += found.length
            return found

    def lookup_reference(self, tokens: Sequence[int], namespace: Hashable = None) -> PrefixEntry | None:
        """:meth:`lookup` by comparing ``tokens`` with the whole prefix of every stored state (no statistics, no LRU
        update)."""
        tokens = [int(t) for t in tokens]
        with self.lock:
            best = None
            for entry in self.lru:
                prefix, root = self._prefix_of(entry)
                if root is self.roots.get(namespace) and tokens[: len(prefix)] == prefix \
                        and (best is None or entry.length > best.length):
                    best = entry
            return best

    def _prefix_of(self, entry: PrefixEntry) -> tuple[list[int], _Node]:
        """The tokens of an entry's prefix (from its node's parents) and its root."""
        blocks, node = [], entry.node
        while node.parent is not None:
            blocks.append(node.key)
            node = node.parent
        prefix = [t for key in reversed(blocks) for t in key] + list(entry.tail or ())
        return prefix, node

    def entries(self) -> list[tuple[Hashable, list[int], PrefixEntry]]:
        """Every state: its namespace, its prefix, the entry (least recently used first)."""
        with self.lock:
            names = {id(root): ns for ns, root in self.roots.items()}
            out = []
            for entry in self.lru:
                prefix, root = self._prefix_of(entry)
                out.append((names[id(root)], prefix, entry))
            return out

    def contains(self, tokens: Sequence[int], namespace: Hashable = None) -> bool:
        """Whether the state after exactly ``tokens`` is cached."""
        tokens = [int(t) for t in tokens]
        with self.lock:
            path = self._walk(tokens, namespace)
            return any(e.length == len(tokens) for e in self._on_path(tokens, path))

    def store(self, tokens: Sequence[int], cache: Cache, logits: Tensor, namespace: Hashable = None) -> bool:
        """Keep a copy of ``cache`` (one row: the state after ``tokens``) and of the last token's ``logits`` under
        ``namespace``, replacing a state after the same tokens. Returns False if it does not fit the budget at all."""
        if cache.batch_size != 1:
            raise ValueError(f"a prefix state is one row, got a cache of {cache.batch_size}")
        if not self.max_bytes or not len(tokens):
            return False
        tokens = [int(t) for t in tokens]
        snapshot, logits = cache.copy(), logits.detach().reshape(-1).clone()
        nbytes = snapshot.nbytes() + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return False
        B = self.block
        with self.lock:
            node = self.roots.get(namespace)
            if node is None:
                node = self.roots[namespace] = _Node((), None, 0)
            for d in range(len(tokens) // B):
                key = tuple(tokens[d * B : (d + 1) * B])
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = _Node(key, node, d + 1)
                node = child
            tail = tuple(tokens[node.depth * B :]) or None
            old = node.entry if tail is None else node.tails.get(tail)
            if old is not None:
                self._remove(old, prune=False)
            entry = PrefixEntry(len(tokens), snapshot, logits, nbytes, node, tail)
            if tail is None:
                node.entry = entry
            else:
                node.tails[tail] = entry
            self.lru[entry] = None
            self.nbytes += nbytes
            path = [node]
            while path[-1].parent is not None:
                path.append(path[-1].parent)
            self._touch(tokens, path[::-1])
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self.lru)))
                self.evictions += 1
        return True

    def _remove(self, entry: PrefixEntry, prune: bool = True) -> None:
        """Forget a state; with ``prune``, drop the nodes left without a state below them."""
        del self.lru[entry]
        self.nbytes -= entry.nbytes
        node = entry.node
        if entry.tail is None:
            node.entry = None
        else:
            del node.tails[entry.tail]
        while prune and node.parent is not None and node.empty():
            del node.parent.children[node.key]
            node = node.parent
        if prune and node.parent is None and node.empty():
            self.roots = {ns: root for ns, root in self.roots.items() if root is not node}

    def clear(self) -> None:
        with self.lock:
            self.roots.clear()
            self.lru.clear()
            self.nbytes = 0
