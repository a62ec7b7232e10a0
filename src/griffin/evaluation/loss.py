"""Held-out loss streamed through the model (Section 6.1, Figure 5; Appendix I).

A document is fed in chunks of ``chunk_size`` tokens with the inference cache carried from one chunk to the next,
so Hawk and Griffin score a document of any length in memory that does not grow with it (their state is fixed:
the RG-LRU state, the last Conv1D inputs and a window of keys and values); the MQA Transformer's global attention
needs a KV cache sized to the document, which is checked against the free memory first. Every token after the first
is scored: its loss is -log p(token | every token before it in the document).

- :func:`token_losses`: the loss of every token of a batch of documents (streamed); :func:`reference_token_losses`:
  the same from one full forward pass, for tests;
- :func:`evaluate_loss`: mean loss, perplexity and bits per byte over documents;
- :func:`per_position_loss`: the mean loss at each position of documents cut to ``max_length`` tokens, in
  log-spaced buckets (Figure 5: does the prediction keep improving far past the training length?).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from griffin.cache import cache_bytes
from griffin.data.tokenizer import Tokenizer
from griffin.model import CausalLM

Document = np.ndarray | Sequence[int]


def available_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` (CUDA: free device memory; CPU: available physical memory), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(model: CausalLM, batch_size: int, length: int) -> None:
    """Refuse (with the sizes) a global-attention KV cache of ``length`` tokens that would not fit in free memory."""
    if "attention" not in model.config.block_types:
        return
    need = cache_bytes(model.config, batch_size, length, model.dtype)
    free = available_memory(model.device)
    if free is not None and need > 0.8 * free:
        raise ValueError(f"the global-attention KV cache for {batch_size} document(s) of {length:,} tokens needs "
                         f"{need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free: lower --batch-size or "
                         f"--max-length (Hawk and Griffin need no such cache)")


def _as_array(doc: Document) -> np.ndarray:
    arr = np.asarray(doc, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
    return arr


@torch.no_grad()
def token_losses(model: CausalLM, documents: Sequence[Document], chunk_size: int = 1024,
                 bar: tqdm | None = None) -> list[np.ndarray]:
    """The loss (nats, float64) of every token after the first of each document: ``out[b][t]`` is
    -log p(doc[t + 1] | doc[: t + 1]). The documents are processed side by side (right-padded), ``chunk_size``
    tokens at a time with the cache carried over; ``bar`` is advanced by the tokens scored."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    docs = [_as_array(d) for d in documents]
    if not docs:
        return []
    vocab = model.config.vocab_size
    for i, d in enumerate(docs):
        if len(d) and (d.min() < 0 or d.max() >= vocab):
            bad = int(d.min()) if d.min() < 0 else int(d.max())
            raise ValueError(f"document {i} has token id {bad} outside the vocabulary [0, {vocab})")
    lengths = [len(d) for d in docs]
    longest = max(lengths)
    out = [np.zeros(max(n - 1, 0), np.float64) for n in lengths]
    if longest < 2:
        return out
    check_cache_fits(model, len(docs), longest)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, : len(d)] = torch.from_numpy(d)
    cache = model.init_cache(len(docs), longest)
    device = model.device
    for start in range(0, longest - 1, chunk_size):  # the last token predicts nothing
        stop = min(start + chunk_size, longest - 1)
        logits = model(ids[:, start:stop].to(device), cache=cache)
        logp = F.log_softmax(logits.float(), dim=-1)
        targets = ids[:, start + 1 : stop + 1].to(device)
        nll = -logp.gather(-1, targets[..., None])[..., 0].double().cpu().numpy()
        scored = 0
        for b, n in enumerate(lengths):
            end = min(stop, n - 1)
            if end > start:
                out[b][start:end] = nll[b, : end - start]
                scored += end - start
        if bar is not None:
            bar.update(scored)
    return out


@torch.no_grad()
def reference_token_losses(model: CausalLM, document: Document) -> np.ndarray:
    """:func:`token_losses` of one document from a single full forward pass (no cache, no chunks)."""
    ids = torch.as_tensor(_as_array(document))[None].to(model.device)
    logp = F.log_softmax(model(ids).float(), dim=-1)[0, :-1]
    return -logp.gather(-1, ids[0, 1:, None])[:, 0].double().cpu().numpy()


def _batches(docs: list[np.ndarray], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Indices of documents in batches of similar length (longest first), at most ``batch_size`` documents and
    about ``max_tokens`` padded tokens each."""
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and \
                (len(batches[-1]) + 1) * len(docs[batches[-1][0]]) <= max(max_tokens, len(docs[batches[-1][0]])):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _check_args(chunk_size: int, batch_size: int) -> None:
    for name, value in (("chunk_size", chunk_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass
class LossResult:
    """Mean loss over every scored token (nats), its perplexity and bits per byte of the scored text."""

    documents: int
    tokens: int
    bytes: int
    nats: float
    mean_loss: float
    perplexity: float
    bits_per_byte: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def scored_bytes(tokenizer: Tokenizer, doc: np.ndarray) -> int:
    """UTF-8 bytes of the text of a document's scored tokens (all but the first; BOS/EOS count none)."""
    special = {tokenizer.bos_id, tokenizer.eos_id} - {None}
    ids = [int(t) for t in doc[1:] if int(t) not in special]
    return len(tokenizer.decode(ids).encode("utf-8", "surrogateescape")) if ids else 0


def evaluate_loss(model: CausalLM, documents: Iterable[Document], tokenizer: Tokenizer | None = None, *,
                  chunk_size: int = 1024, batch_size: int = 8, max_documents: int | None = None,
                  progress: bool = True) -> LossResult:
    """Mean loss, perplexity and (with ``tokenizer``) bits per byte over ``documents`` (token arrays), each scored
    whole, streamed in chunks (:func:`token_losses`); documents of similar length share a batch."""
    _check_args(chunk_size, batch_size)
    docs = []
    for d in documents:
        if max_documents is not None and len(docs) >= max_documents:
            break
        docs.append(_as_array(d))
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise ValueError("no document of at least 2 tokens to score")
    total_tokens = sum(len(d) - 1 for d in docs)
    nats = 0.0
    with tqdm(total=total_tokens, unit="tok", desc="loss", disable=not progress, dynamic_ncols=True) as bar:
        for batch in _batches(docs, batch_size, max_tokens=batch_size * chunk_size):
            for losses in token_losses(model, [docs[i] for i in batch], chunk_size, bar):
                nats += float(losses.sum())
    n_bytes = sum(scored_bytes(tokenizer, d) for d in docs) if tokenizer is not None else 0
    mean = nats / total_tokens
    bpb = nats / math.log(2) / n_bytes if n_bytes else None
    return LossResult(len(docs), total_tokens, n_bytes, nats, mean, math.exp(min(mean, 700.0)), bpb)


def log_buckets(max_length: int, num_buckets: int) -> np.ndarray:
    """Edges ``e_0 = 1 < e_1 < ... = max_length`` of log-spaced buckets of target positions [e_i, e_{i+1})."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be at least 2")
    edges = np.unique(np.round(np.geomspace(1, max_length, num_buckets + 1)).astype(np.int64))
    return edges


@dataclass
class PerPositionResult:
    """Mean loss at each target position 1 .. max_length - 1 over documents cut to ``max_length`` tokens, and in
    log-spaced buckets; documents shorter than ``max_length`` are counted (and left out), never silently."""

    max_length: int
    documents: int
    short_documents: int
    short_lengths: list[int]
    bucket_start: list[int]
    bucket_end: list[int]
    bucket_loss: list[float]
    bucket_std: list[float]
    position_loss: list[float] = field(repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def per_position_loss(model: CausalLM, documents: Iterable[Document], max_length: int, *, chunk_size: int = 1024,
                      batch_size: int = 8, num_buckets: int = 24, max_documents: int | None = None,
                      progress: bool = True) -> PerPositionResult:
    """Figure 5: the first ``max_length`` tokens of every document at least that long, scored by streaming
    (:func:`token_losses`); the mean loss at each position and in ``num_buckets`` log-spaced buckets (each bucket's
    ``bucket_std`` is the standard deviation over documents of their mean loss in it)."""
    _check_args(chunk_size, batch_size)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r} must be an integer >= 2")
    long_docs, short = [], []
    for d in documents:
        d = _as_array(d)
        if len(d) >= max_length:
            if max_documents is None or len(long_docs) < max_documents:
                long_docs.append(d[:max_length])
        else:
            short.append(len(d))
    if not long_docs:
        longest = max(short, default=0)
        raise ValueError(f"no document has --max-length={max_length} tokens (the longest of {len(short)} has "
                         f"{longest}): lower --max-length or give longer documents")
    rows = np.zeros((len(long_docs), max_length - 1), np.float64)
    with tqdm(total=rows.size, unit="tok", desc=f"loss/position L={max_length}", disable=not progress,
              dynamic_ncols=True) as bar:
        for start in range(0, len(long_docs), batch_size):
            losses = token_losses(model, long_docs[start : start + batch_size], chunk_size, bar)
            rows[start : start + len(losses)] = np.stack(losses)
    edges = log_buckets(max_length, num_buckets)
    means, stds = [], []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        per_doc = rows[:, a - 1 : b - 1].mean(axis=1)  # row column t scores position t + 1
        means.append(float(per_doc.mean()))
        stds.append(float(per_doc.std()))
    return PerPositionResult(max_length, len(long_docs), len(short), sorted(short), [int(e) for e in edges[:-1]],
                             [int(e) for e in edges[1:]], means, stds, rows.mean(axis=0).tolist())
