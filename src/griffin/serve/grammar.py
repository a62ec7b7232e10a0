"""Structured output (``response_format``): JSON mode and JSON-schema mode through the llguidance grammar library.

A request's ``response_format`` is parsed into a :class:`ResponseFormat` (a hashable spec that travels in
:class:`griffin.serve.sampling.SamplingParams`). :class:`GrammarCompiler` compiles it once per schema (a bounded LRU
of compiled template matchers) and hands each choice of each request its own :class:`RowGrammar` (a copy of the
template's matcher; it is dropped with the row). At every step the engine asks :meth:`GrammarCompiler.mask` for the
allowed tokens of its grammar rows: llguidance fills one bit per token into a preallocated int32 bitmask (without
the GIL; from :data:`PARALLEL_ROWS` rows on, all in one call on its thread pool), which is unpacked (numpy on the
CPU, on the device for CUDA logits) into the boolean mask that :func:`griffin.serve.sampling.sample_rows` applies
before temperature, top-k and top-p.

**Why llguidance** (of llguidance, xgrammar and outlines-core): it is a small Rust wheel (abi3, one file, no
dependencies: no torch, transformers or triton pin; xgrammar 0.2.9 requires torch, transformers, triton and
apache-tvm-ffi), it compiles JSON schemas itself and refuses what it cannot enforce with a message naming the
problem, it computes masks lazily from the parser state (no up-front per-vocabulary index as in outlines-core, whose
JSON support goes through a schema-to-regex step), it takes a tokenizer as a plain list of token bytes (so the
byte-level and SentencePiece tokenizers need no HF wrapper) and reads HF ``tokenizer.json`` files directly, and
vLLM and SGLang use it as a structured-output backend. Its bitmask layout is xgrammar's too.

**Tokenizers.** The library sees each token id as its bytes, plus an EOS token. Byte-level: one byte per id. HF
``tokenizers``: the ``tokenizer.json`` is handed to llguidance. SentencePiece: pieces with ``▁`` as a space and
byte-fallback pieces (``<0x41>``) as their byte; control and unknown pieces are special (never allowed). Ids past the
tokenizer's vocabulary (a padded embedding) are never allowed. A tokenizer without EOS (the byte-level one) gets a
virtual EOS id past the model's vocabulary: it is never sampled, and a row ends when its grammar cannot continue
(after the closing ``}`` of an object); a schema whose top-level value can always grow (a bare number) then runs to
``max_tokens``.

**Ending.** After each sampled token the row's matcher advances; when the grammar is complete and allows nothing
but EOS the row finishes with reason ``stop`` (no EOS step is spent). Sampling EOS where the grammar accepts ends it
too. A row that reaches ``max_tokens`` mid-JSON finishes with ``length``, as OpenAI's does.

**Whitespace.** Unless a schema says otherwise (llguidance's ``x-guidance`` key), output is JSON as Python's
``json.dumps`` writes it: ``", "`` and ``": "`` separators and no other whitespace, so a model cannot wander in
whitespace.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("griffin.serve")

INSTALL_HINT = "pip install 'griffin[serve]' (it brings the llguidance grammar library)"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("text", "json_object", "json_schema")
PARALLEL_ROWS = 8  # from this many grammar rows in a step, llguidance fills their masks on its thread pool


class GrammarError(ValueError):
    """A response_format the server cannot use: ``status`` 400 (a bad format or schema) or 501 (no grammar library,
    or a tokenizer the library cannot read)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ResponseFormat:
    """A parsed ``response_format``: ``kind`` json_object or json_schema, and the schema as JSON text (properties in
    the order the client gave them)."""

    kind: str
    schema: str
    name: str | None = None

    @property
    def key(self) -> str:
        return self.schema


def parse_response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's ``response_format`` object as a :class:`ResponseFormat` (None for absent or ``{"type": "text"}``);
    raises :class:`GrammarError` naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GrammarError(f"response_format must be an object like {{\"type\": \"json_object\"}}, got {value!r}")
    kind = value.get("type")
    if kind not in KINDS:
        raise GrammarError(f"response_format.type={kind!r} is not supported: use one of {', '.join(KINDS)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", '{"type": "object"}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema must be an object holding the schema: "
                           f"{{\"name\": ..., \"schema\": {{...}}}}, got {spec!r}")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"response_format.json_schema.schema must be a JSON schema (an object), got {schema!r}")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise GrammarError(f"response_format.json_schema.name must be a string, got {name!r}")
    return ResponseFormat("json_schema", json.dumps(schema, ensure_ascii=False), name)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:
        raise GrammarError(f"response_format needs the llguidance library, which is not installed: {INSTALL_HINT}",
                           status=501) from err
    return llguidance


class _TokenBytes:
    """A griffin tokenizer in the shape llguidance's ``TokenizerWrapper`` reads: every id's bytes, EOS, encode."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        size = tokenizer.vocab_size
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        sp = getattr(tokenizer, "sp", None)
        for i in range(n_vocab):
            if i >= size:
                self.tokens.append(b"")
                self.special_token_ids.append(i)
            elif hasattr(tokenizer, "decode_bytes"):  # byte-level
                self.tokens.append(tokenizer.decode_bytes([i]))
            elif sp is not None:
                piece = sp.id_to_piece(i)
                if sp.is_byte(i):
                    self.tokens.append(bytes([int(piece[3:-1], 16)]))
                elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                    self.tokens.append(piece.encode())
                    self.special_token_ids.append(i)
                else:
                    self.tokens.append(piece.replace("\u2581", " ").encode())
            else:
                self.tokens.append(tokenizer.decode([i]).encode("utf-8", "surrogateescape"))
        eos = tokenizer.eos_id
        if eos is None:  # a virtual EOS past the vocabulary: never sampled (see the module docstring)
            eos = len(self.tokens)
            self.tokens.append(b"")
            self.special_token_ids.append(eos)
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_id
        self._index: dict[bytes, int] | None = None
        self._longest = 1

    def __call__(self, text: bytes | str) -> list[int]:
        """Token ids whose bytes are exactly ``text``'s: the tokenizer's own encoding when it round-trips (a
        SentencePiece one without its dummy-prefix space), else greedy longest-match over the token bytes."""
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
        if hasattr(self.tokenizer, "encode_bytes"):
            return self.tokenizer.encode_bytes(data)
        sp = getattr(self.tokenizer, "sp", None)
        try:
            s = data.decode("utf-8")
            if sp is not None:  # the marker's tokens are cut off again, as transformers' Llama tokenizer does
                marker = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else "\n"
                ids = sp.encode(marker + s)[len(sp.encode(marker)):]
            else:
                ids = self.tokenizer.encode(s)
            if b"".join(self.tokens[i] for i in ids) == data:
                return ids
        except (UnicodeDecodeError, IndexError):
            pass
        return self._greedy(data)  # SentencePiece drops or merges whitespace, and partial UTF-8 has no text

    def _greedy(self, data: bytes) -> list[int]:
        if self._index is None:
            special = set(self.special_token_ids)
            sp = getattr(self.tokenizer, "sp", None)
            self._index = {}
            for i in sorted(range(len(self.tokens)), key=lambda i: sp is not None and sp.is_byte(i)):
                if self.tokens[i] and i not in special:  # a piece before the byte-fallback token of its bytes
                    self._index.setdefault(self.tokens[i], i)
            self._longest = max(map(len, self._index), default=1)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._index.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                i += 1  # a byte no token holds (no byte fallback): left out
        return out


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """The llguidance ``LLTokenizer`` of a griffin tokenizer, for a model of ``vocab_size`` logits (ids past the
    tokenizer's vocabulary are never allowed; see the module docstring for EOS)."""
    llg = _llguidance()
    n_vocab = max(vocab_size, tokenizer.vocab_size)
    tok = getattr(tokenizer, "tok", None)  # HF tokenizers: llguidance reads the tokenizer.json itself
    try:
        if tok is not None and hasattr(tok, "to_str") and tokenizer.eos_id is not None:
            return llg.LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=tokenizer.eos_id)
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenBytes(tokenizer, n_vocab)))
    except Exception as err:  # the library raises ValueError/RuntimeError on a tokenizer it cannot read
        raise GrammarError(f"llguidance cannot read this server's {type(tokenizer).__name__} tokenizer: {err}",
                           status=501) from err


class RowGrammar:
    """The grammar state of one choice (one row): fill its mask, advance it by the sampled token."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Consume the sampled token; True when the row must end (the grammar is complete and allows only EOS, or,
        which the mask prevents, the token was not allowed)."""
        m = self.matcher
        if not m.consume_token(token):
            log.warning("grammar rejected token %d: %s", token, m.get_error())
            return True
        return m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """Compiles response formats for one tokenizer and model vocabulary, caches them (``cache_size`` schemas, least
    recently used dropped first), and computes the batched token masks. Thread-safe (the HTTP thread compiles to
    refuse bad schemas early; the engine thread makes row grammars and masks)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 64) -> None:
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._tok: Any = None
        self._executor: Any = None
        self._bitmask: Tensor | None = None
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.compiled = 0  # compilations done (cache misses)

    def _ll_tokenizer(self) -> Any:
        if self._tok is None:
            if self.tokenizer is None:
                raise GrammarError("response_format needs a tokenizer: this engine serves token ids only")
            self._tok = ll_tokenizer(self.tokenizer, self.vocab_size)
        return self._tok

    def compile(self, fmt: ResponseFormat) -> Any:
        """The template matcher of ``fmt`` (compiled once, then cached); raises :class:`GrammarError` naming the
        problem when the library cannot compile the schema."""
        with self._lock:
            hit = self._cache.get(fmt.key)
            if hit is not None:
                self._cache.move_to_end(fmt.key)
                return hit
            llg = _llguidance()
            tok = self._ll_tokenizer()
            what = "the json_object grammar" if fmt.kind == "json_object" else \
                f"response_format.json_schema{f' {fmt.name!r}' if fmt.name else ''}"
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(fmt.schema, defaults=JSON_OPTIONS)
            except ValueError as err:
                raise GrammarError(f"{what} is not a usable JSON schema: {err}") from err
            matcher = llg.LLMatcher(tok, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(f"{what} cannot be compiled by llguidance: {matcher.get_error()}")
            self.compiled += 1
            self._cache[fmt.key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return matcher

    def row(self, fmt: ResponseFormat) -> RowGrammar:
        """A fresh grammar state for one choice of a request."""
        return RowGrammar(self.compile(fmt).deep_copy())

    def mask(self, rows: list[tuple[int, RowGrammar]], vocab: int, device: torch.device | str) -> Tensor:
        """The allowed tokens (len(rows), vocab) of each ``(row, grammar)`` pair, as a bool tensor on ``device``
        (llguidance fills a preallocated int32 bitmask for all rows in one call)."""
        words = (self._ll_tokenizer().vocab_size + 31) // 32
        k = len(rows)
        if self._bitmask is None or self._bitmask.shape[0] < k or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(max(k, 8), words, dtype=torch.int32)
        bitmask = self._bitmask
        if k < PARALLEL_ROWS:  # a few rows: one call each (tens of microseconds; threads cost more)
            for j, (_, g) in enumerate(rows):
                g.matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(g.matcher, j) for j, (_, g) in enumerate(rows)],
                                                   bitmask.data_ptr(), words * 4, bitmask.shape[0])
        if torch.device(device).type == "cpu":  # numpy's unpackbits: a few microseconds even for 256K tokens
            bits = np.unpackbits(bitmask[:k].numpy().view(np.uint8), axis=1, bitorder="little")
            allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_))
        else:  # the packed words travel (32x fewer bytes) and are unpacked on the device
            packed = bitmask[:k].to(device, non_blocking=True)
            if self._shifts.device != packed.device:
                self._shifts = self._shifts.to(packed.device)
            allowed = ((packed[:, :, None] >> self._shifts) & 1).reshape(k, -1)[:, :vocab].bool()
        if vocab > allowed.shape[1]:  # logits past the library's vocabulary: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(k, vocab - allowed.shape[1])], 1)
        return allowed
