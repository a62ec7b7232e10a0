"""What every block of one forward pass shares about its tokens, computed once by the model (Section 2).

Packed documents (Section 3): ``positions`` hold each token's position in its document, and a document start
(position 0) hides everything before it from the recurrence, the Conv1D and attention. Left padding (position -1,
batched prompts of several lengths) is seen by nothing. With an inference cache, the tokens continue each row's cached
documents.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

EMPTY = -1  # document id of a padding token and of an attention slot that holds nothing


@dataclass(frozen=True)
class Context:
    """The tokens' bookkeeping, shared by every block of one forward pass.

    Attributes:
        positions: (B, T) each token's position in its document (padding clamped to 0).
        reset: (B, T) bool, True where a document starts or at padding: the state before it is dropped. None when no
            document starts after a state (one document per row, or one continued from a cache).
        pad: (B, T) bool, True at padding tokens, whose Conv1D inputs are zeroed; None without padding.
        segments: (B, T) document id of each token (EMPTY at padding), for attention masks and cache slots; None when
            every row is one document starting at t = 0 (plain causal attention).
        rope: (cos, sin), each (B, T, rope_dim // 2), the RoPE angles of ``positions``; None without attention.
        cache_len: with a cache, a host-side bound on the tokens any row holds after this pass (eager attention
            reads only those slots of a global KV cache); None: every slot (static shapes, for compiled steps).
    """

    positions: Tensor
    reset: Tensor | None = None
    pad: Tensor | None = None
    segments: Tensor | None = None
    rope: tuple[Tensor, Tensor] | None = None
    cache_len: int | None = None
