"""Multi-query attention kernels (Section 2.3): masked attention over a key/value cache, and sliding-window (local)
attention, where each query sees the ``window`` most recent keys, itself included, of its own document.

:func:`masked_attention` attends queries to cached keys under a boolean mask: one query per row (a decode step) runs
as two batched matmuls (:func:`attend_one`), which on CPU cost far less than a fused kernel's setup for a single query;
longer inputs go through PyTorch's fused attention (:func:`fused_sdpa`), its reference.

:func:`sliding_window_attention` is the fast local path: queries are cut into chunks of C tokens, and a chunk attends to
the C + window - 1 keys that can reach it, as one batched call of PyTorch's fused attention
(:func:`fused_sdpa`: FlashAttention's CPU kernel, the memory-efficient kernel on CUDA). Memory is
O(T · (C + window)), never a T × T mask or score matrix; the work is (C + window - 1) / window of the useful work,
so C is a fraction of the window (:func:`local_chunk`). On a CPU under ``torch.compile``, bf16 (or fp16) chunks of at
most :data:`BMM_MAX_SPAN` keys go through :func:`attention_bmm` instead (two batched matmuls with the masked softmax
between, which the compiler fuses; the fused kernel's bf16 backward costs more at that size), and longer chunks through
the fused kernel in float32 (:func:`fused_sdpa_float32`: under a mask its float32 kernels beat its bf16 ones).
:func:`sliding_window_attention_ref` is the reference: one dense T × T mask, for tests. A compiled bf16 CPU step
over at most :data:`CAUSAL_BMM_MAX_LEN` tokens without a cache takes neither: a layer's local attention goes through
:func:`causal_attention` with the window (:func:`local_by_causal_chunks`), chunks of :data:`CAUSAL_BMM_CHUNK`
queries by :func:`attention_bmm`, each over the keys from the first its window reaches, as global attention does
(on a CPU with AMX, global attention without documents only up to :data:`AMX_CAUSAL_BMM_MAX_LEN` tokens).

Layout: q (B, T, H, d); k, v (B, P + T, H_kv, d), where the first P keys precede the first query (the tokens
held in a cache, oldest first; P = 0 without one). Query t sits at key index P + t. Segments (document ids) are
optional: q_seg (B, T) and k_seg (B, P + T); a query sees a key only if their ids are equal. Output (B, T, H, d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Work per query is (C + window - 1) keys for window useful ones: C a quarter of the window, within [64, 256], was
# within the noise of the best chunk at every window measured, and smaller chunks lose to per-chunk overhead
# (benchmarks/local_attention.py --chunks-only; docs/performance.md, "Local attention").
MIN_CHUNK, MAX_CHUNK = 64, 256
# Keys per chunk up to which compiled bf16 CPU calls of sliding_window_attention attend by attention_bmm: chunks of 64
# queries over 191 keys ran faster so, chunks over 512-token windows slower; a float32 step gained nothing measurable
# (benchmarks/local_attention.py --compiled; docs/performance.md, "Local attention").
BMM_MAX_SPAN = 256
# Causal attention in a compiled bf16 CPU step, up to CAUSAL_BMM_MAX_LEN tokens: by attention_bmm, global attention
# in one call up to BMM_MAX_SPAN tokens, beyond (and local attention at any length) in chunks of CAUSAL_BMM_CHUNK
# queries, each over the keys from the first its window reaches to its last query (A/B of the compiled MQA and
# Griffin steps, benchmarks/train_small.py; docs/performance.md, "Small-model training"); longer sequences through
# the fused kernel, or sliding_window_attention.
CAUSAL_BMM_CHUNK, CAUSAL_BMM_MAX_LEN = 64, 1024
# On a CPU with AMX tiles (Intel Sapphire Rapids and later), the fused kernel's bf16 causal attention without a mask
# (is_causal) runs its blocks on the tiles: global attention beyond AMX_CAUSAL_BMM_MAX_LEN tokens takes it (the
# compiled bf16 MQA step at 1,024 tokens ran 1.37x faster so; at 256 attention_bmm stays). Local attention and
# documents (a mask) keep attention_bmm, as do CPUs without AMX (docs/performance.md, "Local attention").
AMX_CAUSAL_BMM_MAX_LEN = 512
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def local_chunk(window: int) -> int:
    """Queries per chunk for a window: a quarter of the window, within [MIN_CHUNK, MAX_CHUNK]."""
    return min(MAX_CHUNK, max(MIN_CHUNK, window // 4))


def check_local_inputs(q: Tensor, k: Tensor, v: Tensor, window: int, q_seg: Tensor | None,
                       k_seg: Tensor | None) -> int:
    """Raise a clear error for inputs that do not fit the layout above; return P, the keys before the queries."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"local attention expects q (B, T, H, d) and k, v (B, P + T, H_kv, d) of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, d = q.shape
    if k.shape[0] != B or k.shape[3] != d or k.shape[1] < T or H % k.shape[2]:
        raise ValueError(f"keys {tuple(k.shape)} do not match queries {tuple(q.shape)}: need the batch and head "
                         f"dim of q, at least T={T} keys, and H={H} a multiple of the key heads")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int")
    if (q_seg is None) != (k_seg is None):
        raise ValueError("give both q_seg and k_seg, or neither")
    if q_seg is not None and (q_seg.shape != (B, T) or k_seg.shape != (B, k.shape[1])):
        raise ValueError(f"segments must be (B, T)={B, T} and (B, P + T)={B, k.shape[1]}, "
                         f"got {tuple(q_seg.shape)} and {tuple(k_seg.shape)}")
    return k.shape[1] - T


def fused_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
               causal: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` on (N, H, L, d) queries and (N, H_kv, S, d) keys/values, H a multiple of
    H_kv (query head h uses key/value head h // (H / H_kv)). With a mask, the key/value heads are broadcast (a
    zero-stride view when H_kv = 1) rather than passed with ``enable_gqa``: CUDA's fused kernels refuse a mask
    together with ``enable_gqa``, and PyTorch then silently runs the math kernel, which materialises every score."""
    H, Hk = q.shape[1], k.shape[1]
    if Hk == H or mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=Hk != H)
    k, v = (t[:, :, None].expand(t.shape[0], Hk, H // Hk, *t.shape[2:]).reshape(t.shape[0], H, *t.shape[2:])
            for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def attention_bmm(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """:func:`fused_sdpa` with a mask, as two batched matmuls with the masked softmax between, in float32 (or wider)
    outside autocast: q (N, H, L, d) over k, v (N, H_kv, S, d); ``mask`` (L, S) or (N or 1, 1, L, S), True where a
    query sees a key. Under bf16 autocast (a bf16 training step) autocast runs the matmuls in bf16, so the scores and
    probabilities are bf16: kept so for speed (docs/performance.md, "Local attention").
    The query heads sharing a key/value head are rows of one matmul (no copy of the keys per head). Holds the
    (N, H, L, S) scores: for small blocks."""
    N, H, L, d = q.shape
    Hk = k.shape[1]
    G = H // Hk
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = d**-0.5 if scale is None else scale
    scores = torch.matmul(q.to(acc).reshape(N, Hk, G * L, d), k.to(acc).transpose(-1, -2)) * scale
    # each row's mask, for the G heads' rows stacked: (G * L, S) or (N or 1, 1, G * L, S); Inductor's softmax over
    # a 5-D view of the scores, the mask broadcast over G, ran at half the speed
    seen = mask if G == 1 else mask.repeat(G, 1) if mask.dim() == 2 else mask.repeat(1, 1, G, 1)
    # the mask as an additive bias (0 where seen, -inf where not), one small tensor: with masked_fill on the scores,
    # Inductor's compiled softmax recomputed a causal mask's index arithmetic for every score in each of its passes
    bias = torch.zeros(seen.shape, dtype=scores.dtype, device=scores.device).masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores + bias, dim=-1)
    return torch.matmul(probs, v.to(acc)).view(N, H, L, d).to(q.dtype)


def fused_sdpa_float32(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                       scale: float | None = None) -> Tensor:
    """:func:`fused_sdpa` on float32 copies of half-precision inputs, the output in their dtype (outside autocast,
    which would cast them back)."""
    with torch.autocast(q.device.type, enabled=False):
        return fused_sdpa(q.float(), k.float(), v.float(), mask, scale).to(q.dtype)


def compiled_cpu_half(q: Tensor) -> bool:
    """Whether ``q`` is a bf16 (or fp16) CPU tensor in a step being compiled: where the choices below apply."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling()


def chunks_by_bmm(q: Tensor, span: int) -> bool:
    """Whether :func:`sliding_window_attention` attends its chunks of ``span`` keys by :func:`attention_bmm`."""
    return compiled_cpu_half(q) and span <= BMM_MAX_SPAN


def causal_by_bmm(q: Tensor, masked: bool = True) -> bool:
    """Whether :func:`causal_attention` attends q (N, H, T, d) by chunks through :func:`attention_bmm`; ``masked``:
    with a window or documents (else global attention, which the fused kernel takes without a mask)."""
    limit = CAUSAL_BMM_MAX_LEN if masked or not AMX else AMX_CAUSAL_BMM_MAX_LEN
    return compiled_cpu_half(q) and q.shape[2] <= limit


def local_by_causal_chunks(q: Tensor) -> bool:
    """Whether local attention of q (B, T, H, d) over its own T keys (no cache) goes through :func:`causal_attention`
    with the window, chunk i over the keys from the first its window reaches: where :func:`causal_by_bmm`. Less work
    than :func:`sliding_window_attention`'s chunks (the first chunks see fewer keys than the window) and no mask
    materialised per chunk."""
    return causal_by_bmm(q.transpose(1, 2))


def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """(L, S): True where the query at position q_pos[i] sees the key at k_pos[j]: not after it, and within the
    ``window`` most recent keys if given."""
    delta = q_pos[:, None] - k_pos[None, :]
    return delta >= 0 if window is None else (delta >= 0) & (delta < window)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, q_seg: Tensor | None = None,
                     k_seg: Tensor | None = None, chunk: int | None = None, window: int | None = None) -> Tensor:
    """Causal attention of q (N, H, T, d) over k, v (N, H_kv, T, d), within each document if given segments q_seg,
    k_seg (N, T), and within the ``window`` most recent keys if given (local attention). With ``chunk`` (default
    where :func:`causal_by_bmm`: :data:`CAUSAL_BMM_CHUNK`, or all T in one if T <= :data:`BMM_MAX_SPAN` and no
    window): queries in chunks of that many, chunk i through :func:`attention_bmm` over the keys from the first its
    window reaches to its last query, the later ones being masked for all of it: without a window (n + 1) / 2n of
    the whole T x T score work for n chunks, and scores that stay in cache. Else :func:`fused_sdpa`, its reference."""
    T = q.shape[2]
    if chunk is None and causal_by_bmm(q, masked=window is not None or q_seg is not None):
        chunk = T if T <= BMM_MAX_SPAN and window is None else CAUSAL_BMM_CHUNK
    if chunk is None and q_seg is None and window is None:
        return fused_sdpa(q, k, v, None, scale, causal=True)
    idx = torch.arange(T, device=q.device)
    outs, step = [], chunk or T
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        start = 0 if window is None else max(0, lo - window + 1)
        mask = causal_mask(idx[lo:hi], idx[start:hi], window)  # (C, hi - start)
        if q_seg is not None:
            mask = (mask & (q_seg[:, lo:hi, None] == k_seg[:, None, start:hi]))[:, None]  # (N, 1, C, hi - start)
        qc, kc, vc = q[:, :, lo:hi], k[:, :, start:hi], v[:, :, start:hi]
        outs.append(attention_bmm(qc, kc, vc, mask, scale) if chunk else fused_sdpa(qc, kc, vc, mask, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def sliding_window_attention_ref(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None,
                                 q_seg: Tensor | None = None, k_seg: Tensor | None = None) -> Tensor:
    """The definition: one dense (T, P + T) mask, causal, within the window, same document."""
    P = check_local_inputs(q, k, v, window, q_seg, k_seg)
    T = q.shape[1]
    q_pos = torch.arange(P, P + T, device=q.device)
    k_pos = torch.arange(P + T, device=q.device)
    mask = causal_mask(q_pos, k_pos, window)
    if q_seg is not None:
        mask = (mask & (q_seg[:, :, None] == k_seg[:, None, :]))[:, None]
    out = fused_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale)
    return out.transpose(1, 2)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None,
                             q_seg: Tensor | None = None, k_seg: Tensor | None = None,
                             chunk: int | None = None, bmm: bool | None = None) -> Tensor:
    """Local attention in chunks of ``chunk`` queries (default :func:`local_chunk`); see the module docstring.
    ``bmm``: attend the chunks by :func:`attention_bmm` (True) or the fused kernel (False); None: by
    :func:`chunks_by_bmm`."""
    P = check_local_inputs(q, k, v, window, q_seg, k_seg)
    B, T, H, d = q.shape
    C = min(chunk or local_chunk(window), T)
    keep = min(P, window - 1)  # older keys are out of every query's window
    if T <= C:  # one chunk: attend to the kept keys directly
        k_seg = None if k_seg is None else k_seg[:, P - keep :]
        return sliding_window_attention_ref(q, k[:, P - keep :], v[:, P - keep :], window, scale, q_seg, k_seg)
    n = -(-T // C)
    span = C + window - 1  # keys that can reach a chunk of queries
    front, back = window - 1 - keep, n * C - T  # zero keys before the kept ones; padding queries after the last

    # Chunk i of queries: padded query index i*C + j sits at padded key index (window - 1) + i*C + j, and sees the
    # padded keys i*C + r for r in [j, j + window - 1]. Chunks are stacked chunk-major: batch index i * B + b.
    def query_chunks(t: Tensor) -> Tensor:  # (B, T, H, d) -> (n * B, H, C, d)
        t = F.pad(t, (0, 0, 0, 0, 0, back))
        return t.view(B, n, C, t.shape[2], d).permute(1, 0, 3, 2, 4).reshape(n * B, t.shape[2], C, d)

    def key_chunks(t: Tensor) -> Tensor:  # (B, P + T, H_kv, d) -> (n * B, H_kv, span, d)
        t = F.pad(t[:, P - keep :], (0, 0, 0, 0, front, back))
        return t.unfold(1, span, C).permute(1, 0, 2, 4, 3).reshape(n * B, t.shape[2], span, d)

    qc, kc, vc = query_chunks(q), key_chunks(k), key_chunks(v)
    if chunks_by_bmm(q, span) if bmm is None else bmm:
        attend = attention_bmm
    else:  # masked chunks in half precision: the fused CPU kernel is faster in float32 in a compiled step
        attend = fused_sdpa_float32 if compiled_cpu_half(q) else fused_sdpa
    j = torch.arange(C, device=q.device)[:, None]
    r = torch.arange(span, device=q.device)[None, :]
    band = (r >= j) & (r < j + window)  # (C, span): the same for every chunk
    if q_seg is not None:  # per row and chunk: the band, within the keys, same document (padding queries: the band)
        i = torch.arange(n, device=q.device)[:, None, None] * C
        qs = F.pad(q_seg, (0, back)).view(B, n, C)
        ks = F.pad(k_seg[:, P - keep :], (front, back)).unfold(1, span, C)  # (B, n, span)
        same = (qs[..., :, None] == ks[..., None, :]) | (i + j >= T)
        mask = band & (i + r >= front) & same  # (B, n, C, span)
        out = attend(qc, kc, vc, mask.transpose(0, 1).reshape(n * B, 1, C, span), scale)
    else:  # only the first chunks see zero keys: mask them per chunk, the rest with the shared band
        h = min(n, -(-front // C))
        outs = []
        if h:
            i = torch.arange(h, device=q.device)[:, None, None] * C
            head = (band & (i + r >= front))[:, None].expand(h, B, C, span).reshape(h * B, 1, C, span)
            outs.append(attend(qc[: h * B], kc[: h * B], vc[: h * B], head, scale))
        if h < n:
            outs.append(attend(qc[h * B :], kc[h * B :], vc[h * B :], band, scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
    out = out.view(n, B, H, C, d).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, d)
    return out[:, :T]


def attend_one(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """One query per row: q (B, H, d) over keys and values (B, S, H_kv, d) with an additive mask ``bias`` (B, S)
    (0 or -inf) -> (B, H, d). Two batched matmuls, the scale and the mask fused into the first."""
    B, H, d = q.shape
    S, Hk = k.shape[1], k.shape[2]
    qg = q.reshape(B * Hk, H // Hk, d)  # the heads sharing a key/value head side by side
    kt = k.permute(0, 2, 3, 1).reshape(B * Hk, d, S)
    vs = v.transpose(1, 2).reshape(B * Hk, S, d)
    bias = bias[:, None, None, :].expand(B, Hk, 1, S).reshape(B * Hk, 1, S).to(q.dtype)
    scores = torch.baddbmm(bias, qg, kt, alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(probs, vs).view(B, H, d)


def masked_attention_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """The definition: q (B, T, H, d) over k, v (B, S, H_kv, d) where ``mask`` (B, T, S) is True, by fused SDPA."""
    out = fused_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scale)
    return out.transpose(1, 2)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of q (B, T, H, d) over k, v (B, S, H_kv, d) where ``mask`` (B, T, S) is True: :func:`attend_one` for
    one query per row, else :func:`masked_attention_ref`. Every query must see at least one key."""
    if q.shape[1] == 1:
        bias = torch.zeros(mask.shape[0], mask.shape[2], dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~mask[:, 0], float("-inf"))
        return attend_one(q[:, 0], k, v, bias, scale)[:, None]
    return masked_attention_ref(q, k, v, mask, scale)

